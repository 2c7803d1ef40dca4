"""Ctrl-C anywhere: SIGINT sent to a real `python -m specexec_cli` at several points.

`SPECX_TEST_SLOW` (read by tests/slow_specx.py, which runs the CLI) slows one phase and prints a `specx-test: <phase>`
marker on stderr when the phase starts, so SIGINT lands inside it: the offloaded load loop,
the prefill (first target pass), tree growth (draft forwards), a streamed disk pass (the
prefetch thread's reads), a chat reply and a bench cell. `run`/`bench` must exit 130 within 2 s
with no traceback and the text generated so far on stdout; chat must drop back to its prompt
and answer the next line.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import make_model
from tests.probes import after_each_layer

ROOT = Path(__file__).resolve().parents[1]
STOP_WITHIN = 2.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("intr")
    return make_model(root / "t", seed=1, layers=2), make_model(root / "d", seed=2, layers=2)


class Proc:
    """A specx subprocess whose stdout/stderr are collected by reader threads."""

    def __init__(self, args: list[str], slow: str, stdin=None):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", SPECX_TEST_SLOW=slow)
        env.pop("SPECX_DEBUG", None)
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.slow_specx", *args],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self.out: list[str] = []
        self.err: queue.Queue[str] = queue.Queue()
        self.err_text: list[str] = []
        self.pumps = [
            threading.Thread(target=self._pump_out, daemon=True),
            threading.Thread(target=self._pump_err, daemon=True),
        ]
        for t in self.pumps:
            t.start()

    def _pump_out(self):
        for ch in iter(lambda: self.p.stdout.read(1), ""):
            self.out.append(ch)

    def _pump_err(self):
        for line in self.p.stderr:
            self.err_text.append(line)
            self.err.put(line)

    def wait_marker(self, phase: str, timeout: float = 120.0) -> None:
        end = time.time() + timeout
        while time.time() < end:
            try:
                if self.err.get(timeout=0.5).strip() == f"specx-test: {phase}":
                    return
            except queue.Empty:
                if self.p.poll() is not None:
                    break
        pytest.fail(f"phase {phase} never started: {''.join(self.err_text)}")

    def wait_text(self, timeout: float = 120.0) -> None:
        end = time.time() + timeout
        while time.time() < end and not "".join(self.out).strip():
            assert self.p.poll() is None, "".join(self.err_text)
            time.sleep(0.05)

    def interrupt(self) -> tuple[int, float]:
        t0 = time.time()
        self.p.send_signal(signal.SIGINT)
        rc = self.p.wait(timeout=30)
        elapsed = time.time() - t0
        self.close()
        return rc, elapsed

    def close(self) -> None:
        """Once the process exited: let the reader threads drain the pipes, then close them."""
        self.p.wait(timeout=30)
        for t in self.pumps:
            t.join(timeout=5)
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            if f is not None and not f.closed:
                f.close()

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err_text)


def run_args(pair, tmp_path, *extra):
    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):")
    return [
        "run",
        str(prompt),
        "--target",
        str(pair[0]),
        "--draft",
        str(pair[1]),
        "--device",
        "cpu",
        "--no-live",
        "--max-new-tokens",
        "400",
        "--budget",
        "8",
        *extra,
    ]


def assert_stopped(rc, elapsed, proc, text_expected: bool):
    assert rc == 130, (rc, proc.stderr)
    assert elapsed < STOP_WITHIN, f"took {elapsed:.2f}s to stop"
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert "interrupted" in proc.stderr
    if text_expected:
        assert proc.stdout.strip(), "the text generated so far was not printed"


@pytest.mark.parametrize(
    "phase,slow,offload,text",
    [
        ("load", "load=0.5", "disk", False),
        ("target", "target=0.5", "disk", False),  # the first target forward is the prefill
    ],
)
def test_run_interrupted_before_text(pair, tmp_path, phase, slow, offload, text):
    proc = Proc(run_args(pair, tmp_path, "--offload", offload), slow)
    proc.wait_marker(phase)
    rc, elapsed = proc.interrupt()
    assert_stopped(rc, elapsed, proc, text)
    assert proc.stdout.strip() == ""


def test_serve_interrupted_while_loading_says_so_and_exits_0(pair):
    """The load (torch and C code on the worker thread) has no stop point: the server says so and ends at
    once with exit 0, where Python's shutdown under a running load aborted the process (exit 134)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = Proc(
        ["serve", "--target", str(pair[0]), "--device", "cpu", "--offload", "disk", "--port", str(port)], "load=2"
    )
    proc.wait_marker("load")
    rc, elapsed = proc.interrupt()
    assert rc == 0 and elapsed < STOP_WITHIN, (rc, elapsed, proc.stderr)
    assert "stopped while the model was loading" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "slow,offload",
    [
        ("draft=0.1", "none"),  # most wall time is tree growth
        ("copy=0.3", "disk"),  # most wall time is the prefetch thread's streamed reads
    ],
)
def test_run_interrupted_mid_generation_keeps_text(pair, tmp_path, slow, offload):
    stats = tmp_path / "s.json"
    proc = Proc(run_args(pair, tmp_path, "--offload", offload, "--stats-json", str(stats)), slow)
    proc.wait_text()
    rc, elapsed = proc.interrupt()
    assert_stopped(rc, elapsed, proc, True)
    rec = json.loads(stats.read_text())  # statistics of the partial run are still saved
    assert 0 < rec["new_tokens"] < 400


def test_chat_reply_interrupted_returns_to_prompt(pair, tmp_path):
    stats = tmp_path / "turns.jsonl"
    args = [
        "chat",
        "--target",
        str(pair[0]),
        "--draft",
        str(pair[1]),
        "--device",
        "cpu",
        "--no-live",
        "--max-new-tokens",
        "300",
        "--budget",
        "8",
        "--offload",
        "none",
        "--stats-json",
        str(stats),
    ]
    proc = Proc(args, "target=0.2", stdin=subprocess.PIPE)
    proc.p.stdin.write("first message\n")
    proc.p.stdin.flush()
    proc.wait_text()
    t0 = time.time()
    proc.p.send_signal(signal.SIGINT)
    while time.time() - t0 < 10 and not (stats.exists() and stats.read_text().count("\n") >= 1):
        time.sleep(0.05)
    elapsed = time.time() - t0
    assert elapsed < STOP_WITHIN, f"reply took {elapsed:.2f}s to stop"
    proc.p.stdin.write("/set max_new_tokens 3\nsecond message\n")
    proc.p.stdin.close()
    rc = proc.p.wait(timeout=120)
    proc.close()
    assert rc == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "partial reply is kept" in proc.stderr
    turns = [json.loads(x) for x in stats.read_text().splitlines()]
    assert next(t["finish_reason"] for t in turns) == "interrupted" and len(turns) == 2
    assert turns[0]["new_tokens"] > 0 and all(t["host_rss_bytes"] > 0 for t in turns)


def test_bench_cell_interrupted(pair, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    args = [
        "bench",
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "out"),
        "--target",
        str(pair[0]),
        "--draft",
        str(pair[1]),
        "--device",
        "cpu",
        "--no-live",
        "--methods",
        "ar,specexec",
        "--budgets",
        "4",
        "--temperatures",
        "0",
        "--max-new-tokens",
        "200",
        "--offload",
        "none",
    ]
    proc = Proc(args, "target=0.2")
    proc.wait_marker("target")
    rc, elapsed = proc.interrupt()
    assert_stopped(rc, elapsed, proc, False)


def test_interrupted_disk_pass_then_close_stops_threads_and_files(pair):
    """KeyboardInterrupt inside a streamed disk pass, then `close_models` (what `run` does on Ctrl-C):
    no prefetch thread is left running and every file descriptor the reader opened is closed."""
    import torch

    from offload import OffloadedCausalLM
    from specexec_cli.session.loading import close_models

    model = OffloadedCausalLM.from_pretrained(pair[0], device="cpu", dtype=torch.float32, offload="disk")
    reader = model.store.reader

    def ctrl_c(layer):
        if layer == 0:
            raise KeyboardInterrupt

    after_each_layer(model, ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert reader._fds, "the disk pass should have opened the shard"
    close_models(type("M", (), {"target": model, "draft": None})())
    assert not reader._fds
    alive = [t.name for t in threading.enumerate() if t.name.startswith(("offload-read", "offload-copy"))]
    assert not alive, alive
