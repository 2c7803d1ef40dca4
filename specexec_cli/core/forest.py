"""The forest step: every open request's draft tree verified in ONE target pass (one weight stream).

Contract: a `Lane` is one request: an `engine.Request` (its own `DecodeState`: committed ids, its
own target and draft caches; settings, RNG and progress), the very step machine `engine.generate`
runs alone; `Forest(models)` holds the open lanes and `step()` makes one target pass for all of them
and returns `(lane, StepEvent | None | exception)` per lane:
1. each lane prepares its share of the pass (`Request.begin`): a prefill chunk of its prompt (the
   last chunk's logits give its first token), or the job of `engine.speculative_pass` with the tree
   shape the forest gives it: `shape_for(k)` for k decoding lanes where the forest has one (serve's
   --budget auto: the speed model's split, `core.budget.BudgetTuner.split`), else its own budget
   split evenly over the k (an explicit --budget is the size of the whole pass); `engine.ar_pass`
   (one token) under --method ar and with no draft model (`core.methods.generate` runs ar then),
   and where no tree fits;
2. `offload.stream.multi.forward_many` runs all shares in one pass: each decoder layer's weights
   are streamed once and every lane's tokens go through them against that lane's own cache;
3. each lane accepts and commits its own path (`Request.end`) and yields the `StepEvent` that
   `engine.generate` would yield (a prefill chunk that is not the last yields None); its target
   seconds are the shared pass's, its draft seconds its own work before and after it.
Each lane's tokens, positions, masks and caches are exactly those it has alone, so its replies are
the ones `engine.generate` gives it alone: the same ids at T = 0, and at T > 0 with a seed too (the
coupled draws are a pure function of (seed, position, token), never of the tree). Nothing is
shared between lanes but the weights. A lane whose preparation raises fails alone; a pass that
raises drops every lane's uncommitted rows, fails the lanes that were in their first pass when
the error is an out-of-memory (a request that did not fit), else every lane of that pass, and the
others go on at the next pass. Lanes join and leave between passes (`add`, `remove`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from offload import forward_many
from specexec_cli.core import kvcache
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import (
    DecodeState,
    GenerationConfig,
    Models,
    Request,
    StepEvent,
    add_prompt,
    ar_step,
    speculative_step,
)
from specexec_cli.errors import is_oom

FOREST_METHODS = ("specexec", "ar")  # methods whose step a forest runs (the others: one request at a time)


class Lane(Request):
    """One request in the forest (module docstring); `shape`: its tree shape in its last pass."""

    def __init__(self, m: Models, st: DecodeState, new_ids: list[int], cfg: GenerationConfig, gen=None):
        # trees need a draft and a tree method: --method ar, or no draft at all (every layer resident,
        # `--draft self` with nothing to substitute), decodes one token a pass as core.methods.generate does
        trees = m.draft is not None and cfg.method != "ar"
        super().__init__(m, st, new_ids, cfg, gen, speculative_step if trees else ar_step)
        self.shape = cfg.shape

    @property
    def decoding(self) -> bool:
        return not self.prefilling

    def pause(self) -> list[int]:
        """Leave the forest at a pass boundary without ending (serve's scheduler lends the slot to a
        streamed request); returns the committed ids `resume` continues from. The grammar state and
        the coupled draws stay with the lane, so the reply is the one it gets unpaused."""
        self.grammar, self.noise = self.st.grammar, self.st.noise
        return list(self.st.ids)

    def resume(self, st: DecodeState, new_ids: list[int]) -> None:
        """Continue on `st` (the same slot or another) whose committed ids plus `new_ids` are the ids
        `pause` returned: those rows are prefilled in the next pass(es), whose last logits give the
        next token as a plain step would (the same position and draws: the same token)."""
        st.grammar, st.noise = self.grammar, self.noise
        if st.grammar is not None:
            st.grammar.state = st  # the ids it follows (the same ones, maybe in another state)
        add_prompt(self.m, st, new_ids)
        self.st, self.steps, self.job, self.prefilling = st, None, None, True

    def settle(self, leaving: bool = False) -> None:
        """Drop cache rows past the committed lengths (a pass that did not finish); `leaving`: the
        request is over (its grammar state goes, as at the end of generate())."""
        self.steps = self.job = None
        if leaving:
            self.st.grammar = None
        kvcache.crop(self.st.target_cache, self.st.target_len)
        kvcache.crop(self.st.draft_cache, self.st.draft_len)


def split_budget(budget: int, trees: int) -> int:
    """Each decoding lane's tree budget: the budget split evenly (the pass verifies about `budget`
    tree tokens whatever the number of requests); at least 1."""
    return max(1, budget // max(1, trees))


class Forest:
    """The open lanes and the pass counter (module docstring)."""

    def __init__(self, m: Models, budget: int | None = None, shape_for: Callable[[int], TreeShape] | None = None):
        self.m = m
        self.budget = budget  # total tree budget per pass; None = each lane's own cfg budget, split
        self.shape_for = shape_for  # k decoding lanes -> each one's tree shape (replaces the even split)
        self.last_tokens = 0  # tokens the last pass verified, every lane's share together
        self.lanes: list[Lane] = []
        self.passes = 0  # target passes made (each streams the weights once)
        self.pass_tokens = 0  # tokens emitted over all passes (aggregate tokens per pass = this / passes)

    def add(self, lane: Lane) -> None:
        self.lanes.append(lane)

    def remove(self, lane: Lane) -> None:
        """Take a lane out at a pass boundary (done, cancelled, disconnected); its committed rows stay valid."""
        if lane in self.lanes:
            lane.settle(leaving=True)
            self.lanes.remove(lane)

    def step(self) -> list[tuple[Lane, StepEvent | BaseException | None]]:
        """One target pass over every open lane (module docstring). A lane is removed once it has
        finished or failed; the caller removes the ones it stops."""
        out: list[tuple[Lane, StepEvent | BaseException | None]] = []
        trees = sum(lane.decoding for lane in self.lanes)
        jobs, ran = [], []
        common = self.shape_for(trees) if self.shape_for is not None and trees else None
        for lane in list(self.lanes):
            own = lane.cfg.shape
            lane.shape = common or replace(own, budget=split_budget(self.budget or own.budget, trees))
            try:
                jobs.append(lane.begin(lane.shape))
                ran.append(lane)
            except Exception as exc:  # noqa: BLE001 - this lane fails alone (its rows dropped)
                out.append(self._fail(lane, exc))
        if not jobs:
            return out
        t0 = time.perf_counter()
        try:
            logits = forward_many(self.m.target, jobs)
        except Exception as exc:  # noqa: BLE001 - every lane's partial rows dropped; see the docstring
            for lane in ran:
                lane.settle()
            new = [lane for lane in ran if lane.passes == 0]
            blamed = new if (is_oom(exc) and new) else ran
            return out + [self._fail(lane, exc) for lane in blamed]
        seconds = time.perf_counter() - t0
        self.passes += 1
        self.last_tokens = sum(len(job.ids) for job in jobs)
        for lane, lg in zip(ran, logits):
            try:
                ev = lane.end(lg, seconds)
            except Exception as exc:  # noqa: BLE001
                out.append(self._fail(lane, exc))
                continue
            if ev is not None:
                self.pass_tokens += len(ev.tokens)
            if ev is not None and ev.finish:
                self.remove(lane)
            out.append((lane, ev))
        return out

    def _fail(self, lane: Lane, exc: BaseException) -> tuple[Lane, BaseException]:
        lane.settle(leaving=True)
        if lane in self.lanes:
            self.lanes.remove(lane)
        return lane, exc


def drive(m: Models, lanes: list[Lane], forest: Forest | None = None):
    """Drive `lanes` to their ends in one forest; yields (lane, event) as they come (tests, bench)."""
    forest = forest or Forest(m)
    for lane in lanes:
        forest.add(lane)
    while forest.lanes:
        for lane, ev in forest.step():
            if isinstance(ev, BaseException):
                raise ev
            if ev is not None:
                yield lane, ev
