"""Cancellation in `specx serve` against a real uvicorn process whose target passes are slowed down
(SPECX_TEST_SLOW, tests/slow_specx.py), so that "within one pass" is measurable: a non-streamed
request whose client disconnects frees the worker at once; with --max-queue 1 a queued request
whose client left gives its slot back (the next request is queued, not refused with 429); SIGTERM
ends the running reply at a pass boundary and exits 0; /health says "stopping" meanwhile."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

from specexec_cli.serve.app import create_app
from specexec_cli.serve.metrics import Metrics
from specexec_cli.serve.worker import Worker
from tests.serve_util import Server

PASS_SLEEP = 0.03  # seconds per target layer forward: about 0.1 s per target pass (3 layers)
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "import os"}], "max_tokens": 400, "temperature": 0}


def start(tiny_pair, tmp, *extra) -> Server:
    target, draft = tiny_pair
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
            "4",
            "--model-name",
            "tiny",
            *extra,
        ],
        tmp,
        env={"SPECX_TEST_SLOW": f"target={PASS_SLEEP}", "OMP_NUM_THREADS": "1"},
        module="tests.slow_specx",
    )


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    srv = start(
        tiny_pair, tmp_path_factory.mktemp("cancel"), "--max-queue", "1", "--parallel", "1"
    )  # one runs, one waits
    yield srv
    assert srv.stop() == 0, srv.stderr()
    assert "Traceback" not in srv.stderr(), srv.stderr()


def open_request(port: int, body: dict) -> socket.socket:
    """A POST /v1/chat/completions sent on a raw socket that the test closes to disconnect."""
    sock = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(data) + data
    )
    return sock


def metric(server: Server, name: str) -> float:
    text = server.http("GET", "/metrics")[2]
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for(server: Server, name: str, value: float, timeout: float = 30) -> float:
    """Seconds until /metrics shows `name` == value (AssertionError after `timeout`)."""
    t0 = time.monotonic()
    while metric(server, name) != value:
        assert time.monotonic() - t0 < timeout, f"{name} != {value} after {timeout}s"
        time.sleep(0.02)
    return time.monotonic() - t0


CANCELLED = 'specx_requests_total{endpoint="chat",outcome="cancelled"}'


def test_a_non_streamed_request_whose_client_left_frees_the_worker(server):
    tokens, cancelled = metric(server, "specx_completion_tokens_total"), metric(server, CANCELLED)
    sock = open_request(server.port, LONG)
    wait_for(server, "specx_busy", 1)
    time.sleep(0.5)  # a few passes into the reply
    sock.close()
    freed = wait_for(server, "specx_busy", 0)
    assert freed < 3.0  # one pass is about 0.1 s; the whole reply would take 10 s or more
    assert metric(server, CANCELLED) == cancelled + 1
    assert metric(server, "specx_completion_tokens_total") - tokens < 200


def test_a_queued_request_whose_client_left_gives_its_slot_back(server):
    running = open_request(server.port, LONG)
    wait_for(server, "specx_busy", 1)
    queued = open_request(server.port, {**LONG, "max_tokens": 4})
    wait_for(server, "specx_queue_depth", 1)
    queued.close()
    assert wait_for(server, "specx_queue_depth", 0) < 2.0  # at once, not when the worker reaches it
    answer: dict = {}

    def third():  # --max-queue 1: a slot is free again, so this one waits instead of getting 429
        answer["reply"] = server.http("POST", "/v1/chat/completions", {**LONG, "max_tokens": 4}, timeout=120)

    thread = threading.Thread(target=third)
    thread.start()
    wait_for(server, "specx_queue_depth", 1)
    running.close()
    thread.join(120)
    status, _, body = answer["reply"]
    assert status == 200, body
    assert body["usage"]["completion_tokens"] <= 4


def test_sigterm_ends_the_reply_at_a_pass_boundary(tiny_pair, tmp_path):
    srv = start(tiny_pair, tmp_path)
    answer: dict = {}
    thread = threading.Thread(
        target=lambda: answer.update(r=srv.http("POST", "/v1/chat/completions", LONG, timeout=120))
    )
    thread.start()
    wait_for(srv, "specx_busy", 1)
    time.sleep(0.5)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert srv.proc.wait(60) == 0 and time.monotonic() - t0 < 10, srv.stderr()
    status, _, body = answer["r"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert 0 < body["usage"]["completion_tokens"] < 200
    assert "Traceback" not in srv.stderr(), srv.stderr()


def test_health_says_stopping_once_shutdown_begins():
    worker = Worker(lambda: (None, None), max_queue=1, metrics=Metrics())
    worker.state = "ready"
    with TestClient(create_app(worker, "m")) as api:
        assert api.get("/health").json() == {"status": "ok"}
        worker.shutdown()
        res = api.get("/health")
    assert res.status_code == 503 and res.json() == {"status": "stopping"}
