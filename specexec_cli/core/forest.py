"""The forest step: every open request's draft tree verified in ONE target pass (one weight stream).

Contract: a `Lane` is one request, the `engine.Request` that `engine.generate` runs alone (its own
`DecodeState` and caches). `Forest(models).step()` makes one target pass for every open lane and
returns `(lane, StepEvent | None | exception)` per lane: each lane prepares its share
(`Request.begin`: a prefill chunk, or the job of `engine.speculative_pass` with the shape
`shape_for(k)` gives k decoding lanes, else its budget split evenly; `engine.ar_pass` without a draft
or under --method ar); `offload.forward_many` runs all shares in one pass (each layer's weights
streamed once); each lane commits its own path (`Request.end`). A lane's inputs and caches are those
it has alone, so its replies are the same ids, at T > 0 with a seed too. A lane whose preparation
raises fails alone; a pass that raises drops every lane's uncommitted rows and fails the lanes in
their first pass on an out-of-memory, else every lane of that pass. Lanes join and leave between
passes (`add`, `remove`).
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
        # without a draft (or under --method ar) one token a pass, as core.methods.generate decodes
        trees = m.draft is not None and cfg.method != "ar"
        super().__init__(m, st, new_ids, cfg, gen, speculative_step if trees else ar_step)
        self.shape = cfg.shape

    def pause(self) -> list[int]:
        """Leave the forest at a pass boundary without ending -> the committed ids `resume` continues
        from (the grammar state and coupled draws stay with the lane: the same reply)."""
        self.grammar, self.noise = self.st.grammar, self.st.noise
        return list(self.st.ids)

    def resume(self, st: DecodeState, new_ids: list[int]) -> None:
        """Continue on `st` whose ids plus `new_ids` are what `pause` returned: those rows are prefilled
        next, and the last logits give the token a plain step would."""
        st.grammar, st.noise = self.grammar, self.noise
        if st.grammar is not None:
            st.grammar.state = st  # the ids it follows (the same ones, maybe in another state)
        add_prompt(self.m, st, new_ids)
        self.st, self.steps, self.job, self.prefilling = st, None, None, True

    def settle(self, leaving: bool = False) -> None:
        """Drop cache rows past the committed lengths; `leaving`: the request is over (grammar state goes)."""
        self.steps = self.job = None
        if leaving:
            self.st.grammar = None
        kvcache.crop(self.st.target_cache, self.st.target_len)
        kvcache.crop(self.st.draft_cache, self.st.draft_len)


def split_budget(budget: int, trees: int) -> int:
    """Each decoding lane's tree budget: `budget` split evenly over `trees`, at least 1."""
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

    def add(self, lane: Lane) -> None:
        self.lanes.append(lane)

    def remove(self, lane: Lane) -> None:
        """Take a lane out at a pass boundary (done, cancelled, disconnected); its committed rows stay valid."""
        if lane in self.lanes:
            lane.settle(leaving=True)
            self.lanes.remove(lane)

    def step(self) -> list[tuple[Lane, StepEvent | BaseException | None]]:
        """One target pass over every open lane; finished and failed lanes are removed."""
        out: list[tuple[Lane, StepEvent | BaseException | None]] = []
        trees = sum(not lane.prefilling for lane in self.lanes)
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
            if ev is not None and ev.finish:
                self.remove(lane)
            out.append((lane, ev))
        return out

    def _fail(self, lane: Lane, exc: BaseException) -> tuple[Lane, BaseException]:
        self.remove(lane)
        return lane, exc
