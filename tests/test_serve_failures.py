"""`specx serve` failure paths in real uvicorn (a thread of this process) over a scripted session:
5xx logged by error id (no exception text to the client), device OOM as a 400, the Host check
(DNS rebinding), HEAD/stopping /health, stream headers at once with SSE keep-alives, stop-string
token accounting and the plain format's "\\nUser:" stop, refusal counters and latency histograms.

The scripted session stands in for `chat.ChatSession` (its decode yields the `StepEvent`s a test
gives, over a one-token-per-character tokenizer), so each failure is forced, not hoped for; the
worker, the app, the middleware and the HTTP stack are the real ones.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig, StepEvent
from specexec_cli.serve.app import create_app
from specexec_cli.serve.jobs import Delta, Done, Started
from specexec_cli.serve.metrics import Metrics
from specexec_cli.serve.worker import Worker
from specexec_cli.session.chat import plain_prompt
from specexec_cli.session.gendefaults import GREEDY
from tests.serve_util import app_server, raw_http

MSG = [{"role": "user", "content": "hi"}]


class CharTokenizer:
    def decode(self, ids):
        return "".join(map(chr, ids))


def step(text: str, index: int) -> StepEvent:
    return StepEvent(
        text=text,
        tokens=[ord(c) for c in text],
        accepted=0,
        pass_index=index,
        tree_size=1,
        tree_depth=1,
        draft_seconds=0.0,
        target_seconds=0.001,
        prefill_seconds=0.0,
        decode_seconds=0.001 * index,
        new_tokens=0,
        prompt_tokens=0,
    )


class ScriptedSession:
    """What the worker uses of a ChatSession; `decode` yields `script` (one StepEvent per string)."""

    system, templated, code, tuner, prompt_cache = None, False, False, None, None

    def __init__(self, script=(), error: BaseException | None = None, delay: float = 0.0):
        self.script, self.error, self.delay = list(script), error, delay
        self.models = type(
            "M", (), {"tokenizer": CharTokenizer(), "ctx_limit": 4096, "eos_ids": [0], "stop_strings": ()}
        )()
        self.cfg = GenerationConfig(shape=TreeShape(4, 4), max_new_tokens=64)
        self.state = DecodeState()

    def conversation_ids(self, messages):
        time.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return [ord(c) for c in plain_prompt(messages, False)]

    def prefill_ids(self, full):
        return full

    def decode(self, ids, cfg, gen):
        for i, text in enumerate(self.script, 1):
            yield step(text, i)


def real_worker(session) -> Worker:
    worker = Worker(lambda: (session, GREEDY), max_queue=4, metrics=Metrics())
    worker.start()
    while worker.state == "loading":
        time.sleep(0.01)
    assert worker.state == "ready"
    return worker


def client(port: int, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30)


def chat(port, **kw):
    """One chat request through the openai SDK (a stream is read to its end)."""
    with client(port) as sdk:
        res = sdk.chat.completions.create(model="m", messages=kw.pop("messages", MSG), **kw)
        return list(res) if kw.get("stream") else res


# -- 5xx and OOM --------------------------------------------------------------------------------------
@pytest.mark.parametrize("debug", [False, True])
def test_a_worker_failure_is_a_500_with_an_error_id_and_one_log_line(capfd, monkeypatch, debug):
    if debug:
        monkeypatch.setenv("SPECX_DEBUG", "1")
    worker = real_worker(ScriptedSession(error=ValueError("cannot read /home/alice/models/secret.bin")))
    with app_server(create_app(worker, "m")) as port, pytest.raises(openai.InternalServerError) as err:
        chat(port)
    worker.shutdown()
    body = err.value.body
    assert err.value.status_code == 500 and body["code"] == "internal_error" and body["type"] == "server_error"
    assert "/home/alice" not in body["message"] and "ValueError" not in body["message"]
    eid = re.search(r"error id ([0-9a-f]{12})", body["message"]).group(1)
    log = capfd.readouterr().err
    line = next(ln for ln in log.splitlines() if eid in ln)
    rid = err.value.response.headers["x-request-id"]
    assert line == f"specx serve: error {eid} (request {rid}): ValueError: cannot read /home/alice/models/secret.bin"
    assert ("Traceback" in log) == debug


def test_an_app_failure_is_a_500_with_an_error_id(capfd):
    class Broken:
        metrics, state, running, stopping = Metrics(), "ready", 0, threading.Event()

        def submit(self, job):
            raise KeyError("/srv/private/path")

        def queue_depth(self):
            return 0

    with app_server(create_app(Broken(), "m")) as port:
        status, _, body = raw_http(port, "POST", "/v1/chat/completions", {"messages": MSG})
        _, _, metrics = raw_http(port, "GET", "/metrics")
    assert status == 500 and body["error"]["code"] == "internal_error" and "/srv" not in body["error"]["message"]
    eid = re.search(r"error id ([0-9a-f]{12})", body["error"]["message"]).group(1)
    log = capfd.readouterr().err
    assert re.search(rf"specx serve: error {eid} \(request [0-9a-f]{{32}}\): KeyError", log) and "Traceback" not in log
    assert 'specx_refused_requests_total{status="500",type="server_error"} 1' in metrics


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("MPS backend out of memory"),
    ],
)
def test_device_oom_is_a_400_that_says_what_to_lower(error):
    worker = real_worker(ScriptedSession(error=error))
    with (
        app_server(create_app(worker, "m")) as port,
        pytest.raises(openai.BadRequestError) as err,
    ):  # a 4xx: the SDKs do not retry it
        chat(port)
    worker.shutdown()
    body = err.value.body
    assert body["code"] == "device_out_of_memory"
    assert all(word in body["message"] for word in ("max_tokens", "--budget", "--ctx"))


# -- /health ------------------------------------------------------------------------------------------
def test_health_head_and_stopping():
    worker = real_worker(ScriptedSession(["x"]))
    with app_server(create_app(worker, "m")) as port:
        assert raw_http(port, "HEAD", "/health")[:1] == (200,)
        assert raw_http(port, "GET", "/health")[2] == {"status": "ok"}
        worker.shutdown()  # what SIGTERM does first: /health tells load balancers to go elsewhere
        assert raw_http(port, "GET", "/health")[:3:2] == (503, {"status": "stopping"})
        status, _, body = raw_http(port, "HEAD", "/health")
        assert status == 503 and body == ""


# -- the Host check ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "host,key,header,status",
    [
        ("127.0.0.1", None, "attacker.example", 403),
        ("127.0.0.1", None, "attacker.example:8000", 403),
        ("127.0.0.1", None, "127.0.0.1.attacker.example", 403),
        ("127.0.0.1", None, "localhost:8000", 200),
        ("127.0.0.1", None, "127.0.0.2", 200),
        ("127.0.0.1", None, "[::1]:8000", 200),
        ("127.0.0.1", None, "app.localhost", 200),
        ("localhost", None, "LOCALHOST.", 200),
        ("::1", None, "attacker.example", 403),
        ("127.0.0.1", "k", "attacker.example", 200),  # with a key, the key decides
        ("0.0.0.0", None, "attacker.example", 200),  # an open bind has no loopback name to check against
        (None, None, "attacker.example", 200),  # create_app without the bound host: no check
    ],
)
def test_host_header_on_a_loopback_bind(host, key, header, status):
    worker = real_worker(ScriptedSession(["x"]))
    with app_server(create_app(worker, "m", host=host, api_key=key)) as port:
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        got, _, body = raw_http(port, "GET", "/v1/models", None, {"Host": header, **auth})
        if key:  # the same Host without the key: 401, not 403
            assert raw_http(port, "GET", "/v1/models", None, {"Host": header})[0] == 401
    worker.shutdown()
    assert got == status, body
    if status == 403:
        assert body["error"]["code"] == "host_not_allowed" and body["error"]["type"] == "permission_error"


# -- streams: headers at once, keep-alive comments -------------------------------------------------------
class SlowWorker:
    """A worker that answers each job only after `delay` seconds (a long queue or prefill)."""

    state, busy, session = "ready", False, None

    def __init__(self, delay: float):
        self.delay, self.metrics, self.stopping = delay, Metrics(), threading.Event()

    def queue_depth(self):
        return 0

    def submit(self, job):
        def later():
            time.sleep(self.delay)
            usage = {
                "prompt_tokens": 2,
                "completion_tokens": 2,
                "total_tokens": 4,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            for item in (Started(2, 0), Delta("ok", [[2, "target"]], {}), Done("ok", "stop", usage, {})):
                job.emit(item)

        threading.Thread(target=later, daemon=True).start()


def test_a_stream_sends_headers_at_once_and_keep_alive_comments():
    with app_server(create_app(SlowWorker(1.5), "m", keepalive=0.2)) as port:
        body = {"messages": MSG, "stream": True}
        t0 = time.monotonic()
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30) as res:
            head_seconds = time.monotonic() - t0
            lines = list(res.iter_lines())
        assert res.status_code == 200 and head_seconds < 1.0, head_seconds
        first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data:") and '"content": "ok"' in ln)
        assert lines[:first_data].count(": keep-alive") >= 3, lines
        chunks = chat(port, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"  # the SDK skips them


# -- stop strings ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "script,stop,text,tokens",
    [
        (["hello wor", "ld and more"], ["world"], "hello ", 11),  # the stop ends 2 tokens into the 2nd pass
        (["hello world and more"], ["o w"], "hell", 7),
        (["ab\nUs", "er: cd"], None, "ab", 8),  # the plain format's own stop: the model began a user turn
    ],
)
def test_completion_tokens_end_at_the_stop_string(script, stop, text, tokens):
    worker = real_worker(ScriptedSession(script))
    with app_server(create_app(worker, "m")) as port:
        res = chat(port, stop=stop)
    worker.shutdown()
    assert (res.choices[0].message.content, res.choices[0].finish_reason) == (text, "stop")
    assert res.usage.completion_tokens == tokens  # one token per character; the pass made more


# -- metrics ---------------------------------------------------------------------------------------------
def test_metrics_count_refusals_and_have_latency_histograms():
    worker = real_worker(ScriptedSession(["abc"]))
    with app_server(create_app(worker, "m", host="127.0.0.1")) as port:
        for _ in range(2):
            chat(port)
        raw_http(port, "POST", "/v1/chat/completions", {"messages": []})
        raw_http(port, "GET", "/v1/models", None, {"Host": "attacker.example"})
        raw_http(port, "GET", "/nope")
        _, headers, text = raw_http(port, "GET", "/metrics")
    worker.shutdown()
    assert headers["content-type"].startswith("text/plain")
    for line in (
        'specx_refused_requests_total{status="400",type="invalid_request_error"} 1',
        'specx_refused_requests_total{status="403",type="permission_error"} 1',
        'specx_refused_requests_total{status="404",type="invalid_request_error"} 1',
        "# TYPE specx_time_to_first_token_seconds histogram",
        "# TYPE specx_request_seconds histogram",
        "specx_request_seconds_count 2",
        "specx_time_to_first_token_seconds_count 2",
    ):
        assert line in text.splitlines(), (line, text)
    buckets = [int(v) for v in re.findall(r'specx_request_seconds_bucket\{le="[^"]+"\} (\d+)', text)]
    assert buckets == sorted(buckets) and buckets[-1] == 2 and 'le="+Inf"' in text
    assert float(re.search(r"specx_request_seconds_sum (\S+)", text).group(1)) > 0


def test_a_stream_error_after_the_headers_is_an_error_event_and_counted():
    worker = real_worker(ScriptedSession(error=RuntimeError("CUDA out of memory"), delay=1.0))
    with app_server(create_app(worker, "m")) as port:
        with pytest.raises(openai.APIError, match="out of device memory"):
            chat(port, stream=True)
        _, _, text = raw_http(port, "GET", "/metrics")
    worker.shutdown()
    assert 'specx_refused_requests_total{status="400",type="invalid_request_error"} 1' in text
