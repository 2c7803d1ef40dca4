"""Helpers for the `specx serve` tests: start a real server process on a free port, raw HTTP.

`Server.start(args)` runs `python -m specexec_cli serve --port <free> ...` (`module`: another launcher,
e.g. tests.slow_specx) and waits for /health
to answer 200; `stop()` sends SIGTERM and returns the exit code. `http()` is raw HTTP via
http.client (no client library between the test and the bytes on the wire). `app_server(app)`
runs an ASGI app (create_app over a fake worker) in real uvicorn on a thread of this process.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, stderr_path: Path):
        self.proc, self.port, self.stderr_path = proc, port, stderr_path
        self.base = f"http://127.0.0.1:{port}"

    @classmethod
    def start(
        cls, args: list[str], tmp: Path, env: dict | None = None, timeout: float = 120, module: str = "specexec_cli"
    ) -> Server:
        port = free_port()
        full_env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            XDG_CONFIG_HOME=str(tmp / "xdg"),
            PYTHONUNBUFFERED="1",
            **(env or {}),
        )
        full_env.pop("SPECX_DEBUG", None)
        err = tmp / f"serve-{port}.err"
        cmd = [sys.executable, "-m", module, "serve", "--port", str(port), *args]  # tests.slow_specx: slowed
        with open(err, "w") as err_file:  # the child keeps its own descriptor; ours closes here
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file, env=full_env, cwd=tmp)
        server = cls(proc, port, err)
        server.wait_ready(timeout)
        return server

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.stderr()}")
            try:
                status, _, _ = self.http("GET", "/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout}s: {self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def http(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 60):
        """(status, headers dict, parsed JSON or text) of one raw HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            res = conn.getresponse()
            raw = res.read().decode()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = raw
            return res.status, {k.lower(): v for k, v in res.getheaders()}, parsed
        finally:
            conn.close()

    def wait_idle(self, headers: dict | None = None, timeout: float = 60) -> None:
        """Wait until /metrics shows no request running or queued: a stream the client closed is
        cancelled at the worker's next pass, which on a loaded machine can come after the next test
        has already sent its request (and, with --max-queue 0, been refused with a 429)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, _, text = self.http("GET", "/metrics", None, headers)
            gauges = {
                ln.split()[0]: float(ln.split()[1])
                for ln in str(text).splitlines()
                if ln.startswith(("specx_running_requests ", "specx_queue_depth "))
            }
            if gauges and not any(gauges.values()):
                return
            time.sleep(0.1)
        raise AssertionError(f"server still busy after {timeout}s: {self.stderr()}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def raw_http(port: int, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 30):
    """(status, headers dict, parsed JSON or text) of one raw HTTP request to 127.0.0.1:port."""
    return Server(None, port, None).http(method, path, body, headers, timeout)


@contextmanager
def app_server(app):
    """Serve `app` with uvicorn on a free loopback port from a thread; yields the port. Enter it in a test's
    body, not in a fixture: the app logs each request on stderr after answering it, and leaving joins the
    thread, so the line is the test's captured output and never lands on pytest's own terminal output."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def sse_events(lines) -> list:
    """Parse `data: ...` SSE lines into JSON objects (and the string "[DONE]")."""
    out = []
    for line in lines:
        line = line.decode() if isinstance(line, bytes) else line
        if line.startswith("data: "):
            data = line[len("data: ") :].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
