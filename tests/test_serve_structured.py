"""`specx serve` structured output as clients see it, through the real `openai` SDK and langchain
against real uvicorn processes (tiny random models, CPU): stop strings under a grammar, several
forced calls, tool-call arguments streamed as they are written, a reply cut by max_tokens, and
Mistral's own call format. The tool servers' chat templates render tools the Hermes/Qwen way
(tests/tool_models.py) or the Mistral way (MISTRAL_TEMPLATE); a call is only made where the
request forces it (the models are random).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI

from tests.serve_util import Server
from tests.tool_models import CLOCK, TOOLS_TEMPLATE, WEATHER, make_tool_pair

pytest.importorskip("xgrammar")

ASK = [{"role": "user", "content": "weather in paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL_TOKENS = 120  # room for one forced call
FORECAST = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ m.content or '' }}"
    "{%- if m.tool_calls %}[TOOL_CALLS][{%- for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}{%- endfor %}]{% endif %}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- else %}[INST]{{ m.content }}[/INST]{%- endif %}"
    "{%- endfor %}"
)


def start(template: str, tmp: Path, name: str) -> Server:
    target, draft = make_tool_pair(tmp, template)
    return Server.start(
        [
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--budget",
            "8",
            "--max-new-tokens",
            "16",
            "--model-name",
            name,
        ],
        tmp,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start(TOOLS_TEMPLATE, tmp_path_factory.mktemp("structured"), "tools")
    yield srv
    assert srv.stop() == 0, srv.stderr()
    assert "Traceback" not in srv.stderr(), srv.stderr()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=kw.pop("model", "tools"), messages=kw.pop("messages", ASK), **kw)


def valid_call(name: str, arguments: str, tools=(WEATHER, CLOCK)) -> dict:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    args = json.loads(arguments)
    jsonschema.validate(args, schema)
    return args


def test_stop_strings_do_not_cut_constrained_output(client):
    """Under a grammar the request's stop strings do not apply: '"' occurs in every object with a
    key, "}" ends every one, and "\\n" is part of the Hermes call markup."""
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}}
    res = chat(client, response_format=fmt, max_tokens=80, stop=['"', "}"])
    assert res.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(res.choices[0].message.content), FORECAST)
    text = (
        client.completions.create(
            model="tools", prompt="{", max_tokens=80, temperature=0, stop=['"'], extra_body={"response_format": fmt}
        )
        .choices[0]
        .text
    )
    jsonschema.validate(json.loads(text), FORECAST)
    res = chat(client, tools=[WEATHER, CLOCK], tool_choice=NAMED, max_tokens=CALL_TOKENS, stop="\n")
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    valid_call(call.function.name, call.function.arguments)


def test_a_forced_call_streams_its_arguments_as_they_are_written(client):
    """OpenAI's delta shape: first the call's index, id, type, name and arguments ""; then pieces of
    the arguments, sent while the model writes them (the running token count grows between them);
    the pieces join to the call a response that is not streamed returns."""
    ref = chat(client, tools=[WEATHER, CLOCK], tool_choice=NAMED, max_tokens=CALL_TOKENS).choices[0].message
    chunks = list(
        chat(client, tools=[WEATHER, CLOCK], tool_choice=NAMED, max_tokens=CALL_TOKENS, stream=True, stop=["\n"])
    )
    deltas = [(c, d) for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    (_first, head), rest = deltas[0], deltas[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert len(rest) >= 3 and all(d.index == 0 and d.id is None and d.function.name is None for _, d in rest)
    written = [c.model_extra["specx"]["completion_tokens"] for c, _ in deltas]
    assert written == sorted(written) and written[0] < written[-1]  # sent during the reply, not at its end
    arguments = "".join(d.function.arguments for _, d in rest)
    (call,) = ref.tool_calls
    assert (head.function.name, arguments) == (call.function.name, call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_required_with_parallel_tool_calls_returns_several(client):
    """tool_choice "required": one or more calls (this seed's reply makes several); with
    parallel_tool_calls false, exactly one."""
    several = None
    for seed in range(3):
        res = chat(client, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=300, temperature=1.0, seed=seed)
        calls = res.choices[0].message.tool_calls or []
        assert res.choices[0].finish_reason in ("tool_calls", "length")
        if len(calls) >= 2:
            several = seed
            break
    assert several is not None, "no seed gave more than one call"
    assert res.choices[0].finish_reason == "tool_calls"
    for call in calls:
        valid_call(call.function.name, call.function.arguments)
    assert len({c.id for c in calls}) == len(calls)
    one = chat(
        client,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=300,
        temperature=1.0,
        seed=several,
        parallel_tool_calls=False,
    ).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    valid_call(one.message.tool_calls[0].function.name, one.message.tool_calls[0].function.arguments)


def test_max_tokens_cuts_a_constrained_reply(client):
    """A forced call cut by max_tokens (one token a character: inside its arguments): finish_reason
    "length" and no tool_calls, the text so far as content; streamed, the deltas stop where the text did."""
    head = '<tool_call>\n{"name": "get_weather", "arguments": {'
    res = chat(client, tools=[WEATHER, CLOCK], tool_choice=NAMED, max_tokens=len(head) + 5)
    choice = res.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith(head) and len(choice.message.content) == len(head) + 5
    chunks = list(chat(client, tools=[WEATHER, CLOCK], tool_choice=NAMED, max_tokens=len(head) + 5, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments for d in deltas) == choice.message.content[len(head) - 1 :]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_langchain_streams_a_forced_call(server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{server.base}/v1",
        api_key="unused",
        model="tools",
        temperature=0,
        max_tokens=CALL_TOKENS,
        max_retries=0,
        timeout=300,
    )
    chunks = list(llm.bind_tools([WEATHER], tool_choice="get_weather").stream("weather in paris?"))
    assert sum(1 for c in chunks if c.tool_call_chunks) >= 3  # the arguments came in pieces
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    (call,) = merged.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])


def test_a_forced_mistral_call_is_written_the_mistral_way(tmp_path_factory):
    """A template with [TOOL_CALLS]: the forced call is `[TOOL_CALLS][{...}]`, as Mistral models
    write calls (the tokens' logprobs show the text), and comes back as a tool call; the logprobs
    are the raw target's, not the masked distribution's."""
    srv = start(MISTRAL_TEMPLATE, tmp_path_factory.mktemp("mistral"), "mistral")
    try:
        sdk = OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=300)
        res = chat(
            sdk,
            model="mistral",
            tools=[WEATHER, CLOCK],
            tool_choice=NAMED,
            max_tokens=CALL_TOKENS,
            logprobs=True,
            top_logprobs=1,
        )
        choice = res.choices[0]
        # the raw target's logprobs (docs/serve.md): at T = 0 a token the grammar forced is often not its argmax
        assert any(e.top_logprobs[0].logprob > e.logprob + 1e-6 for e in choice.logprobs.content)
        written = "".join(e.token for e in choice.logprobs.content).removesuffix("<eos>")
        assert written.startswith('[TOOL_CALLS][{"name": "get_weather", "arguments": {') and written.endswith("}]")
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(written[len("[TOOL_CALLS]") :])[0][
            "arguments"
        ] == valid_call(call.function.name, call.function.arguments)
    finally:
        assert srv.stop() == 0, srv.stderr()
    assert "Traceback" not in srv.stderr(), srv.stderr()
