"""Tool calls without a model: each family's call format parsed out of a reply, the streamed
scanner against the whole-reply parser, templates with and without tools, the messages templates
get (OpenAI's string arguments as objects), and the reply filter (stop strings, then tool calls).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from specexec_cli.serve.models import ChatRequest
from specexec_cli.serve.reply import Reply
from specexec_cli.serve.structured import template_messages
from specexec_cli.session.chat import render_template
from specexec_cli.session.tools import ToolScanner, call_format, forced_call, parse_calls, renders_tools
from tests.tool_models import CLOCK, PLAIN_TEMPLATE, TOOLS_TEMPLATE, WEATHER, make_tokenizer

NAMES = {"get_weather", "get_time"}
ARGS = {"city": "paris", "days": 2}

REPLIES = [  # (id, reply text, content before the calls, [(name, arguments)])
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}\n'
               "</tool_call>", "Let me look.", [("get_weather", ARGS)]),
    ("hermes-two", '<tool_call>{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}</tool_call>\n'
                   '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "",
     [("get_weather", ARGS), ("get_time", {})]),
    ("hermes-unclosed", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}', "",
     [("get_time", {"zone": "utc"})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "paris", "days": 2}}', "", [("get_weather", ARGS)]),
    ("llama3-python-tag", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_time", '
                          '"parameters": {"zone": "cet"}}', "", [("get_time", {}), ("get_time", {"zone": "cet"})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}]', "",
     [("get_weather", ARGS)]),
    ("mistral-decoded-away", '[{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}]', "",
     [("get_weather", ARGS)]),
    ("mistral-v11", '[TOOL_CALLS]get_weather[ARGS]{"city": "paris", "days": 2}', "", [("get_weather", ARGS)]),
    ("generic-fenced", '```json\n{"name": "get_weather", "arguments": "{\\"city\\": \\"paris\\", \\"days\\": 2}"}\n```',
     "", [("get_weather", ARGS)]),
    ("unknown-tool", '{"name": "rm_rf", "arguments": {}}', '{"name": "rm_rf", "arguments": {}}', []),
    ("not-a-call", '{"city": "paris"}', '{"city": "paris"}', []),
    ("broken-json", '<tool_call>{"name": "get_time", "arguments": {</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {</tool_call>', []),
    ("text", "It is sunny [1] in {paris}.", "It is sunny [1] in {paris}.", []),
]  # fmt: skip


@pytest.mark.parametrize("text,content,calls", [r[1:] for r in REPLIES], ids=[r[0] for r in REPLIES])
def test_each_family_format_parses(text, content, calls):
    got_content, got = parse_calls(text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got)


@pytest.mark.parametrize("text,content,calls", [r[1:] for r in REPLIES], ids=[r[0] for r in REPLIES])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_the_streamed_scanner_finds_what_the_parser_finds(text, content, calls, size):
    scanner = ToolScanner(NAMES)
    shown, deltas = "", []
    for i in range(0, len(text), size):
        shown += scanner.feed(text[i:i + size])
        deltas += scanner.take()
    tail, got, unsent = scanner.finish()
    deltas += scanner.take()
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    if calls:  # the text before the first marker went out as it came; the calls as deltas
        assert (shown + tail).rstrip() == content and unsent == ""
        assert assemble(deltas) == [(c.id, c.name, c.arguments) for c in got]
    else:  # no call: every character reaches the client (a response not streamed gets `unsent` too)
        assert shown + tail + unsent == text


def assemble(deltas: list[dict]) -> list[tuple]:
    """(id, name, arguments) per call from OpenAI's delta.tool_calls entries, as clients join them."""
    calls: dict[int, list] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], [None, "", ""])
        call[0] = d.get("id", call[0])
        call[1] += d.get("function", {}).get("name", "")
        call[2] += d.get("function", {}).get("arguments", "")
    return [tuple(v) for _, v in sorted(calls.items())]


FORCED_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>')


def test_arguments_stream_piece_by_piece_as_they_are_written():
    """OpenAI's shape: the first delta of a call has its index, id, type, name and arguments "";
    the next ones carry pieces of the arguments, sent as soon as they are written."""
    scanner = ToolScanner(NAMES, forced=True)
    seen = []
    for i in range(len(FORCED_TWO)):
        assert scanner.feed(FORCED_TWO[i]) == ""
        seen.append((i, scanner.take()))
    head_at, (head, first) = next((i, d) for i, d in seen if d)
    assert FORCED_TWO[:head_at + 1].endswith('"arguments": {')  # the arguments have begun: the call starts
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert first == {"index": 0, "function": {"arguments": "{"}}
    assert seen[head_at + 1][1] == [{"index": 0, "function": {"arguments": '"'}}]  # the very next character
    pieces = [e for _, d in seen for e in d if "id" not in e and e["index"] == 0]
    assert len(pieces) == len('{"city": "paris", "days": 2}')  # one piece per character fed
    tail, calls, unsent = scanner.finish()
    assert tail == "" and unsent == "" and [c.arguments for c in calls] == ['{"city": "paris", "days": 2}',
                                                                            '{"zone": "utc"}']  # fmt: skip
    assert assemble([e for _, d in seen for e in d]) == [(c.id, c.name, c.arguments) for c in calls]


def test_parallel_tool_calls_false_keeps_the_first_call():
    scanner = ToolScanner(NAMES, forced=True, limit=1)
    scanner.feed(FORCED_TWO)
    _tail, calls, _ = scanner.finish()
    assert [c.name for c in calls] == ["get_weather"]
    assert {d["index"] for d in scanner.take()} <= {0}


def test_a_call_cut_short_is_no_call():
    """max_tokens inside the arguments: the deltas so far went out, the call does not count, and a
    response that is not streamed gets the text as its content."""
    cut = FORCED_TWO[:60]  # into {"city": "pa
    scanner = ToolScanner(NAMES, forced=True)
    scanner.feed(cut)
    assert assemble(scanner.take())[0][1:] == ("get_weather", cut.split('"arguments": ')[1])
    assert scanner.finish() == ("", [], cut)


def test_text_streams_until_a_marker_could_begin():
    scanner = ToolScanner(NAMES)
    assert scanner.feed("Sure, ") == "Sure, "
    assert scanner.feed("here <tool") == "here "  # "<tool" may be the start of <tool_call>
    assert scanner.feed("kit> is fine") == "<toolkit> is fine"
    forced = ToolScanner(NAMES, forced=True)
    assert forced.feed("plain words") == "" and forced.finish() == ("plain words", [], "")


def test_templates_with_and_without_tools():
    tools, plain = make_tokenizer(TOOLS_TEMPLATE), make_tokenizer(PLAIN_TEMPLATE)
    assert renders_tools(tools) and not renders_tools(plain)
    assert call_format(tools) == "hermes" and call_format(plain) == "generic"
    no_template = make_tokenizer(PLAIN_TEMPLATE)
    no_template.chat_template = None
    assert not renders_tools(no_template)


def test_string_arguments_reach_the_template_as_objects():
    req = ChatRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})  # fmt: skip
    messages = template_messages(req.messages)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == ARGS
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}
    text = render_template(make_tokenizer(TOOLS_TEMPLATE), messages, [WEATHER])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}</tool_call>' in text
    assert '"name": "get_weather"' in text.split("<|user|>")[0]  # the tool list, before the conversation
    assert text.endswith("<|tool|>\nsunny<|assistant|>\n")


@pytest.mark.parametrize("fmt,prefix,key", [("hermes", "<tool_call>\n", "arguments"), ("llama3", "", "parameters"),
                                            ("generic", "", "arguments"),
                                            ("mistral", "[TOOL_CALLS]", "arguments")])  # fmt: skip
def test_a_forced_call_is_the_family_format(fmt, prefix, key):
    schema, got_prefix, suffix, repeat = forced_call([WEATHER], "get_weather", fmt)
    assert got_prefix == prefix and (suffix == "\n</tool_call>") == (fmt == "hermes") and repeat is None
    if fmt == "mistral":   # Mistral's own format: a list of calls after [TOOL_CALLS]
        assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
        schema = schema["items"]
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"][key] == WEATHER["function"]["parameters"] and schema["required"] == ["name", key]


def accepts(tok, spec, text: str) -> bool:
    """Whether the compiled grammar takes `text` and then EOS."""
    from specexec_cli.core.grammar import compile_grammar

    matcher = compile_grammar(tok, spec).matcher()
    return all(matcher.accept_token(t) for t in tok(text, add_special_tokens=False)["input_ids"]) and \
        matcher.accept_token(tok.eos_token_id)


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3", "generic"])
def test_required_with_parallel_calls_admits_several_calls(fmt):
    """tool_choice "required" with parallel_tool_calls: one or more calls (a named function, or
    parallel_tool_calls false: exactly one), each in the family's format, and the stream parser
    takes them all."""
    pytest.importorskip("xgrammar")
    from specexec_cli.core.grammar import GrammarSpec

    tok = make_tokenizer(TOOLS_TEMPLATE)
    key = "parameters" if fmt == "llama3" else "arguments"
    one = [f'{{"name": "get_weather", "{key}": {{"city": "rome", "days": 1}}}}',
           f'{{"name": "get_time", "{key}": {{"zone": "cet"}}}}']
    hermes = [f"<tool_call>\n{c}\n</tool_call>" for c in one]
    first, written = {"hermes": (hermes[0], "\n".join(hermes)),
                      "mistral": (f"[TOOL_CALLS][{one[0]}]", "[TOOL_CALLS][" + ", ".join(one) + "]"),
                      "llama3": (one[0], "; ".join(one)), "generic": (one[0], "\n".join(one))}[fmt]  # fmt: skip
    for several in (False, True):
        schema, prefix, suffix, repeat = forced_call([WEATHER, CLOCK], None, fmt, several)
        spec = GrammarSpec("json_schema", json.dumps(schema), prefix, suffix, repeat)
        assert accepts(tok, spec, first) and accepts(tok, spec, written) == several
    scanner = ToolScanner(NAMES, forced=True)
    scanner.feed(written)
    assert [(c.name, json.loads(c.arguments)) for c in scanner.finish()[1]] == [
        ("get_weather", {"city": "rome", "days": 1}), ("get_time", {"zone": "cet"})]


class CharTok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def event(text: str, draft: int = 0):
    return SimpleNamespace(text=text, tokens=[ord(c) for c in text], logprobs=[
        SimpleNamespace(token=ord(c), logprob=-0.5, top=[(ord(c), -0.5)]) for c in text])


def test_the_reply_filter_stops_then_parses_and_logprobs_follow_the_text():
    reply = Reply(CharTok(), ["STOP"], sorted(NAMES), False, 1)
    pieces = [reply.feed(event(t)) for t in ['ok <tool_call>{"name": "get_time", ', '"arguments": {}}', "STOPjunk"]]
    last, calls = reply.finish()
    assert [p.text for p in pieces if p and p.text] == ["ok "] and last is not None and last.text == ""
    assert assemble(pieces[1].tool_calls) == [(calls[0]["id"], "get_time", "{}")]  # streamed as it was written
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_time", "{}")]
    assert reply.used == len('ok <tool_call>{"name": "get_time", "arguments": {}}STOP')
    sent = [e["token"] for p in [*pieces, last] if p for e in p.logprobs]
    assert "".join(sent) == 'ok <tool_call>{"name": "get_time", "arguments": {}}STOP'  # none past the stop


# -- auto mode through the real worker, app and HTTP stack, over a scripted reply ------------------
class ScriptedToolSession:
    """What the worker uses of a ChatSession: a templated one (TOOLS_TEMPLATE) whose `decode`
    yields `script` as StepEvents of the byte-level tokenizer's tokens, the last one ending on EOS."""

    system, templated, code, tuner, prompt_cache = None, True, False, None, None

    def __init__(self, script):
        from specexec_cli.core.draft import TreeShape
        from specexec_cli.core.engine import DecodeState, GenerationConfig

        self.script, self.prompts = script, []
        self.tok = make_tokenizer(TOOLS_TEMPLATE)
        self.models = SimpleNamespace(tokenizer=self.tok, ctx_limit=4096, eos_ids=frozenset({0}), stop_strings=())
        self.cfg, self.state = GenerationConfig(shape=TreeShape(4, 4), max_new_tokens=256), DecodeState()

    def conversation_ids(self, messages, tools=None):
        self.prompts.append(render_template(self.tok, messages, tools))
        return self.tok(self.prompts[-1])["input_ids"]

    def prefill_ids(self, full):
        return full

    def decode(self, ids, cfg, gen):
        from specexec_cli.core.engine import StepEvent

        for i, text in enumerate(self.script, 1):
            yield StepEvent(text=text, tokens=self.tok(text)["input_ids"], accepted=0, pass_index=i, tree_size=1,
                            tree_depth=1, draft_seconds=0.0, target_seconds=0.001, prefill_seconds=0.0,
                            decode_seconds=0.001 * i, new_tokens=0, prompt_tokens=0,
                            finish="eos" if i == len(self.script) else None)  # fmt: skip


CALL_SCRIPT = ["Let me check. ", '<tool_call>\n{"name": "get_weather", ',
               '"arguments": {"city": "rome", "days": 1}}\n</tool_call>\n<tool_call>\n{"name": "get_time", ',
               '"arguments": {"zone": "utc"}}\n</tool_call>']  # fmt: skip
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@contextmanager
def scripted_server(session):
    """The real worker, app and uvicorn (a thread of this process) over `session`; yields an OpenAI client.
    Entered in the test's body, not a fixture: the server logs a request after answering it, and leaving joins
    its thread, so that line lands in the test's captured output rather than on pytest's terminal."""
    from specexec_cli.serve.app import create_app
    from specexec_cli.serve.metrics import Metrics
    from specexec_cli.serve.worker import Worker
    from specexec_cli.session.gendefaults import GREEDY
    from tests.serve_util import app_server

    worker = Worker(lambda: (session, GREEDY), max_queue=4, metrics=Metrics())
    worker.start()
    while worker.state == "loading":
        time.sleep(0.01)
    try:
        with app_server(create_app(worker, "m")) as port:
            from openai import OpenAI

            yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
    finally:
        worker.shutdown()


def test_auto_mode_returns_the_calls_the_model_wrote():
    session = ScriptedToolSession(CALL_SCRIPT)
    with scripted_server(session) as sdk:
        ask = [{"role": "user", "content": "weather and time?"}]
        res = sdk.chat.completions.create(model="m", messages=ask, tools=[WEATHER, TIME_TOOL])
        choice = res.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check. "
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "rome", "days": 1}), ("get_time", {"zone": "utc"})]
        assert '"name": "get_time"' in session.prompts[-1]  # the tools reached the template
        chunks = list(sdk.chat.completions.create(model="m", messages=ask, tools=[WEATHER, TIME_TOOL], stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls: dict[int, list[str]] = {}
        for c in chunks:
            for d in c.choices[0].delta.tool_calls or []:
                calls.setdefault(d.index, ["", ""])
                calls[d.index][0] += d.function.name or ""
                calls[d.index][1] += d.function.arguments or ""
        assert content == "Let me check. "
        assert [tuple(v) for v in calls.values()] == [(c.function.name, c.function.arguments)
                                                      for c in choice.message.tool_calls]  # fmt: skip
        one = sdk.chat.completions.create(model="m", messages=ask, tools=[WEATHER, TIME_TOOL],
                                          parallel_tool_calls=False)
        assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
        text = sdk.chat.completions.create(model="m", messages=ask, tools=[WEATHER, TIME_TOOL], tool_choice="none")
        assert text.choices[0].finish_reason == "stop" and text.choices[0].message.tool_calls is None
        assert text.choices[0].message.content == "".join(CALL_SCRIPT)
        assert '"name": "get_time"' not in session.prompts[-1]  # tool_choice none: no tools rendered
