"""`specx serve` scheduling (in-process, no HTTP): a streamed request is not starved by non-streamed ones.

Open WebUI sends its title and tags requests (not streamed, max_tokens 1000 or none) alongside the
streamed chat. Whatever --parallel is, a streamed request that finds every sequence busy with
non-streamed ones pauses one of them at the next pass boundary: its first token comes within a few
passes, it ends long before the background request, and the paused request resumes where it was with
the very reply it gets alone (T = 0, and T > 0 with a seed). Queued streamed requests are admitted
ahead of queued non-streamed ones. A request without max_tokens ends at the context end.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import GenerationConfig
from specexec_cli.core.forest import Lane
from specexec_cli.serve.jobs import Delta, Done, Failed, Job
from specexec_cli.serve.metrics import Metrics
from specexec_cli.serve.models import Work
from specexec_cli.serve.worker import Worker
from specexec_cli.session.chat import ChatSession
from specexec_cli.session.gendefaults import GREEDY
from specexec_cli.session.loading import LoadOptions, load_models

LONG = 48  # the background request's tokens (a title with max_tokens 1000, in small)
SHORT = 8  # the streamed chat's


@pytest.fixture(scope="module", params=["draft", "nodraft"])
def models(request, tiny_pair):
    draft = str(tiny_pair[1]) if request.param == "draft" else None
    m = load_models(LoadOptions(str(tiny_pair[0]), draft, dtype="fp32", device="cpu"))
    m.eos_ids = frozenset()  # whole replies
    return m


def start(models, parallel: int, ctx_tokens: int = 0) -> Worker:
    method = "specexec" if models.draft is not None else "ar"
    session = ChatSession(models, GenerationConfig(shape=TreeShape(8, 6), method=method), code=True)
    w = Worker(lambda: (session, GREEDY), max_queue=4, metrics=Metrics(), parallel=parallel)
    w.start()
    while w.state == "loading":
        time.sleep(0.01)
    assert w.state == "ready"
    return w


def job(loop, prompt: str, max_tokens: int | None, stream: bool, **kw) -> Job:
    j = Job(Work(prompt=prompt, max_tokens=max_tokens, **kw), loop, "completions")
    j.interactive = stream
    return j


async def collect(j: Job, log: list, name: str) -> list:
    items = []
    while not items or not isinstance(items[-1], (Done, Failed)):
        items.append(await asyncio.wait_for(j.events.get(), 300))
        if isinstance(items[-1], Delta) and items[-1].text and not any(e[0] == name for e in log):
            log.append((name, "first", time.perf_counter()))
    log.append((name, "done", time.perf_counter()))
    assert isinstance(items[-1], Done), items[-1]
    return items


def text(items) -> str:
    return items[-1].text


def alone(worker, prompt, max_tokens, **kw) -> str:
    async def go():
        j = job(asyncio.get_running_loop(), prompt, max_tokens, False, **kw)
        worker.submit(j)
        return await collect(j, [], "alone")

    return text(asyncio.run(go()))


def background_then_chat(worker, backgrounds: list[dict], chat: dict):
    """Submit the non-streamed `backgrounds`, wait for their first text, then the streamed `chat`;
    (events per request, the log of (name, "first" | "done", time))."""

    async def go():
        loop, log = asyncio.get_running_loop(), []
        bg = [job(loop, stream=False, **kw) for kw in backgrounds]
        for j in bg:
            worker.submit(j)
        tasks = [asyncio.create_task(collect(j, log, f"bg{i}")) for i, j in enumerate(bg)]
        while sum(e[1] == "first" for e in log) < len(bg):
            await asyncio.sleep(0.01)
        passes = worker.scheduler.forest.passes
        chat_job = job(loop, stream=True, **chat)
        worker.submit(chat_job)
        got = await collect(chat_job, log, "chat")
        return [*(await asyncio.gather(*tasks)), got], log, passes

    return asyncio.run(go())


@pytest.mark.parametrize("parallel,temperature", [(1, 0.0), (2, 0.9)])
def test_a_streamed_request_pauses_a_background_one_which_resumes_unchanged(models, parallel, temperature, monkeypatch):
    worker = start(models, parallel)
    try:
        kw = dict(temperature=temperature, seed=11)
        backgrounds = [dict(prompt=p, max_tokens=LONG, **kw) for p in ("def title(x):", "class tags:")[:parallel]]
        chat = dict(prompt="for i in range(3):", max_tokens=SHORT, **kw)
        want = [alone(worker, b["prompt"], LONG, **kw) for b in backgrounds] + [
            alone(worker, chat["prompt"], SHORT, **kw)
        ]
        paused = []  # the lanes the scheduler pauses for the streamed request
        monkeypatch.setattr(Lane, "pause", lambda lane, pause=Lane.pause: paused.append(lane) or pause(lane))
        got, log, _passes = background_then_chat(worker, backgrounds, chat)
        assert [text(items) for items in got] == want  # paused and resumed: the replies they get alone
        order = [(name, what) for name, what, _ in log]
        assert order.index(("chat", "done")) < min(order.index((f"bg{i}", "done")) for i in range(parallel))
        assert len(paused) == 1
        assert got[-1][-1].usage["completion_tokens"] == SHORT
    finally:
        worker.shutdown()
        worker.thread.join(60)


def test_queued_streamed_requests_are_admitted_before_queued_background_ones(models):
    """--parallel 1, one background request decoding, two more queued, then a streamed one: the
    streamed one pauses the first and runs before the queued background ones."""
    worker = start(models, 1)
    try:
        _got, log, _ = background_then_chat(
            worker, [dict(prompt="def a(x):", max_tokens=LONG)], dict(prompt="x = 1", max_tokens=SHORT)
        )
        assert log[-1][0] == "bg0"

        async def go():
            loop, log = asyncio.get_running_loop(), []
            bg = [job(loop, p, LONG, False) for p in ("def b(x):", "def c(x):", "def d(x):")]
            for j in bg:
                worker.submit(j)
            tasks = [asyncio.create_task(collect(j, log, f"bg{i}")) for i, j in enumerate(bg)]
            while not log:
                await asyncio.sleep(0.01)
            chat = job(loop, "y = 2", SHORT, True)
            worker.submit(chat)
            await collect(chat, log, "chat")
            await asyncio.gather(*tasks)
            return [(name, what) for name, what, _ in log]

        order = asyncio.run(go())
        assert order.index(("chat", "done")) < order.index(("bg1", "first"))
        assert [name for name, what in order if what == "done"] == ["chat", "bg0", "bg1", "bg2"]
    finally:
        worker.shutdown()
        worker.thread.join(60)


def test_no_max_tokens_ends_at_the_context_end(models):
    """A request without max_tokens on a Worker without a default cap (`specx serve` always gives it
    one, --max-new-tokens; max_tokens -1 is the same) runs to EOS or the context end: finish
    "length" with the context full, never a hang."""
    worker = start(models, 2)
    try:

        async def go():
            j = job(asyncio.get_running_loop(), "def f(x):", None, True)
            worker.submit(j)
            return await collect(j, [], "open")

        done = asyncio.run(go())[-1]
        assert done.finish == "length"
        assert done.usage["prompt_tokens"] + done.usage["completion_tokens"] == models.ctx_limit
    finally:
        worker.shutdown()
        worker.thread.join(60)


def test_background_requests_are_admitted_in_arrival_order_however_long_their_prompts_take(models, monkeypatch):
    """--parallel 1, three background requests at once, the first one's prompt slowest to prepare (a
    long chat template, many tools): the job threads prepare them side by side, and still the first
    one decodes first and they end in arrival order (each waits for the ones taken before it)."""
    worker = start(models, 1)
    real = Worker._prompt

    def prompt(self, work):
        if work.prompt == "def b(x):":
            time.sleep(0.5)  # the first request's prompt takes longest to prepare
        return real(self, work)

    monkeypatch.setattr(Worker, "_prompt", prompt)
    try:

        async def go():
            loop, log = asyncio.get_running_loop(), []
            bg = [job(loop, p, SHORT, False) for p in ("def b(x):", "def c(x):", "def d(x):")]
            for j in bg:
                worker.submit(j)
            await asyncio.gather(*(collect(j, log, f"bg{i}") for i, j in enumerate(bg)))
            return [(name, what) for name, what, _ in log]

        order = asyncio.run(go())
        assert [name for name, what in order if what == "first"] == ["bg0", "bg1", "bg2"], order
        assert [name for name, what in order if what == "done"] == ["bg0", "bg1", "bg2"], order
    finally:
        worker.shutdown()
        worker.thread.join(60)
