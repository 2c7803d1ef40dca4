"""`specx serve` through the real `openai` client against a real uvicorn process (tiny models, CPU).

One server for the module: chat and completions, streamed and not, usage, stop strings, seeds,
two concurrent clients, a disconnect mid-stream, multi-turn prefix reuse, and temperature-0
equality with `specx run --no-chat-template`.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from openai import OpenAI
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.serve_util import Server, sse_events

MAX_NEW = 16


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    srv = Server.start(
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
            "tiny",
            "--max-queue",
            "4",
        ],
        tmp_path_factory.mktemp("serve"),
    )
    yield srv
    assert srv.stop() == 0, srv.stderr()
    assert "Traceback" not in srv.stderr() and "Warning" not in srv.stderr(), srv.stderr()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, text, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], **kw)


def stream_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_models_health_and_page(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].object == "model"
    assert models.data[0].owned_by and models.data[0].created > 0
    assert server.http("GET", "/health")[2] == {"status": "ok"}
    status, headers, page = server.http("GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page and "<script" in page and "http" not in page.split("<script")[1][:200]


def test_chat_non_stream_shape_usage_and_stats(client):
    res = chat(client, "def f(x):")
    assert res.object == "chat.completion" and res.id.startswith("chatcmpl-") and res.model == "tiny"
    choice = res.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = res.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= MAX_NEW
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    stats = res.model_extra["specx"]
    assert stats["target_passes"] >= 1 and stats["tokens_per_pass"] >= 1
    assert stats["draft_tokens_accepted"] <= stats["draft_tokens_proposed"]
    assert stats["prefill_tokens"] == u.prompt_tokens - u.prompt_tokens_details.cached_tokens


def test_chat_stream_matches_non_stream(client):
    ref = chat(client, "class a:", max_tokens=12)
    chunks = list(chat(client, "class a:", max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == ref.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    assert stream_text(chunks) == ref.choices[0].message.content
    assert "tokens_per_pass" in finals[0].model_extra["specx"]


def test_completions_stream_and_not(client):
    ref = client.completions.create(model="tiny", prompt="def g(y):", max_tokens=10, temperature=0)
    assert ref.object == "text_completion" and ref.choices[0].finish_reason in ("stop", "length")
    assert ref.usage.completion_tokens <= 10
    chunks = list(
        client.completions.create(model="tiny", prompt="def g(y):", max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.choices[0].text
    assert chunks[-1].choices[0].finish_reason == ref.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, stream):
    full = client.completions.create(model="tiny", prompt="x = (", max_tokens=MAX_NEW, temperature=0).choices[0].text
    assert len(full) >= 6, full
    stop = full[3:5]
    cut = full.index(stop)
    res = client.completions.create(
        model="tiny",
        prompt="x = (",
        max_tokens=MAX_NEW,
        temperature=0,
        stop=[stop, "never-there"],
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    if stream:
        chunks = list(res)
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        text, finish = "".join(c.choices[0].text for c in chunks if c.choices), finals[0].choices[0].finish_reason
        usage = chunks[-1].usage
    else:
        text, finish, usage = res.choices[0].text, res.choices[0].finish_reason, res.usage
    assert (text, finish) == (full[:cut], "stop")
    assert usage.completion_tokens == cut + len(stop)  # one token per character: none past the stop string


def test_seeds(client):
    def sample(seed):
        return chat(client, "def h(z):", temperature=1.0, seed=seed, max_tokens=6).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(1), sample(2), sample(3)}) > 1
    unseeded = {chat(client, "def h(z):", temperature=1.0, max_tokens=6).choices[0].message.content for _ in range(3)}
    assert len(unseeded) > 1  # no seed: fresh randomness per request


def test_two_concurrent_clients(client):
    prompts = ["def a(x):", "class b:"]
    ref = [chat(client, p).choices[0].message.content for p in prompts]
    out: dict[int, str] = {}

    def run(i):
        out[i] = stream_text(chat(client, prompts[i], stream=True))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [out.get(0), out.get(1)] == ref


def test_disconnect_mid_stream_then_a_request_equals_a_fresh_run(server, client):
    ref = chat(client, "def k(n):").choices[0].message.content
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "import os"}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=60) as res:
        assert res.status_code == 200
        lines = res.iter_lines()
        got = [next(lines) for _ in range(4)]  # the role chunk and a delta or two
    assert sse_events(got)
    t0 = time.monotonic()
    assert chat(client, "def k(n):").choices[0].message.content == ref
    assert time.monotonic() - t0 < 30  # the 400-token generation did not run to its end
    status, _, metrics = server.http("GET", "/metrics")
    assert status == 200 and 'specx_requests_total{endpoint="chat",outcome="cancelled"} 1' in metrics


def test_multi_turn_reuses_the_prefix(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    first = client.chat.completions.create(model="tiny", messages=msgs, temperature=0)
    reply = first.choices[0].message.content
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "x = 1"}]
    second = client.chat.completions.create(model="tiny", messages=msgs, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens
    prefill = second.model_extra["specx"]["prefill_tokens"]
    assert prefill == second.usage.prompt_tokens - cached
    assert prefill <= len("\nUser: x = 1\nAssistant:") + 2  # only the new turn (char tokenizer), + a root


def test_temperature_0_equals_specx_run(tiny_pair, client):
    prompt = "def fib(n):\n"
    res = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    target, draft = tiny_pair
    run = CliRunner().invoke(
        app,
        [
            "run",
            "-p",
            prompt,
            "--no-chat-template",
            "-n",
            str(MAX_NEW),
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--no-live",
        ],
    )
    assert run.exit_code == 0, run.stderr
    text = res.choices[0].text
    assert run.stdout in (text, text + "\n")


def test_a_tiny_temperature_is_greedy(client):
    """T = 1e-7 would overflow logits / T; below sampling.GREEDY_BELOW it is argmax, as T = 0."""
    ref = chat(client, "def t(q):", temperature=0)
    tiny = chat(client, "def t(q):", temperature=1e-7, seed=3)
    assert tiny.choices[0].message.content == ref.choices[0].message.content
    assert tiny.usage.completion_tokens == ref.usage.completion_tokens


def test_loopback_without_key_checks_the_host_header(server):
    """DNS rebinding: a page on attacker.example whose name resolves to 127.0.0.1 gets 403."""
    for path in ("/v1/models", "/", "/health"):
        status, _, res = server.http("GET", path, headers={"Host": "attacker.example"})
        assert status == 403 and res["error"]["code"] == "host_not_allowed", (path, res)
    status, _, res = server.http(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}]},
        {"Host": "attacker.example:8000"},
    )
    assert status == 403, res
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]", "127.1.2.3:80"):
        assert server.http("GET", "/v1/models", headers={"Host": host})[0] == 200, host


def test_a_queued_stream_gets_its_headers_at_once(server, client):
    long = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "import re"}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=long, timeout=60) as running:
        next(running.iter_lines())  # the worker is busy with this one
        t0 = time.monotonic()
        with httpx.stream(
            "POST", f"{server.base}/v1/chat/completions", json={**long, "max_tokens": 2}, timeout=60
        ) as queued:
            assert queued.status_code == 200 and time.monotonic() - t0 < 5  # not after the 400 tokens
            assert queued.headers["content-type"].startswith("text/event-stream")
            running.close()  # the first client leaves; the queued one runs
            events = sse_events(queued.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
