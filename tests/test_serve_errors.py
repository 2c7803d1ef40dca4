"""`specx serve` refusals over raw HTTP: the error table, auth, 413, 429, CORS, metrics, bad flags, SIGTERM.

One server for the module, started with --api-key, --max-queue 0, a small --ctx and --cors; every
error must be a 4xx in OpenAI's shape {"error": {message, type, param, code}}. The last test stops
the server with SIGTERM in the middle of a stream: the stream ends properly and the exit code is 0.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time

import httpx
import pytest
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.serve_util import Server, sse_events

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 64
MSG = [{"role": "user", "content": "def f(x):"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    srv = Server.start(["--target", str(target), "--draft", str(draft), "--dtype", "fp32", "--device", "cpu",
                        "--budget", "8", "--max-new-tokens", "8", "--max-queue", "0", "--parallel", "1", "--ctx", str(CTX),
                        "--cors", "http://example.test"], tmp_path_factory.mktemp("serve"),
                       env={"SPECX_API_KEY": KEY})  # fmt: skip
    yield srv
    srv.stop()
    assert "Traceback" not in srv.stderr(), srv.stderr()


def is_error_shape(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str))


CHAT, COMP = "/v1/chat/completions", "/v1/completions"
CASES = [  # (id, path, body, status, param or None, substring of the message or None)
    ("malformed-json", CHAT, '{"messages": [', 400, None, "malformed JSON"),
    ("not-an-object", CHAT, "[1, 2]", 400, None, None),
    ("empty-body", CHAT, "", 400, None, None),
    ("invalid-utf8", CHAT, b'{"messages": "\xff"}', 400, None, None),
    ("messages-wrong-type", CHAT, {"messages": "hi"}, 400, "messages", None),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages", None),
    ("unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", None),
    ("content-image", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                                       {"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content.1", "this model takes text only"),
    ("content-audio", CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     400, "messages.0.content.0", "text only"),
    ("text-part-without-text", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.0.content.0", "text"),
    ("content-missing", CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0.content", "missing"),
    ("content-null-system", CHAT, {"messages": [{"role": "system", "content": None}, *MSG]}, 400,
     "messages.0.content", "missing"),
    ("prompt-token-ids", COMP, {"prompt": [1, 2, 3]}, 400, "prompt", "token-id prompts are not supported"),
    ("prompt-token-id-lists", COMP, {"prompt": [[1, 2], [3]]}, 400, "prompt", "token-id"),
    ("max-tokens-minus-2", CHAT, {"messages": MSG, "max_tokens": -2}, 400, "max_tokens", None),
    ("max-completion-tokens-zero", CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "at least 1"),
    ("top-k-minus-2", CHAT, {"messages": MSG, "top_k": -2}, 400, "top_k", None),
    ("n-2", CHAT, {"messages": MSG, "n": 2}, 400, "n", "n must be 1"),
    ("temperature-negative", CHAT, {"messages": MSG, "temperature": -0.5}, 400, "temperature", None),
    ("temperature-string", CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature", None),
    ("temperature-nan", CHAT, '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature", None),
    ("top-p-zero", CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p", None),
    ("top-p-above-1", CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p", None),
    ("max-tokens-zero", CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", None),
    ("max-tokens-string", COMP, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("stream-string", CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream", None),
    ("seed-huge", CHAT, {"messages": MSG, "seed": 2**70}, 400, "seed", None),
    ("stop-too-many", CHAT, {"messages": MSG, "stop": [str(i) for i in range(20)]}, 400, "stop", None),
    ("top-logprobs-without-logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs"),
    ("top-logprobs-21", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("presence-penalty", CHAT, {"messages": MSG, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("frequency-penalty", COMP, {"prompt": "x", "frequency_penalty": 1}, 400, "frequency_penalty", "not supported"),
    ("logit-bias", CHAT, {"messages": MSG, "logit_bias": {"5": 10}}, 400, "logit_bias", "not supported"),
    ("tool-without-function", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools.0.function", None),
    ("tool-choice-unknown", CHAT, {"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function",
                                                                                     "function": {"name": "nope"}}},
     400, "tool_choice", "not in tools"),
    ("tool-choice-required-without-tools", CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice",
     "needs tools"),
    ("tool-message-without-call", CHAT, {"messages": [*MSG, {"role": "tool", "tool_call_id": "call_1", "content": "4"}]},
     400, "messages.1.tool_call_id", "no earlier assistant message"),
    ("tool-call-arguments-not-json", CHAT, {"messages": [*MSG, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{city: paris"}}]}, *MSG]},
     400, "messages.1.tool_calls.0.function.arguments", "not JSON"),
    ("json-schema-missing", CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema.schema", "missing"),
    ("tools-on-a-model-without-template", CHAT, {"messages": MSG, "tools": [TOOL], "tool_choice": "required"}, 400,
     "tool_choice", "no chat template"),
    ("prompt-missing", COMP, {"max_tokens": 3}, 400, "prompt", None),
    ("prompt-list-of-two", COMP, {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("prompt-empty", COMP, {"prompt": ""}, 400, "prompt", "empty"),
    ("context-length", CHAT, {"messages": [{"role": "user", "content": "a" * (2 * CTX)}]}, 400, "messages", None),
    ("context-length-completions", COMP, {"prompt": "b" * (2 * CTX)}, 400, "prompt", None),
]


@pytest.mark.parametrize("name,path,body,status,param,text", CASES, ids=[c[0] for c in CASES])
def test_error_table(server, name, path, body, status, param, text):
    got, _, res = server.http("POST", path, body, AUTH)
    assert got == status, res
    assert is_error_shape(res), res
    if param is not None:
        assert res["error"]["param"] == param, res
    if text is not None:
        assert text in res["error"]["message"], res
    if name.startswith("context-length"):
        assert res["error"]["code"] == "context_length_exceeded"


ACCEPTED = [  # (id, path, body): values other servers accept (docs/serve-clients.md, "Errors and security")
    ("top-k-minus-1", CHAT, {"messages": MSG, "top_k": -1}),  # vLLM: -1 = off
    ("stream-null", CHAT, {"messages": MSG, "stream": None}),  # vLLM: Optional[bool]
    ("max-tokens-minus-1", CHAT, {"messages": MSG, "max_tokens": -1}),  # llama-server, ollama: -1 = no limit
    ("max-tokens-null", COMP, {"prompt": "x", "max_tokens": None}),
    ("max-completion-tokens-minus-1", CHAT, {"messages": MSG, "max_completion_tokens": -1}),
    ("assistant-without-content", CHAT, {"messages": [*MSG, {"role": "assistant"}, *MSG]}),  # OpenAI: optional
    ("tools-auto-on-a-model-without-template", CHAT, {"messages": MSG, "tools": [TOOL]}),  # Open WebUI: text
    ("text-parts", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]}),
]  # fmt: skip


def generate(server, path, body):
    """POST a request that generates (the worker frees its --max-queue slot before the reply ends, so
    back-to-back requests on --max-queue 0 are never refused)."""
    status, _, res = server.http("POST", path, body, AUTH)
    return status, res


@pytest.mark.parametrize("name,path,body", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_as_other_servers_do(server, name, path, body):
    status, res = generate(server, path, {"max_tokens": 2, **body, "temperature": 0})
    assert status == 200 and res["object"] in ("chat.completion", "text_completion"), res
    assert res["usage"]["completion_tokens"] >= 1


def test_text_parts_are_joined_by_newlines(server):
    """The prompt of two text parts is the prompt of their texts joined by a newline."""
    parts = [{"type": "text", "text": "def f(x):"}, {"type": "text", "text": "return x"}]
    one = {"messages": [{"role": "user", "content": "def f(x):\nreturn x"}], "temperature": 0, "max_tokens": 4}
    two = {**one, "messages": [{"role": "user", "content": parts}]}
    joined, split = (generate(server, CHAT, body)[1] for body in (one, two))
    assert joined["usage"]["prompt_tokens"] == split["usage"]["prompt_tokens"]
    assert joined["choices"][0]["message"] == split["choices"][0]["message"]


def test_with_a_key_the_key_decides_not_the_host(server):
    foreign = {"Host": "attacker.example"}
    assert server.http("GET", "/v1/models", None, {**foreign, **AUTH})[0] == 200
    status, _, res = server.http("GET", "/v1/models", None, foreign)
    assert status == 401 and res["error"]["code"] == "invalid_api_key"


def test_health_answers_head(server):
    status, _, body = server.http("HEAD", "/health")
    assert status == 200 and body == ""


def test_unknown_route_and_method(server):
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", CHAT, 405), ("GET", "/v1/models/other", 404)):
        got, _, res = server.http(method, path, None, AUTH)
        assert got == status and is_error_shape(res), (path, res)


def test_body_over_the_limit_is_413(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", CHAT)
    for k, v in {**AUTH, "Content-Type": "application/json", "Content-Length": str(64 << 20)}.items():
        conn.putheader(k, v)
    conn.endheaders()
    res = conn.getresponse()
    assert res.status == 413 and is_error_shape(json.loads(res.read()))
    conn.close()


def test_api_key(server):
    assert server.http("GET", "/health")[0] == 200  # /health needs no key
    assert server.http("GET", "/")[0] == 200  # nor the page: it holds no data, it sends the key it is given
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/"), ("POST", CHAT), ("POST", COMP)):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, hdrs, res = server.http(method, path, {"messages": MSG}, headers)
            assert status == 401 and is_error_shape(res), (path, headers, res)
            assert hdrs.get("www-authenticate") == "Bearer"
    assert server.http("GET", "/v1/models", None, AUTH)[0] == 200
    assert server.http("GET", "/v1/models", None, {"Authorization": f"bearer {KEY}"})[0] == 200


def test_cors_only_for_the_given_origin(server):
    pre = {"Origin": "http://example.test", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    status, hdrs, _ = server.http("OPTIONS", CHAT, None, pre)
    assert status == 200 and hdrs["access-control-allow-origin"] == "http://example.test"
    status, hdrs, _ = server.http("OPTIONS", CHAT, None, {**pre, "Origin": "http://evil.test"})
    assert hdrs.get("access-control-allow-origin") != "http://evil.test"


def test_a_refusal_is_one_log_line_with_the_request_id(server):
    for body, headers, line in [
        ({"messages": MSG, "n": 3}, AUTH, "400 invalid_request_error POST /v1/chat/completions request {}: n must be 1 "
                                          "(got 3): one completion per request"),
        ({"messages": MSG}, {}, "401 invalid_request_error/invalid_api_key POST /v1/chat/completions request {}: "
                                "missing or wrong API key: send the header 'Authorization: Bearer <key>'"),
    ]:  # fmt: skip
        status, hdrs, _ = server.http("POST", CHAT, body, headers)
        rid = hdrs["x-request-id"]
        assert status in (400, 401) and len(rid) == 32
        deadline = time.monotonic() + 10   # the access line is written once the response has gone out
        while len(lines := [ln for ln in server.stderr().splitlines() if rid in ln]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines[0] == "specx serve: " + line.format(rid) and len(lines) == 2, lines
        assert lines[1].startswith(f"specx serve: {status} POST /v1/chat/completions request {rid}: seconds=")


def test_full_queue_is_429_with_retry_after(server):
    body = {"messages": MSG, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base + CHAT, json=body, headers=AUTH, timeout=60) as res:
        assert res.status_code == 200
        lines = res.iter_lines()
        next(lines)  # the role chunk: the worker is busy with this request now
        status, hdrs, err = server.http("POST", COMP, {"prompt": "x"}, AUTH)
        assert status == 429 and is_error_shape(err) and int(hdrs["retry-after"]) >= 1
        assert f"specx serve: 429 rate_limit_error/queue_full POST /v1/completions request {hdrs['x-request-id']}: " \
            in server.stderr()
    _, _, metrics = server.http("GET", "/metrics", None, AUTH)
    for name in ("specx_requests_total", "specx_queue_depth", "specx_tokens_per_pass", "specx_target_passes_total",
                 "specx_refused_requests_total", "specx_time_to_first_token_seconds", "specx_request_seconds"):
        assert f"# TYPE {name}" in metrics
    assert 'specx_refused_requests_total{status="429",type="rate_limit_error"}' in metrics
    assert 'specx_refused_requests_total{status="401",type="invalid_request_error"}' in metrics


def test_bad_flags_are_one_line(tmp_path):
    runner = CliRunner()
    for args, text in ((["--port", "70000"], "--port"), (["--max-queue", "-1"], "--max-queue"),
                       (["--cors", "example.test"], "--cors"),
                       (["--target", str(tmp_path / "none"), "--method", "ar"], "--target")):
        res = runner.invoke(app, ["serve", *args])
        assert res.exit_code == 2 and text in res.stderr and "Traceback" not in res.stderr, (args, res.stderr)


def test_open_host_without_key_warns(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen(1)
        res = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", str(busy.getsockname()[1])],
                                 env={"SPECX_API_KEY": None})  # fmt: skip
    assert res.exit_code == 2 and "without --api-key" in res.stderr and "another --port" in res.stderr, res.stderr


def test_sigterm_mid_stream_answers_and_exits_0(server):
    """Last in the module: it stops the server."""
    server.wait_idle(AUTH)  # the 429 test's abandoned stream may still hold the only slot
    body = {"messages": MSG, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base + CHAT, json=body, headers=AUTH, timeout=60) as res:
        assert res.status_code == 200, res.read()
        lines = res.iter_lines()
        head = [next(lines) for _ in range(2)]
        server.proc.send_signal(signal.SIGTERM)
        events = sse_events(head + list(lines))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(30) == 0
