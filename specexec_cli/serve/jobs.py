"""What the serve worker hands back to a request: the `Job` the HTTP layer submits and the reports it awaits.

Contract: the worker's threads `emit` to a `Job`'s asyncio queue, in order, `Started` (or `Failed`),
text `Delta`s, then `Done`, through `loop.call_soon_threadsafe`, so the event loop never waits on the
model. `job.cancel()` (the client went away) sets `cancelled` and calls the worker's `on_cancel` hook.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby

from specexec_cli.serve.models import APIError, Work


@dataclass
class Started:
    prompt_tokens: int  # the whole prompt
    cached_tokens: int  # of which were already in the caches (not prefilled)
    task: str | None = None  # the client's background task (limits.task_of), for the access log


@dataclass
class Delta:
    text: str
    spans: list  # [[chars, "draft" | "target"], ...]: which model's tokens the text came from
    live: dict  # running tokens/s, tokens per pass, passes
    logprobs: list | None = None  # shapes.token_entry of the tokens since the last Delta (None: off)
    tool_calls: list | None = None  # one OpenAI delta.tool_calls entry (then text is "")


@dataclass
class Done:
    text: str  # the whole completion (stop string and tool calls removed)
    finish: str  # "stop" | "length" | "tool_calls" | "cancelled"
    usage: dict
    specx: dict  # RunStats.speculative()
    tool_calls: list = field(default_factory=list)  # OpenAI tool_calls dicts ([]: a text reply)
    logprobs: list | None = None  # every token's shapes.token_entry (None: logprobs off)


@dataclass
class Failed:
    error: APIError


class Job:
    """One request: the worker's reports land in `events` (an asyncio.Queue on `loop`)."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop, endpoint: str):
        self.work, self.loop, self.endpoint = work, loop, endpoint
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.started = False  # the worker took it (set under Worker.lock)
        self.released = False  # its --max-queue slot was given back (set under Worker.lock)
        self.on_cancel: Callable[[], None] = lambda: None  # set by Worker.submit
        self.request_id: str | None = None  # guards.Observe's id of the request (its log lines name it)
        self.interactive = False  # a streamed request (a person waiting): served before non-streamed ones
        self.seq = 0  # submission order (set by Worker.submit)
        self.admitted = False  # decoding (or paused) rather than waiting (set by the thread serving it)

    def emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        """The client went away: a queued job gives its slot back now, a running one stops after this pass."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            self.on_cancel()


def spans(mask: list[bool]) -> list:
    """Run-length [[n, "draft"|"target"], ...] of a per-character origin mask."""
    return [[len(list(run)), "draft" if is_draft else "target"] for is_draft, run in groupby(mask)]
