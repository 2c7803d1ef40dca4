"""Tool calls for chat templates: whether a template renders tools, which call format the model
speaks, the tool-call parsers, and the JSON Schema that forces a call.

Contract: `renders_tools(tok)`: the chat template reads `tools`; `call_format(tok)`: "hermes"
(`<tool_call>{json}</tool_call>`), "mistral" (`[TOOL_CALLS][{...}]`), "llama3" (a bare `{"name",
"parameters"}`) or "generic" (a bare `{"name", "arguments"}`). `parse_calls(text, names)` finds the
calls of a finished reply in any of those formats; `ToolScanner` does it for a stream, sending a
canonically written call as OpenAI deltas while it is written and parsing anything else at the end.
Only calls to the request's own tools count. `forced_call` is what a grammar needs to force calls.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import dataclass
from typing import ClassVar

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's call marker (a special token, usually decoded away)
MID_OPENERS = (HERMES_OPEN, MISTRAL_OPEN)  # markers that may start a call after some content
START_OPENERS = ("{", "[", "```", PYTHON_TAG)  # a reply starting with one of these may be a bare call


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 hex digits, new per call
    name: str  # the function's name (one of the request's tools)
    arguments: str  # a JSON object as text (what OpenAI's `function.arguments` holds)

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def template_source(tok) -> str | None:
    """The chat template transformers would use for a request with tools (None: no template)."""
    try:
        return tok.get_chat_template(None, tools=[{"type": "function", "function": {"name": "probe"}}])
    except (ValueError, TypeError, AttributeError):
        return None


def renders_tools(tok) -> bool:
    source = template_source(tok)
    return bool(source) and _reads_tools(source)


@functools.lru_cache(maxsize=16)
def _reads_tools(source: str) -> bool:
    import jinja2  # what transformers renders chat templates with
    import jinja2.meta

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:  # tags of transformers' own environment ({% generation %}): by name
        return re.search(r"\btools\b", source) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def call_format(tok) -> str:
    source = template_source(tok) or ""
    marks = ((HERMES_OPEN, "hermes"), (MISTRAL_OPEN, "mistral"), (PYTHON_TAG, "llama3"), ("ipython", "llama3"))
    return next((fmt for mark, fmt in marks if mark in source), "generic")


def parse_arguments(value) -> dict:
    """OpenAI's `arguments` (JSON text or an object) as an object; ValueError saying why."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"a JSON object is needed, got {type(parsed).__name__}")
    return parsed


def new_call(name: str, arguments) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall("call_" + secrets.token_hex(12), name, text)


def _as_call(obj, names) -> ToolCall | None:
    """A parsed JSON value as a call: {"name", "arguments" | "parameters"} naming one of `names`."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = parse_arguments(args)
        except ValueError:
            return None
    return new_call(obj["name"], args) if isinstance(args, dict) else None


def _json_values(text: str) -> list | None:
    """The JSON values `text` consists of (separated by whitespace, ';' or ','), or None."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _bare_calls(text: str, names) -> list[ToolCall] | None:
    """Calls written as bare JSON (Llama 3.1+, Mistral once its marker is decoded away, generic):
    one object, several, or a list of them; optionally in a ```json fence or after <|python_tag|>."""
    text = text.strip().removeprefix(PYTHON_TAG).removeprefix(MISTRAL_OPEN).strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    values = _json_values(fence.group(1) if fence else text)
    if not values:
        return None
    items = [item for v in values for item in (v if isinstance(v, list) else [v])]
    calls = [_as_call(item, names) for item in items]
    return calls if calls and all(calls) else None


def _mistral_named(text: str, names) -> list[ToolCall] | None:
    """Mistral's newer format: [TOOL_CALLS]name[ARGS]{...} (repeated)."""
    calls = []
    for part in text.split(MISTRAL_OPEN)[1:]:
        name, sep, rest = part.partition("[ARGS]")
        name = name.split("[CALL_ID]")[0].strip()
        values = _json_values(rest) if sep else None
        if name not in names or not values or not isinstance(values[0], dict):
            return None
        calls.append(new_call(name, values[0]))
    return calls or None


def parse_calls(text: str, names) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished reply: the text before the first call marker is content; a
    reply whose calls do not parse (or name no tool of the request) is all content, no calls."""
    names = set(names)
    for marker in MID_OPENERS:
        at = text.find(marker)
        if at < 0:
            continue
        if marker == HERMES_OPEN:
            bodies = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text[at:], re.DOTALL)
            calls = [c for body in bodies for c in (_bare_calls(body, names) or [None])]
        else:
            calls = _bare_calls(text[at:], names) or _mistral_named(text[at:], names) or [None]
        if calls and all(calls):
            return text[:at].rstrip(), calls
        return text, []
    calls = _bare_calls(text, names)
    return ("", calls) if calls else (text, [])


SKIPPABLE = (HERMES_OPEN, HERMES_CLOSE, MISTRAL_OPEN, PYTHON_TAG, "[", "]", ",", ";")  # around streamed calls
SCALAR = set("0123456789-+.eEtruefalsn \t\r\n,:")  # what JSON outside strings holds besides brackets


class _Arguments:
    """A streamed call's arguments object, checked as it comes: `eat(text)` returns how much of
    `text` belongs to it; `done` once it closed, `broken` once a character could not continue JSON."""

    PAIRS: ClassVar[dict[str, str]] = {"}": "{", "]": "["}

    def __init__(self):
        self.stack: list[str] = []
        self.string = self.escape = self.done = self.broken = False
        self.text = ""

    def eat(self, text: str) -> int:
        for i, c in enumerate(text):
            if self.string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.string = False
                elif c < " ":
                    return self._end(text, i, broken=True)
            elif c in "{[":
                self.stack.append(c)
            elif c in "}]":
                if not self.stack or self.stack.pop() != self.PAIRS[c]:
                    return self._end(text, i, broken=True)
                if not self.stack:
                    return self._end(text, i + 1, broken=False)
            elif c == '"':
                self.string = True
            elif c not in SCALAR or not self.stack:
                return self._end(text, i, broken=True)
        self.text += text
        return len(text)

    def _end(self, text: str, n: int, broken: bool) -> int:
        self.text += text[:n]
        self.done, self.broken = not broken, broken
        return n

    def value(self) -> dict | None:
        try:
            value = json.loads(self.text) if self.done else None
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


def _header(text: str, names, first: bool):
    """Where the next call's arguments begin in `text` and its name: (offset, name); "wait" while
    `text` may still become one; None when it is no call written the canonical way
    ({"name": "<a tool>", "arguments" | "parameters": {...}} after the family's markers)."""
    i = 0
    if not first:  # the previous call's object closes first
        i = len(text) - len(text.lstrip())
        if i == len(text):
            return "wait"
        if text[i] != "}":
            return None
        i += 1
    while True:
        rest = text[i:].lstrip()
        i = len(text) - len(rest)
        if not rest or any(m.startswith(rest) and m != rest for m in SKIPPABLE):
            return "wait"
        mark = next((m for m in SKIPPABLE if rest.startswith(m)), None)
        if mark is None:
            break
        i += len(mark)
    heads = [(f'{{"name": "{n}", "{key}": {{', n) for n in names for key in ("arguments", "parameters")]
    for head, name in heads:
        if rest.startswith(head):
            return i + len(head) - 1, name
    return "wait" if any(head.startswith(rest) for head, _ in heads) else None


class ToolScanner:
    """Streamed text with tool calls taken out: `feed(text)` returns the content safe to show and
    queues the calls' OpenAI deltas (`take()`); `finish()` returns (content not shown yet, the calls,
    text for a non-streamed response only). With `forced` nothing is content; `limit` caps the calls."""

    def __init__(self, names, forced: bool = False, limit: int | None = None):
        self.names, self.forced, self.limit = set(names), forced, limit
        self.shown = False  # some content went out: only a marker can start a call now
        self.held = ""  # text not shown and not consumed by a streamed call
        self.calling = forced  # a call has (probably) begun: no more content
        self.hidden = ""  # every character since the call began (the content if no call comes of it)
        self.args: _Arguments | None = None  # the arguments being streamed
        self.streamed: list[tuple[ToolCall, _Arguments]] = []  # calls streamed so far (ids, names, arguments)
        self.rest = False  # past the canonical calls: the remaining text is parsed at the end
        self.deltas: list[dict] = []  # OpenAI tool_calls delta entries not taken yet

    def take(self) -> list[dict]:
        out, self.deltas = self.deltas, []
        return out

    def feed(self, text: str) -> str:
        if self.calling:
            self.held += text
            self.hidden += text
            self._advance()
            return ""
        out = self._content(self.held + text)
        if self.calling:
            self.hidden = self.held
            self._advance()
        return out

    def _content(self, buf: str) -> str:
        """Before any call: the text safe to show; from where a call may begin, held."""
        if not self.shown:
            head = buf.lstrip()
            if not head or any(o.startswith(head) for o in START_OPENERS + MID_OPENERS):
                self.held = buf  # too short to tell, or exactly the start of a call
                return ""
            if head.startswith(START_OPENERS + MID_OPENERS):
                self.calling, self.held = True, buf
                return ""
        at = min((i for i in (buf.find(m) for m in MID_OPENERS) if i >= 0), default=-1)
        if at >= 0:
            self.calling, self.held = True, buf[at:]
            self.shown = self.shown or at > 0
            return buf[:at]
        hold = max((n for m in MID_OPENERS for n in range(1, len(m)) if buf.endswith(m[:n])), default=0)
        self.held = buf[len(buf) - hold :] if hold else ""
        out = buf[: len(buf) - hold]
        self.shown = self.shown or bool(out)
        return out

    def _advance(self) -> None:
        while not self.rest:
            if self.args is not None:
                n = self.args.eat(self.held)
                frag, self.held = self.held[:n], self.held[n:]
                if frag:
                    self.deltas.append({"index": len(self.streamed) - 1, "function": {"arguments": frag}})
                if not (self.args.done or self.args.broken):
                    return
                self.rest, self.args = self.args.broken, None
                continue
            full = self.limit is not None and len(self.streamed) >= self.limit
            found = None if full else _header(self.held, self.names, first=not self.streamed)
            if found == "wait":
                return
            if found is None:
                self.rest = True
                return
            at, name = found
            call = new_call(name, "")
            self.held, self.args = self.held[at:], _Arguments()
            self.streamed.append((call, self.args))
            self.deltas.append({"index": len(self.streamed) - 1, **new_head(call)})

    def finish(self) -> tuple[str, list[ToolCall], str]:
        held, self.held = self.held, ""
        if not self.calling:
            return held, [], ""
        calls = [ToolCall(c.id, c.name, a.text) for c, a in self.streamed if a.value() is not None]
        content, extra = parse_calls(re.sub(r"^\s*}", "", held) if self.streamed else held, self.names)
        room = None if self.limit is None else max(0, self.limit - len(calls))
        extra = extra[:room]
        for call in extra:  # calls not written the canonical way: whole, now
            index = len(self.streamed)
            self.streamed.append((call, None))
            self.deltas += [
                {"index": index, **new_head(call)},
                {"index": index, "function": {"arguments": call.arguments}},
            ]
        calls += extra
        if calls:
            return "" if self.streamed else content, calls, ""
        if self.streamed:  # the calls streamed never closed: a response not streamed gets the text
            return "", [], self.hidden
        return held, [], ""


def new_head(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}


def function_schema(tool: dict, args_key: str) -> dict:
    """The JSON Schema of one call to `tool`: its name as a constant, its parameters under `args_key`."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def forced_call(tools: list[dict], name: str | None, fmt: str, several: bool = False):
    """(schema, prefix, suffix, repeat) of a grammar.GrammarSpec for one call (`several`: one or more)
    to the tool `name` (None: any of `tools`), in the family's format (`fmt`)."""
    key = "parameters" if fmt == "llama3" else "arguments"
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    schemas = [function_schema(t, key) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if fmt == "mistral":  # [TOOL_CALLS][{...}, {...}]: the list holds the calls
        items = {"type": "array", "items": schema, "minItems": 1, **({} if several else {"maxItems": 1})}
        return items, MISTRAL_OPEN, "", None
    if fmt == "hermes":
        return schema, HERMES_OPEN + "\n", "\n" + HERMES_CLOSE, "\n" if several else None
    return schema, "", "", ("; " if fmt == "llama3" else "\n") if several else None
