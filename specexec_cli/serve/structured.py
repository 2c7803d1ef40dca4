"""Tools, tool calls, `response_format` and logprobs of a request: checked, then planned.

Contract: at request time (no model) `to_work(req)` builds the worker's `Work`; `apply` checks the
tools, `tool_choice`, `parallel_tool_calls`, `response_format` and logprobs fields and copies them;
`template_messages` gives the messages as chat templates take them. Each refusal is a 400 whose
`param` names the field. On the worker, `plan(work, tok, templated)` decides what the template
renders and what the reply is constrained to: tools go to a template that renders them, else
auto/none answer in text and a forced call is a 400; a forced call or a `response_format` becomes a
`GrammarSpec`, compiled here so that a bad schema is a 400 before decoding. Under a grammar no stop
string applies (`Plan.stops`): one inside the JSON would cut it into an object that does not parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specexec_cli.serve.models import APIError, ChatRequest, NamedToolChoice, Sampling, Work
from specexec_cli.session import tools as toolcalls


def apply(req, work: Work) -> None:
    """Copy the request's tools, response format and logprobs into `work` (400 when invalid)."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        work.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        _tools(req, work)
    else:
        work.logprobs = req.logprobs
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return
    if fmt.type == "json_object":
        work.response_format = {"type": "json_object"}
        return
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        param = "response_format.json_schema.schema"
        message = f"{param} is missing: type json_schema needs the JSON Schema the reply must follow"
        raise APIError(400, message, param=param)
    work.response_format = {"type": "json_schema", "schema": fmt.json_schema.schema_}


def _tools(req: ChatRequest, work: Work) -> None:
    names: list[str] = []
    for i, tool in enumerate(req.tools or []):
        fn = tool.function
        if fn.name in names:
            param = f"tools.{i}.function.name"
            raise APIError(400, f"{param}: {fn.name!r} is declared twice", param=param)
        params = fn.parameters
        if params is not None and params.get("type", "object") != "object":
            param, kind = f"tools.{i}.function.parameters", params.get("type")
            raise APIError(400, f'{param} must be the JSON Schema of an object (its "type" is {kind!r})', param=param)
        names.append(fn.name)
    work.tools = [tool.model_dump(exclude_none=True) for tool in req.tools or []]
    work.parallel_tool_calls = req.parallel_tool_calls is not False
    choice = req.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            have = ", ".join(names) if names else "none"
            message = f"tool_choice names the function {name!r}, which is not in tools (tools has: {have})"
            raise APIError(400, message, param="tool_choice")
        work.tool_choice, work.tool_name = "function", name
    elif choice == "required" and not names:
        message = 'tool_choice "required" needs tools: send the functions the reply may call'
        raise APIError(400, message, param="tool_choice")
    else:
        work.tool_choice = choice


def template_messages(messages) -> list[dict]:
    """The messages as chat templates take them (developer -> system; see the module docstring)."""
    calls: dict[str, str] = {}  # call id -> function name, from the assistant messages so far
    out = []
    for i, m in enumerate(messages):
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = []
            for j, call in enumerate(m.tool_calls):
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    args = toolcalls.parse_arguments(call.function.arguments)
                except ValueError as exc:
                    raise APIError(400, f"{param} must be a JSON object: {exc}", param=param) from None
                calls[call.id] = call.function.name
                msg["tool_calls"].append(
                    {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}
                )
        if m.role == "tool":
            param = f"messages.{i}.tool_call_id"
            if m.tool_call_id is None:
                message = f"{param} is missing: a tool message answers one tool call by its id"
                raise APIError(400, message, param=param, code="missing_required_parameter")
            if m.tool_call_id not in calls:
                message = f"{param}: no earlier assistant message has a tool call with id {m.tool_call_id!r}"
                raise APIError(400, message, param=param)
            msg["tool_call_id"], msg["name"] = m.tool_call_id, calls[m.tool_call_id]
        out.append(msg)
    return out


@dataclass
class Plan:
    """What the worker does with a request's tools and formats."""

    tools: list[dict] | None  # what the chat template renders (None: no tools)
    names: list[str]  # the functions a reply's calls may name ([]: the reply is text)
    forced: bool  # the grammar makes the whole reply calls
    grammar: object | None  # a core.grammar.GrammarSpec, or None
    limit: int | None = None  # the most calls a reply returns (parallel_tool_calls false: 1)

    def stops(self, requested: list[str]) -> list[str]:
        """The stop strings that apply: none under a grammar (it alone says where the reply ends)."""
        return [] if self.grammar is not None else requested


def plan(work: Work, tok, templated: bool, eos_ids=None) -> Plan:
    tools = work.tools if work.messages is not None and work.tool_choice != "none" else []
    forcing = work.tool_choice in ("required", "function")
    if tools and not (templated and toolcalls.renders_tools(tok)):
        if forcing:
            why = "has no chat template" if not templated else "has a chat template that does not render tools"
            message = (
                f"tool_choice {work.tool_name or work.tool_choice!r} cannot be honoured: this model "
                f'{why}; send tool_choice "auto" or "none" (the reply is then text)'
            )
            raise APIError(400, message, param="tool_choice", code="tools_unsupported")
        tools = []
    names = [t["function"]["name"] for t in tools]
    if tools and forcing:
        several = work.tool_choice == "required" and work.parallel_tool_calls  # a named function: one call
        schema, prefix, suffix, repeat = toolcalls.forced_call(
            tools, work.tool_name, toolcalls.call_format(tok), several
        )
        param = "tools" if work.tool_name is None else f"tools.{names.index(work.tool_name)}.function.parameters"
        grammar = _compile(tok, eos_ids, "json_schema", schema, prefix, suffix, param, repeat)
    elif work.response_format is not None:
        kind, schema = work.response_format["type"], work.response_format.get("schema")
        param = "response_format.json_schema.schema" if schema else "response_format"
        grammar = _compile(tok, eos_ids, kind, schema, "", "", param)
    else:
        grammar = None
    return Plan(tools or None, names, bool(tools) and forcing, grammar, None if work.parallel_tool_calls else 1)


def _compile(
    tok, eos_ids, kind: str, schema: dict | None, prefix: str, suffix: str, param: str, repeat: str | None = None
):
    """A GrammarSpec checked by compiling it once (compile_grammar caches it for the decode)."""
    from specexec_cli.core.grammar import GrammarError, GrammarSpec, compile_grammar

    spec = GrammarSpec(kind, None if schema is None else json.dumps(schema), prefix, suffix, repeat)
    try:
        compile_grammar(tok, spec, eos_ids)
    except GrammarError as exc:
        # the engine missing, or a tokenizer it cannot read, is this server's limit; anything else the schema's fault
        unsupported = any(word in str(exc) for word in ("xgrammar", "tokenizer"))
        code = "structured_output_unsupported" if unsupported else "invalid_schema"
        raise APIError(400, f"{param}: {exc}", param=param, code=code) from None
    return spec


def to_work(req: Sampling) -> Work:
    """The request's `Work` (call `unsupported(req)` first)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    top_k = 0 if req.top_k == -1 else req.top_k
    work = Work(
        temperature=req.temperature,
        top_k=top_k,
        top_p=req.top_p,
        seed=req.seed,
        stops=stops,
        repetition_guard=req.specx.repetition_guard if req.specx is not None else None,
    )
    apply(req, work)
    if isinstance(req, ChatRequest):
        work.messages = template_messages(req.messages)
        work.max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if any(not isinstance(p, str) for p in prompts):
            message = "prompt: token-id prompts are not supported; send the prompt as a string"
            raise APIError(400, message, param="prompt", code="unsupported_content")
        if len(prompts) != 1:
            message = f"prompt must be one string (got a list of {len(prompts)}): one completion per request"
            raise APIError(400, message, param="prompt")
        work.prompt, work.max_tokens = prompts[0], req.max_tokens  # -1: no limit (limits.reply_limit)
    return work
