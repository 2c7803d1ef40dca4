"""Run `specx` in a real pseudo-terminal and render what it wrote with a terminal emulator (pyte).

Contract: `PtyRun` forks `python -m specexec_cli ARGS` on a pty of a fixed size, answers the
emulator's device reports (cursor-position queries from prompt_toolkit) back into the pty, and
exposes the rendered screen (`lines()`), the raw bytes, `send()` for keystrokes, `wait_for()` to
sync on screen text, and `finish()` for the exit status. POSIX only; callers skip elsewhere.
"""

from __future__ import annotations

import os
import select
import sys
import time
from pathlib import Path

import pyte

ROOT = Path(__file__).resolve().parents[1]


class _Screen(pyte.Screen):
    """A pyte screen that answers device status reports (e.g. ESC[6n) into the pty."""

    def __init__(self, cols: int, rows: int, fd: int):
        super().__init__(cols, rows)
        self._fd = fd

    def write_process_input(self, data: str) -> None:
        os.write(self._fd, data.encode())


class PtyRun:
    def __init__(self, args: list[str], env: dict | None = None, rows: int = 50, cols: int = 160):
        import fcntl
        import pty
        import struct
        import termios

        pid, fd = pty.fork()
        if pid == 0:  # child: the pty slave is fd 0/1/2; give it its size before python starts
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            os.chdir(ROOT)
            full_env = dict(
                os.environ,
                **(env or {}),
                PYTHONPATH=str(ROOT),
                TERM="xterm-256color",
                COLUMNS=str(cols),
                LINES=str(rows),
                OMP_NUM_THREADS="1",
            )
            os.execve(sys.executable, [sys.executable, "-m", "specexec_cli", *args], full_env)
        self.pid, self.fd, self.raw = pid, fd, b""
        self.screen = _Screen(cols, rows, fd)
        self.stream = pyte.ByteStream(self.screen)
        self.status: int | None = None

    def pump(self, timeout: float = 0.05) -> bool:
        """Read what is available; False once the child closed the pty."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child exited and the slave side is gone
            return False
        if not data:
            return False
        self.raw += data
        self.stream.feed(data)
        return True

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def text(self) -> str:
        return "\n".join(self.lines())

    def wait_for(self, needle: str, timeout: float = 120.0, count: int = 1) -> None:
        """Pump until `needle` shows `count` times on the screen."""
        end = time.monotonic() + timeout
        while self.text().count(needle) < count:
            if not self.pump() or time.monotonic() > end:
                raise AssertionError(f"{needle!r} never appeared; screen:\n{self.text()}")

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def finish(self, timeout: float = 120.0) -> int:
        end = time.monotonic() + timeout
        while self.pump() and time.monotonic() < end:
            pass
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        self.status = os.waitstatus_to_exitcode(status)
        return self.status


def find_block(screen: list[str], block: list[str]) -> int:
    """Index of the first screen row where `block` appears as consecutive rows, else -1."""
    for i in range(len(screen) - len(block) + 1):
        if screen[i : i + len(block)] == block:
            return i
    return -1
