"""A conversation keeps its prefix cached while Open WebUI's background requests run, whatever --parallel is.

In-process worker, a templated tiny model without a draft, a prompt cache. Each turn is sent as Open
WebUI sends it: the streamed chat with a title and a tags request at once (not streamed, longer
than the reply, their prompts the history pasted into one user message), then a follow-up request,
and the next turn goes out while those still run. Turn k+1's cached tokens must be >= 99% of the
tokens it shares with turn k's prompt plus turn k's reply (the rest is the new user message).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import GenerationConfig
from specexec_cli.serve.jobs import Done, Failed, Job, Started
from specexec_cli.serve.metrics import Metrics
from specexec_cli.serve.models import Work
from specexec_cli.serve.worker import Worker
from specexec_cli.session.chat import ChatSession
from specexec_cli.session.gendefaults import GREEDY
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.session.prompt_cache import PromptCache, common_prefix
from tests.tool_models import PLAIN_TEMPLATE, make_tool_pair

SYSTEM = "you are a helpful assistant. answer in short sentences and say so when you do not know. " * 3
TURNS = ["what is a list?", "and a tuple?", "show me code", "why is it faster?", "one more example"]
REPLY, BACKGROUND = 12, 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, _ = make_tool_pair(tmp_path_factory.mktemp("reuse"), PLAIN_TEMPLATE)
    m = load_models(LoadOptions(str(target), None, dtype="fp32", device="cpu", ctx=2048))
    m.eos_ids = frozenset()  # replies of exactly max_tokens
    return m


def history(msgs):
    return "\n".join(f"{m['role']}: {m['content']}" for m in msgs if m["role"] != "system")


def task(kind: str, msgs) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"### task: {kind} of the chat history.\n### history:\n{history(msgs)}"},
    ]


async def collect(j: Job) -> list:
    items = []
    while not items or not isinstance(items[-1], (Done, Failed)):
        items.append(await asyncio.wait_for(j.events.get(), 300))
    assert isinstance(items[-1], Done), items[-1]
    return items


def conversation(worker: Worker) -> list[tuple[int, int]]:
    """Per turn from the second: (cached tokens, tokens shared with the last turn's prompt and reply)."""
    session = worker.session
    tok = session.models.tokenizer

    async def go():
        loop, msgs, out, last, pending = (
            asyncio.get_running_loop(),
            [{"role": "system", "content": SYSTEM}],
            [],
            None,
            [],
        )
        for text in TURNS:
            msgs.append({"role": "user", "content": text})
            chat = Job(Work(messages=list(msgs), max_tokens=REPLY, temperature=0.0), loop, "chat")
            chat.interactive = True
            bg = [
                Job(Work(messages=task(k, msgs), max_tokens=BACKGROUND, temperature=0.0), loop, "chat")
                for k in ("a title", "tags")
            ]
            for j in (chat, *bg):
                worker.submit(j)
            pending += [asyncio.create_task(collect(j)) for j in bg]
            items = await collect(chat)
            full = session.conversation_ids(msgs)
            started = next(i for i in items if isinstance(i, Started))
            if last is not None:
                out.append((started.cached_tokens, common_prefix(full, last)))
            reply = items[-1].text
            last = full + list(tok(reply, add_special_tokens=False)["input_ids"])
            msgs.append({"role": "assistant", "content": reply})
            follow = Job(
                Work(messages=task("follow-up questions", msgs), max_tokens=BACKGROUND, temperature=0.0), loop, "chat"
            )
            worker.submit(follow)
            pending.append(asyncio.create_task(collect(follow)))
            await asyncio.sleep(0.05)  # the user reads, the background requests run
        await asyncio.gather(*pending)
        return out

    return asyncio.run(go())


@pytest.mark.parametrize("parallel", [1, 2, 8])
def test_background_requests_keep_the_conversation_cached(models, parallel):
    session = ChatSession(
        models, GenerationConfig(shape=TreeShape(8, 6), method="ar"), prompt_cache=PromptCache(1 << 30)
    )
    worker = Worker(lambda: (session, GREEDY), max_queue=16, metrics=Metrics(), parallel=parallel)
    worker.start()
    while worker.state == "loading":
        time.sleep(0.01)
    try:
        turns = conversation(worker)
        assert len(turns) == len(TURNS) - 1
        for k, (cached, shared) in enumerate(turns, 2):
            assert cached >= 0.99 * shared, (k, cached, shared, turns)
    finally:
        worker.shutdown()
        worker.thread.join(60)
