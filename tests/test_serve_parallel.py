"""`specx serve --parallel N` in-process (no HTTP): requests decoding together through one forest.

Two requests with different prompts and seeds sent at once get the replies each gets alone, in
fewer target passes than one after the other; a request sent while another is mid-reply gets its
first token within two passes; one cancelled mid-reply ends "cancelled" and frees its slot while
the other's reply is unchanged; an out-of-memory while adding a request refuses it (400) and the
other goes on; the queue bound counts N running requests; the memory plan's N (parallel_fit).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from specexec_cli.core.budget import BudgetTuner, TimingModel
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import GenerationConfig, StepEvent
from specexec_cli.errors import SpecxError
from specexec_cli.serve import scheduler as sched_mod
from specexec_cli.serve.jobs import Delta, Done, Failed, Job
from specexec_cli.serve.metrics import Metrics
from specexec_cli.serve.models import APIError, Work
from specexec_cli.serve.scheduler import parallel_fit
from specexec_cli.serve.worker import Worker
from specexec_cli.session.chat import ChatSession
from specexec_cli.session.gendefaults import GREEDY
from specexec_cli.session.loading import LoadOptions, load_models

PROMPTS = ["def f(x):\n  return", "for i in range(10):\n"]


@pytest.fixture(scope="module")
def models(tiny_pair):
    m = load_models(LoadOptions(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32", device="cpu"))
    m.eos_ids = frozenset()  # whole replies
    return m


def start(models, parallel: int, max_queue: int = 4, tuner=None) -> Worker:
    session = ChatSession(models, GenerationConfig(shape=TreeShape(16, 8), max_new_tokens=24), code=True, tuner=tuner)
    w = Worker(lambda: (session, GREEDY), max_queue=max_queue, metrics=Metrics(), parallel=parallel)
    w.start()
    while w.state == "loading":
        time.sleep(0.01)
    assert w.state == "ready"
    return w


@pytest.fixture()
def pair(models):
    w = start(models, 2)
    yield w
    w.shutdown()
    w.thread.join(30)


async def collect(job: Job) -> list:
    items = []
    while not items or not isinstance(items[-1], (Done, Failed)):
        items.append(await asyncio.wait_for(job.events.get(), 120))
    return items


def run_all(worker: Worker, works: list[Work]) -> list[list]:
    """Submit every work at once; each one's events."""

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [Job(w, loop, "completions") for w in works]
        for job in jobs:
            worker.submit(job)
        return await asyncio.gather(*(collect(job) for job in jobs))

    return asyncio.run(go())


WORKS = [
    Work(prompt=PROMPTS[0], seed=3, temperature=0.9, max_tokens=24),
    Work(prompt=PROMPTS[1], seed=4, temperature=0.9, max_tokens=24),
]


def test_concurrent_requests_get_their_replies_alone_in_fewer_passes(models, pair):
    single = start(models, 1)
    try:
        alone = [run_all(single, [w])[0][-1] for w in WORKS]
    finally:
        single.shutdown()
        single.thread.join(30)
    together = [items[-1] for items in run_all(pair, WORKS)]
    assert [d.text for d in together] == [d.text for d in alone]
    assert together[0].text != together[1].text  # different prompts and seeds: a leak would show
    shared = pair.metrics.totals["specx_forest_passes_total"]
    assert shared < sum(d.specx["target_passes"] + 1 for d in alone)  # +1: each one's prefill pass
    assert pair.metrics.totals["forest_requests"] > shared  # some passes served both
    assert "specx_forest_tokens_per_pass" in pair.metrics.render(pair)


def test_budget_auto_splits_by_the_speed_model_and_learns_from_forest_passes(models):
    """--budget auto with --parallel 2: each request's tree comes from the tuner's split for two
    requests (here the budget each has alone, not the even half of it), the tuner takes every
    forest pass into its statistics (and re-tunes from them), and the replies are the ones each gets alone."""
    timing = TimingModel({1: 1.0, 4096: 1.0}, 1e-5, {1: 1e-3, 1023: 1.0})  # a flat pass, drafting 1 ms/node
    tuner = BudgetTuner(timing, TreeShape(15, 8), max_budget=1023)
    split = tuner.split(2)
    assert split.budget == tuner.shape.budget == 127  # a stream-bound pass: each keeps its tree
    worker = start(models, 2, tuner=tuner)
    try:
        together = [items[-1] for items in run_all(worker, WORKS)]
    finally:
        worker.shutdown()
        worker.thread.join(30)
    assert tuner.passes > 0 and split.budget in tuner.by_budget  # its first forest passes ran the split
    single = start(models, 1)
    try:
        assert [d.text for d in together] == [run_all(single, [w])[0][-1].text for w in WORKS]
    finally:
        single.shutdown()
        single.thread.join(30)


def test_request_sent_mid_reply_gets_its_first_token_within_two_passes(pair, monkeypatch):
    forest, waited = pair.scheduler.forest, []  # per request: forest passes from open() to its first token

    class Timed(sched_mod.Ticket):
        def __init__(self, *args):
            super().__init__(*args)
            opened, put = forest.passes, self.out.put

            def first_put(item):  # on the forest thread, right after the pass that gave `item`
                if isinstance(item, StepEvent) and self.out.put is first_put:
                    waited.append(forest.passes - opened)
                    self.out.put = put
                put(item)

            self.out.put = first_put

    monkeypatch.setattr(sched_mod, "Ticket", Timed)

    async def go():
        loop = asyncio.get_running_loop()
        long = Job(Work(prompt=PROMPTS[0], max_tokens=400), loop, "completions")
        pair.submit(long)
        while pair.scheduler.forest.passes < 4:
            await asyncio.sleep(0.01)
        late = Job(Work(prompt=PROMPTS[1], max_tokens=8), loop, "completions")
        pair.submit(late)
        items = await collect(late)
        assert pair.scheduler.forest.lanes, "the long reply is still going"
        long.cancel()
        await collect(long)
        return items

    items = asyncio.run(go())
    assert isinstance(items[-1], Done)
    assert len(waited) == 2 and waited[-1] <= 2


def test_cancelled_request_frees_its_slot_and_the_other_goes_on(models, pair):
    alone = run_all(pair, [WORKS[1]])[0][-1].text

    async def go():
        loop = asyncio.get_running_loop()
        gone = Job(Work(prompt=PROMPTS[0], max_tokens=400, seed=1, temperature=0.9), loop, "completions")
        kept = Job(WORKS[1], loop, "completions")
        pair.submit(gone)
        pair.submit(kept)
        deltas = 0
        while deltas < 2:
            deltas += isinstance(await asyncio.wait_for(gone.events.get(), 60), Delta)
        gone.cancel()
        return await asyncio.gather(collect(gone), collect(kept))

    gone_items, kept_items = asyncio.run(go())
    assert gone_items[-1].finish == "cancelled"
    assert kept_items[-1].text == alone
    deadline = time.monotonic() + 10
    while any(s.ticket is not None for s in pair.scheduler.slots) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(s.ticket is None for s in pair.scheduler.slots)


def test_oom_while_adding_a_request_refuses_it_and_the_other_goes_on(pair, monkeypatch):
    alone = run_all(pair, [WORKS[0]])[0][-1].text
    real = sched_mod.Scheduler._start

    def oom_for_second(self, ticket, i):
        if ticket.full[:3] == pair.session.models.tokenizer(PROMPTS[1])["input_ids"][:3]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(self, ticket, i)

    monkeypatch.setattr(sched_mod.Scheduler, "_start", oom_for_second)
    ok, refused = run_all(pair, WORKS)
    assert isinstance(refused[-1], Failed) and refused[-1].error.status == 400
    assert ok[-1].text == alone


def test_queue_bound_counts_the_running_requests(models):
    w = start(models, 2, max_queue=0)
    try:
        with w.lock:
            w.pending += 2  # two running, none may wait
        loop = asyncio.new_event_loop()
        with pytest.raises(APIError) as err:
            w.submit(Job(Work(prompt="x"), loop, "completions"))
        assert err.value.status == 429
        with w.lock:
            w.pending -= 1  # one running: the second may start
        w.submit(Job(Work(prompt="x", max_tokens=2), loop, "completions"))
        loop.close()
    finally:
        w.shutdown()
        w.thread.join(30)


def plan_with(room: int, kv: int, row: int = 0, budget: int = 63) -> SimpleNamespace:
    return SimpleNamespace(
        device_bytes={"kv_target": kv, "kv_draft": kv // 4, "rest": 100},
        device_capacity=100 + kv + kv // 4 + room,
        ctx=4096,
        device_total=100 + kv + kv // 4,
        budget=budget,
        sized_budget=budget,
        row_bytes=row,
    )


def test_parallel_fit_counts_each_sequence_kv():
    plan = plan_with(room=3 * 1250, kv=1000)  # room for 3 more sequences: the default takes all 4
    assert parallel_fit(plan, None, "specexec")[0] == 4 and plan.device_bytes["kv_parallel"] == 3 * 1250
    assert parallel_fit(plan_with(room=10**9, kv=1000), None, "specexec")[0] == sched_mod.DEFAULT_PARALLEL == 8
    assert parallel_fit(plan_with(3 * 1250, 1000), 4, "specexec")[0] == 4
    with pytest.raises(
        SpecxError,
        match=r"--parallel 5: the memory plan has room for the KV caches and forest "
        r"passes of 4 sequences",
    ):
        parallel_fit(plan_with(3 * 1250, 1000), 5, "specexec")
    lowered, note = parallel_fit(plan_with(100, 1000), None, "specexec")
    assert lowered == 1 and "room for one sequence's KV caches only" in note
    assert parallel_fit(plan_with(10**9, 1000), None, "chain")[0] == 1
    with pytest.raises(SpecxError, match="needs --method specexec or ar"):
        parallel_fit(plan_with(10**9, 1000), 2, "chain")


def test_parallel_fit_counts_every_trees_rows_in_a_forest_pass():
    """N > 1: a forest pass holds the trees' hidden states, mask and logits rows (sized budget + N - 1
    tokens x row_bytes) beside its largest single pass; a room that holds the second KV cache but
    not those rows keeps one sequence."""
    plan = plan_with(room=1250 + 64 * 10, kv=1000, row=10)  # budget 63: (63 + 1) x 10 bytes for two
    assert parallel_fit(plan, None, "specexec")[0] == 2 and plan.device_bytes["forest_activations"] == 640
    assert parallel_fit(plan_with(room=1250 + 639, kv=1000, row=10), None, "specexec")[0] == 1
    with pytest.raises(SpecxError, match="room for the KV caches and forest passes of 1 sequence at"):
        parallel_fit(plan_with(room=1250 + 639, kv=1000, row=10), 2, "specexec")


def test_plan_row_bytes_are_a_tokens_hidden_mask_and_logits_rows(tiny_pair):
    from offload.arch.attention import padded
    from offload.planning.memplan import PlanRequest, plan_memory
    from tests.sparse_ckpt import read_checkpoint

    target = read_checkpoint(tiny_pair[0])
    plan = plan_memory(
        target,
        read_checkpoint(tiny_pair[1]),
        PlanRequest(device="cpu", dtype="fp32", draft_dtype="fp32", ram_free=8 << 30, ctx=300),
    )
    cfg = target.config
    assert plan.row_bytes == (cfg["hidden_size"] + padded(300) + cfg["vocab_size"]) * 4


def test_serve_parallel_that_does_not_fit_is_one_line_exit_2():
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    res = CliRunner().invoke(app, ["serve", "--dry-run", "--parallel", "100000000"])
    assert res.exit_code == 2, res.output
    assert "--parallel 100000000: the memory plan has room for the KV caches and forest passes of" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(app, ["serve", "--dry-run", "--parallel", "0"])
    assert res.exit_code == 2 and "--parallel must be >= 1" in res.output


def test_an_error_of_the_whole_pass_fails_its_requests_and_the_next_one_runs(pair, monkeypatch):
    from specexec_cli.core.forest import Forest

    real, calls = Forest.step, []

    def broken_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the pass")
        return real(self)

    monkeypatch.setattr(Forest, "step", broken_once)
    failed = run_all(pair, [WORKS[0]])[0]
    assert isinstance(failed[-1], Failed) and failed[-1].error.status == 500
    ok = run_all(pair, [WORKS[1]])[0]
    assert isinstance(ok[-1], Done) and ok[-1].usage["completion_tokens"] == 24
