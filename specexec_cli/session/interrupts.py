"""Ctrl-C during a chat reply: stop after the current target pass, or mid-pass after a grace time.

Contract: `with interrupt_guard(flag):` routes SIGINT to `flag` (main thread only). The first
Ctrl-C sets `flag.stop`, which the reply loop checks between passes; if the pass is still running
GRACE_SECONDS later, KeyboardInterrupt is raised in the main thread, as a second Ctrl-C would.
"""

from __future__ import annotations

import _thread
import signal
import threading
from contextlib import contextmanager

GRACE_SECONDS = 1.0


class StopFlag:
    def __init__(self):
        self.stop = False
        self.timer: threading.Timer | None = None

    def handler(self, signum, frame):
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True
        self.timer = threading.Timer(GRACE_SECONDS, _thread.interrupt_main)
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        """Cancel the grace timer and wait for it (a fired one raises KeyboardInterrupt here)."""
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()
            timer.join()


@contextmanager
def interrupt_guard(flag: StopFlag):
    """Route SIGINT to `flag` while a reply streams (main thread only; elsewhere a no-op)."""
    flag.stop = False
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    old = signal.signal(signal.SIGINT, flag.handler)
    try:
        yield flag
    finally:
        try:
            flag.disarm()
        finally:
            signal.signal(signal.SIGINT, old)
