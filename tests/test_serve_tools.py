"""`specx serve` tools, structured output and logprobs through real clients (the `openai` SDK,
langchain-openai, raw HTTP) against real uvicorn processes (tiny models, CPU).

Two servers: one whose chat template renders tools the Hermes/Qwen way (tests/tool_models.py),
one whose template knows nothing of tools. The models are random, so a call is only ever made when
the request forces it (`tool_choice` required or a named function): the grammar then makes the
whole reply one call whose arguments validate against the tool's schema. Parsing calls out of free
text is tested without a model (test_serve_toolcalls.py).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI

from tests.serve_util import Server, sse_events
from tests.tool_models import CLOCK, PLAIN_TEMPLATE, TOOLS_TEMPLATE, WEATHER, make_tool_pair, webui_request

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 16  # the servers' --max-new-tokens: the reply length of requests without max_tokens
CALL_TOKENS = 120  # room for one forced call
ASK = [{"role": "user", "content": "weather in paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def start(pair, tmp: Path, name: str) -> Server:
    target, draft = pair
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
            str(MAX_NEW),
            "--model-name",
            name,
            "--max-queue",
            "4",
        ],
        tmp,
    )


@pytest.fixture(scope="module")
def tools_pair(tmp_path_factory):
    return make_tool_pair(tmp_path_factory.mktemp("tools-models"), TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def server(tools_pair, tmp_path_factory):
    srv = start(tools_pair, tmp_path_factory.mktemp("serve-tools"), "tools")
    yield srv
    assert srv.stop() == 0, srv.stderr()
    assert "Traceback" not in srv.stderr() and "Warning" not in srv.stderr(), srv.stderr()


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    pair = make_tool_pair(tmp_path_factory.mktemp("plain-models"), PLAIN_TEMPLATE)
    srv = start(pair, tmp_path_factory.mktemp("serve-plain"), "plain")
    yield srv
    assert srv.stop() == 0, srv.stderr()
    assert "Traceback" not in srv.stderr(), srv.stderr()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tools", messages=kw.pop("messages", ASK), **kw)


def valid_call(call, tools=(WEATHER,)) -> dict:
    """The call's arguments as an object, checked against its tool's parameters schema."""
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


@pytest.fixture(scope="module")
def forced(client):
    """A call to get_weather forced by name (not streamed), at temperature 0."""
    return chat(client, tools=[WEATHER, CLOCK], tool_choice=NAMED, max_tokens=CALL_TOKENS)


def test_a_named_function_is_called_with_arguments_that_validate(forced):
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert call.function.name == "get_weather"
    valid_call(call)
    assert forced.model_extra["specx"]["tokens_per_pass"] > 1  # the constrained tree still yields many per pass


def test_required_calls_one_of_the_tools(client):
    res = chat(client, tools=[CLOCK, WEATHER], tool_choice="required", max_tokens=CALL_TOKENS)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name in ("get_time", "get_weather")
    valid_call(choice.message.tool_calls[0], (CLOCK, WEATHER))


def test_a_streamed_call_assembles_to_the_non_streamed_one(client, forced):
    chunks = list(
        chat(
            client,
            tools=[WEATHER, CLOCK],
            tool_choice=NAMED,
            max_tokens=CALL_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all("specx" in c.model_extra for c in chunks)  # the usage chunk too (docs/serve.md)
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    ref = forced.choices[0].message.tool_calls[0]
    assert list(calls) == [0] and calls[0]["name"] == ref.function.name
    assert calls[0]["arguments"] == ref.function.arguments and calls[0]["id"].startswith("call_")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == forced.usage.completion_tokens


def test_a_follow_up_with_the_tool_result_answers(client, forced):
    call = forced.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    res = chat(client, messages=messages, tools=[WEATHER, CLOCK], max_tokens=8)
    assert res.choices[0].finish_reason in ("stop", "length")
    assert isinstance(res.choices[0].message.content, str) and res.choices[0].message.tool_calls is None
    # the call and its result were rendered into the prompt
    assert res.usage.prompt_tokens > forced.usage.prompt_tokens + len(call.function.arguments)


FORECAST = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}}
    res = chat(client, response_format=fmt, max_tokens=80)
    assert res.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(res.choices[0].message.content), FORECAST)
    res = chat(client, response_format={"type": "json_object"}, max_tokens=80)
    assert res.choices[0].finish_reason == "stop" and isinstance(json.loads(res.choices[0].message.content), dict)
    text = (
        client.completions.create(
            model="tools", prompt="{", max_tokens=80, temperature=0, extra_body={"response_format": fmt}
        )
        .choices[0]
        .text
    )
    jsonschema.validate(json.loads(text), FORECAST)


def test_an_invalid_schema_is_a_400_naming_the_field(server):
    bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    for body, param in [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}},
            "response_format.json_schema.schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}], "tool_choice": "required"},
            "tools",
        ),
        (
            {
                "tools": [CLOCK, {"type": "function", "function": {"name": "f", "parameters": bad}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools.1.function.parameters",
        ),
    ]:
        status, headers, res = server.http("POST", "/v1/chat/completions", {"messages": ASK, **body})
        assert status == 400 and res["error"]["param"] == param and res["error"]["code"] == "invalid_schema", res
        assert (
            f"specx serve: 400 invalid_request_error/invalid_schema POST /v1/chat/completions request "
            f"{headers['x-request-id']}: {param}: invalid JSON schema" in server.stderr()
        )


def test_logprobs_shapes_streamed_and_not(client):
    res = chat(client, logprobs=True, top_logprobs=3, max_tokens=6)
    entries = res.choices[0].logprobs.content
    assert (
        len(entries) == res.usage.completion_tokens
        and "".join(e.token for e in entries) == res.choices[0].message.content
    )
    for e in entries:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-6  # at T = 0 the drawn token is the most likely
    chunks = list(chat(client, logprobs=True, top_logprobs=3, max_tokens=6, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    assert chat(client, max_tokens=2).choices[0].logprobs is None


def test_completions_logprobs_equal_the_target_log_softmax(tools_pair, client):
    """OpenAI's completions shape, and the values: the target's own log-softmax (transformers)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    prompt = "the weather in paris is"
    res = client.completions.create(model="tools", prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    lp = res.choices[0].logprobs
    assert "".join(lp.tokens) == res.choices[0].text and len(lp.tokens) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    tok = AutoTokenizer.from_pretrained(tools_pair[0])
    model = LlamaForCausalLM.from_pretrained(tools_pair[0], dtype=torch.float32)
    ids = tok(prompt + res.choices[0].text, add_special_tokens=False)["input_ids"]
    n = len(tok(prompt, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i, (got, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        row = ref[n - 1 + i]
        assert got == pytest.approx(float(row[ids[n + i]]), abs=1e-4)
        values, idx = torch.topk(row, 2)
        want = {tok.decode([int(t)]): float(v) for v, t in zip(values, idx)}
        assert top.keys() == want.keys() and all(top[k] == pytest.approx(want[k], abs=1e-4) for k in want)


def test_langchain_bind_tools_and_with_structured_output(server):
    pytest.importorskip("langchain_openai")
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: Literal["paris", "rome"]
        rain: bool

    llm = ChatOpenAI(
        base_url=f"{server.base}/v1",
        api_key="unused",
        model="tools",
        temperature=0,
        max_tokens=CALL_TOKENS,
        max_retries=0,
    )
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("weather in paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    out = llm.with_structured_output(Forecast, method="json_schema", strict=True).invoke("forecast for rome?")
    assert isinstance(out, Forecast)


@pytest.mark.parametrize(
    "page,needle,printed",
    [("serve.md", "from openai import", "tokens_per_pass"), ("serve-clients.md", "from langchain_openai", "city=")],
)
def test_the_pages_client_examples_run(server, capsys, page, needle, printed):
    """The python examples of docs/serve.md (openai, streamed with usage) and docs/serve-clients.md
    (langchain) as written, against this server."""
    if needle.startswith("from langchain"):
        pytest.importorskip("langchain_openai")
    text = (ROOT / "docs" / page).read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if needle in b)
    assert "http://127.0.0.1:8000/v1" in code
    code = code.replace("http://127.0.0.1:8000/v1", f"{server.base}/v1")
    code = code.replace("temperature=0)", f"temperature=0, max_tokens={CALL_TOKENS})")  # this server's default is short
    code = compile(code, page, "exec", dont_inherit=True)
    exec(code, {"__name__": "__main__"})  # noqa: S102 - the page's own example, as a script runs it
    assert printed in capsys.readouterr().out


def test_a_client_leaving_mid_stream_is_one_log_line(server):
    body = {"messages": ASK, "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=60) as res:
        rid = res.headers["x-request-id"]
        next(res.iter_lines())
    deadline = time.monotonic() + 30
    while "finish=cancelled" not in server.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [ln for ln in server.stderr().splitlines() if rid in ln]  # the reason, then the access line
    assert (
        lines[0]
        == f"specx serve: 499 cancelled POST /v1/chat/completions request {rid}: the client disconnected mid-stream"
        and len(lines) == 2
    ), lines
    assert lines[1].startswith(f"specx serve: 499 POST /v1/chat/completions request {rid}: prompt=")
    assert lines[1].endswith(" finish=cancelled")


def test_open_webui_first_request_on_a_template_without_tools(plain_server):
    """36 builtin tools, no tool_choice, streamed: a 200 and a finished stream of plain text."""
    with httpx.stream("POST", f"{plain_server.base}/v1/chat/completions", json=webui_request(), timeout=120) as res:
        assert res.status_code == 200
        events = sse_events(res.iter_lines())
    assert events[-1] == "[DONE]"
    finals = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert finals in (["stop"], ["length"])
    assert not any(e["choices"][0]["delta"].get("tool_calls") for e in events[:-1])
    forced = {**webui_request(), "stream": False, "tool_choice": "required"}
    status, _, res = plain_server.http("POST", "/v1/chat/completions", forced)
    assert status == 400 and res["error"]["param"] == "tool_choice" and res["error"]["code"] == "tools_unsupported"
    assert "does not render tools" in res["error"]["message"]
