"""The forest step: every open request's draft tree verified in ONE target pass (one weight stream).

Contract: a `Lane` is one request: its own `DecodeState` (committed ids, its own target and draft
caches), settings, RNG and progress; `Forest(models)` holds the open lanes and `step()` makes one
target pass for all of them and returns `(lane, StepEvent | None | exception)` per lane:
1. each lane prepares its share of the pass (`Lane.begin`): a prefill chunk of its prompt (the
   last chunk's logits give its first token), or a draft tree grown as `engine.speculative_step`
   grows it (`engine.grow_step`) with the tree shape the forest gives it: `shape_for(k)` for k
   decoding lanes where the forest has one (serve's --budget auto: the speed model's split,
   `core.budget.BudgetTuner.split`), else its own budget split evenly over the k (an explicit
   --budget is the size of the whole pass); a plain one-token step (`engine.ar_step`'s) where no
   tree fits, under --method ar, and with no draft model (`core.methods.generate` runs ar then);
2. `offload.stream.multi.forward_many` runs all shares in one pass: each decoder layer's weights
   are streamed once and every lane's tokens go through them against that lane's own cache;
3. each lane accepts and commits its own path (`engine.accept_step`) and yields the `StepEvent`
   that `engine.generate` would yield (a prefill chunk that is not the last yields None).
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
from dataclasses import dataclass, replace
from typing import Callable

import torch

from offload.stream.multi import ForwardJob, forward_many
from specexec_cli.core import kvcache, transfers
from specexec_cli.core.engine import (DecodeState, GenerationConfig, Models, StepEvent, StepResult, TextStream,
                                      accept_step, check_fits, draw, finish_reason, grow_step, logprobs_of,
                                      new_noise, prefill_passes, reserve_caches, run_prompt, start_constraints)
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.tree import causal_mask
from specexec_cli.core.verify import verify_inputs
from specexec_cli.errors import is_oom

FOREST_METHODS = ("specexec", "ar")   # methods whose step a forest runs (the others: one request at a time)


@dataclass
class _Share:
    """What a lane computes in the pass in flight."""

    kind: str  # "prefill" | "tree" | "ar"
    end: int = 0  # prefill: ids[:end] are in the target cache after this chunk
    tree: object = None  # tree: engine.TreeStep
    positions: torch.Tensor | None = None  # tree: (n,) node positions on the target's device


class Lane:
    """One request in the forest (module docstring); `events` of `engine.generate`, one per pass."""

    def __init__(self, m: Models, st: DecodeState, new_ids: list[int], cfg: GenerationConfig,
                 gen: torch.Generator | None = None):
        check_fits(m, st, new_ids)
        self.m, self.st, self.cfg = m, st, cfg
        st.grammar = start_constraints(m, st, cfg, len(st.ids) + len(new_ids))   # per request, as generate()
        self.gen = gen if gen is not None else torch.Generator().manual_seed(cfg.seed)
        st.noise = new_noise(self.gen)   # this request's coupled draws, as generate() draws them
        reserve_caches(m, st)
        self.n_prompt = len(st.ids) + len(new_ids) - st.target_len
        st.ids.extend(new_ids)
        st.prefill_streams = prefill_passes(len(st.ids) - st.target_len, m.pass_tokens)
        self.stream = TextStream(m.tokenizer)
        self.prefilling, self.produced, self.pass_index = True, 0, 0
        self.finish: str | None = None   # set with the last event
        self.passes = 0                  # forest passes this lane took part in (prefill chunks included)
        self.t0, self.t_prefill = time.perf_counter(), 0.0
        self.share: _Share | None = None
        self.shape = cfg.shape   # the tree shape of its last pass (the forest's split)
        self.moved = transfers.TransferCount()
        # trees need a draft and a tree method: --method ar, or no draft at all (every layer resident,
        # `--draft self` with nothing to substitute), decodes one token a pass as core.methods.generate does
        self.trees = m.draft is not None and cfg.method != "ar"

    @property
    def decoding(self) -> bool:
        return not self.prefilling

    def begin(self, shape: TreeShape) -> ForwardJob:
        """This lane's share of the next pass; `shape`: its tree shape in this pass."""
        before = transfers.snapshot()
        m, st = self.m, self.st
        if self.prefilling:
            a = st.target_len
            b = len(st.ids) if m.pass_tokens <= 0 else min(len(st.ids), a + m.pass_tokens)
            ids, pos = kvcache.stage(m.target, torch.tensor(st.ids[a:b], dtype=torch.long), torch.arange(a, b))
            self.share = _Share("prefill", end=b)
            job = ForwardJob(ids, pos, None, st.target_cache, last_only=True)
        else:
            cfg = replace(self.cfg, shape=shape)
            limit = min(self.cfg.max_new_tokens - self.produced, m.ctx_limit - len(st.ids))
            ts = grow_step(m, st, cfg, self.gen, limit) if self.trees else None
            if ts is None:   # plain decoding, or no room for a tree: the root alone (engine.ar_step)
                ids, pos = kvcache.stage(m.target, torch.tensor(st.ids[-1:]), torch.tensor([len(st.ids) - 1]))
                mask = causal_mask(st.target_len, 1, kvcache.model_dtype(m.target), m.target.device)
                self.share = _Share("ar")
            else:
                ids, pos, mask, *bits = verify_inputs(m.target, ts.vt, st.target_len, len(st.ids) - 1,
                                                      *([ts.bits] if ts.bits is not None else []))
                ts.bits = bits[0] if bits else None   # the nodes' grammar masks ride in the same upload
                self.share = _Share("tree", tree=ts, positions=pos)
            job = ForwardJob(ids, pos, mask, st.target_cache)
        self.moved = transfers.since(before)
        return job

    def end(self, logits: torch.Tensor, seconds: float) -> StepEvent | None:
        """Accept and commit this lane's share of the pass (`seconds`: the pass's wall time)."""
        before = transfers.snapshot()
        m, st, share, cfg = self.m, self.st, self.share, self.cfg
        self.share, self.passes = None, self.passes + 1
        t0 = time.perf_counter()
        if share.kind == "prefill":
            st.target_len = share.end
            if share.end < len(st.ids):
                return None   # more chunks to go
            if m.draft is not None and cfg.method != "ar" and not m.shared_kv:
                run_prompt(m.draft, st.draft_cache, st.ids, st.draft_len, m.pass_tokens)
                st.draft_len = len(st.ids)
            tok = draw(st, logits[-1], cfg.sampling, self.gen)
            st.ids.append(tok)
            resumed, self.prefilling = self.produced > 0, False   # resumed: this pass is a decoding step
            if not resumed:
                self.t_prefill = time.perf_counter() - self.t0
            res = StepResult([tok], 0, target_seconds=seconds if resumed else 0.0,
                             logprobs=logprobs_of(cfg, logits[-1:], [0], [tok]))
        elif share.kind == "ar":
            tok = draw(st, logits[-1], cfg.sampling, self.gen)
            st.target_len += 1
            st.ids.append(tok)
            res = StepResult([tok], 0, target_seconds=seconds, logprobs=logprobs_of(cfg, logits[-1:], [0], [tok]))
        else:
            res = accept_step(m, st, cfg, share.tree, logits, share.positions)
            res.draft_seconds = share.tree.t1 - share.tree.t0 + time.perf_counter() - t0
            res.target_seconds = seconds
        if share.kind != "prefill" or self.produced > 0:
            st.noise.forget(len(st.ids))
            self.pass_index += 1
        moved = transfers.since(before)
        return self._event(res, transfers.TransferCount(self.moved.calls + moved.calls, self.moved.bytes + moved.bytes))

    def _event(self, res: StepResult, moved: transfers.TransferCount) -> StepEvent:
        self.produced += len(res.tokens)
        self.finish = finish_reason(self.m, self.st, res.tokens, self.produced, self.cfg)
        return StepEvent(
            text=self.stream.feed_split(res.tokens, res.accepted), tokens=res.tokens, accepted=res.accepted,
            pass_index=self.pass_index, tree_size=res.tree_size, tree_depth=res.tree_depth,
            draft_seconds=res.draft_seconds, target_seconds=res.target_seconds,
            prefill_seconds=self.t_prefill, decode_seconds=time.perf_counter() - self.t0 - self.t_prefill,
            new_tokens=self.produced, prompt_tokens=self.n_prompt, finish=self.finish,
            host_transfers=moved.calls, host_transfer_bytes=moved.bytes,
            prefill_streams=self.st.prefill_streams if self.pass_index == 0 else 0, logprobs=res.logprobs,
        )  # fmt: skip

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
        reserve_caches(self.m, st)
        st.grammar, st.noise = self.grammar, self.noise
        if st.grammar is not None:
            st.grammar.state = st   # the ids it follows (the same ones, maybe in another state)
        st.ids.extend(new_ids)
        st.prefill_streams = prefill_passes(len(st.ids) - st.target_len, self.m.pass_tokens)
        self.st, self.share, self.prefilling = st, None, True

    def settle(self, leaving: bool = False) -> None:
        """Drop cache rows past the committed lengths (a pass that did not finish); `leaving`: the
        request is over (its grammar state goes, as at the end of generate())."""
        self.share = None
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
        self.budget = budget   # total tree budget per pass; None = each lane's own cfg budget, split
        self.shape_for = shape_for   # k decoding lanes -> each one's tree shape (replaces the even split)
        self.last_tokens = 0   # tokens the last pass verified, every lane's share together
        self.lanes: list[Lane] = []
        self.passes = 0        # target passes made (each streams the weights once)
        self.pass_tokens = 0   # tokens emitted over all passes (aggregate tokens per pass = this / passes)

    def add(self, lane: Lane) -> None:
        self.lanes.append(lane)

    def remove(self, lane: Lane) -> None:
        """Take a lane out at a pass boundary (done, cancelled, disconnected); its committed rows stay valid."""
        if lane in self.lanes:
            lane.settle(leaving=True)
            self.lanes.remove(lane)

    def step(self) -> list[tuple[Lane, StepEvent | None | BaseException]]:
        """One target pass over every open lane (module docstring). A lane is removed once it has
        finished or failed; the caller removes the ones it stops."""
        out: list[tuple[Lane, StepEvent | None | BaseException]] = []
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
