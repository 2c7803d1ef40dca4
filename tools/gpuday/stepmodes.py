"""The `step` phase's two ways of running a speculative step, each timed into draft, stream, verify, accept.

Contract (each mode runs 1 + `repeats` steps from the state it is given, the first a warm-up, and
returns the timed steps' means, their stream and verify per step, and every step's row):
- `without_overlap`: the engine's own step, engine.speculative_pass, driven as engine.run_alone drives
  it (grow_tree, subtree, verify_inputs, the target's pass, accept_tree, commit_tree), timed between
  its phases; the tree is grown by engine.default_grow inside a timing wrapper (plain SpecExec scores).
- `with_overlap`: this phase's arrangement of the same functions, since specexec_cli has no overlapped
  step yet (issue 54.3): a worker thread launches target pass k on its current (default) stream while
  this thread commits pass k's replayed path in the draft's cache and grows tree k + 1 on a CUDA
  stream of its own; the link's copies run on the prefetcher's copy stream. Then pass k is accepted and
  the target's cache compacted (engine.commit_tree's two halves, the draft's on the draft's stream).
  Tree k + 1 starts from the replayed path and bonus: known before pass k ends only because the
  acceptance is replayed (a real engine would grow from a predicted root; the work is the same).
- Splits: draft = host wall of the tree's growth (synchronised by its own downloads); stream = the
  target's link clock (OffloadedCausalLM.link_busy_seconds: copy-stream time between CUDA events) over
  the timed steps / steps (`Window`); verify = the target's decoder layers and head, each timed from
  its start to its end by CUDA events (the host clock on a CPU) in forward hooks (`LayerClock`),
  summed; accept = accept_tree and the caches' compaction, host wall once the pass is done (without:
  after the pass's logits are synchronised); step = the steps' wall. Rows also carry the draft
  forwards per tree (a forward pre-hook's `counter`) and the tokens each step emitted.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import torch

LIMIT = 1 << 20  # tokens a step may emit: never the bound here


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class LayerClock:
    """Seconds `model`'s decoder layers and head spend from each one's start to its end: CUDA events on
    the stream they run on (read after a synchronize), the host clock on a CPU."""

    def __init__(self, model, device: torch.device):
        self.cuda, self.spans, self.open, self.handles = device.type == "cuda", [], None, []
        for mod in [*model.layers, model.lm_head]:
            self.handles += [mod.register_forward_pre_hook(self._start), mod.register_forward_hook(self._end)]

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _start(self, *_):
        self.open = self._mark()

    def _end(self, *_):
        self.spans.append((self.open, self._mark()))

    def take(self) -> float:
        """The spans' seconds since the last take (after a synchronize on CUDA)."""
        spans, self.spans = self.spans, []
        return sum(a.elapsed_time(b) / 1e3 if self.cuda else b - a for a, b in spans)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class Window:
    """The timed steps' stream and verify seconds: the link clock and the layer clock between two
    synchronizes (the next pass's first layers, prefetched at each end, cancel out)."""

    def __init__(self, target, clock: LayerClock, device: torch.device):
        self.target, self.clock, self.device = target, clock, device
        sync(device)
        clock.take()
        self.link0 = target.link_busy_seconds()

    def close(self, steps: int) -> dict:
        sync(self.device)
        link = self.target.link_busy_seconds() - self.link0
        return dict(stream=link / steps, verify=self.clock.take() / steps)


def finish(steps, logits):
    """Send a Pass its logits; its StepResult."""
    try:
        steps.send(logits)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the step asked for a second target pass")


def mean_of(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def without_overlap(models, st, cfg, rep, clock, repeats: int, counter: list) -> dict:
    """The engine's step as it is (engine.speculative_pass), timed between its phases."""
    from specexec_cli.core import engine

    dev, gen, last = models.target.device, torch.Generator().manual_seed(0), {}

    def grow(m, s, dctx, shape, params, scoring=None):
        t, n0 = time.perf_counter(), counter[0]
        tree = engine.default_grow(m, s, dctx, shape, params)
        rep.tree, last["draft"], last["forwards"] = tree, time.perf_counter() - t, counter[0] - n0
        return tree

    rows, window = [], None
    for i in range(repeats + 1):  # step 0 warms up
        window = Window(models.target, clock, dev) if i == 1 else window
        t0 = time.perf_counter()
        steps = engine.speculative_pass(models, st, cfg, gen, LIMIT, grow=grow)
        job = next(steps)  # the draft grows its tree; the pass's inputs are staged
        t1 = time.perf_counter()
        logits = engine.forward_job(models.target, job)
        sync(dev)
        t2 = time.perf_counter()
        res = finish(steps, logits)  # accept_tree (replayed), commit_tree
        t3 = time.perf_counter()
        rows.append(
            dict(draft=last["draft"], stage=t1 - t0 - last["draft"], pass_s=t2 - t1, accept=t3 - t2, step=t3 - t0)
            | dict(forwards=last["forwards"], tokens=len(res.tokens))
        )
    return dict(mean_of(rows[1:]), **window.close(repeats), steps=rows)


def commit_draft(st, tree, vt, dctx, path: list[int]) -> None:
    """engine.commit_tree's draft half for a pass that ends with a bonus: keep the path's nodes the
    draft ran (root + path in cache rows after the prefix)."""
    from specexec_cli.core import kvcache

    base = dctx.n_cached + len(dctx.pending) - 1  # draft cache row of the root
    nodes = vt.draft_ids[torch.tensor(path, dtype=torch.long)]
    run = tree.slot[nodes][tree.slot[nodes] >= 0]
    kvcache.compact(st.draft_cache, base + 1, base + run)
    st.draft_len = base + 1 + int(run.numel())


def commit_target(st, acc) -> None:
    """engine.commit_tree's target half: root + accepted path kept, the emitted tokens committed."""
    from specexec_cli.core import kvcache

    keep = torch.tensor([0] + (acc.path if acc.bonus else acc.path[:-1]), dtype=torch.long)
    kvcache.compact(st.target_cache, st.target_len, st.target_len + keep)
    st.target_len += int(keep.numel())
    st.ids.extend(acc.tokens)


def with_overlap(models, st, cfg, rep, clock, repeats: int, counter: list) -> dict:
    """Pass k streams and computes (a worker thread launched it) while tree k + 1 grows on its own stream."""
    from specexec_cli.core import kvcache, verify
    from specexec_cli.core.draft import DraftContext, grow_tree
    from specexec_cli.core.engine import draft_context
    from specexec_cli.core.tree import subtree, top_budget

    dev, shape, params = models.target.device, cfg.shape, cfg.sampling
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    on_side = (lambda: torch.cuda.stream(side)) if side is not None else contextlib.nullcontext
    dctx = draft_context(st)
    tree = grow_tree(models.draft, st.draft_cache, dctx, shape, params)
    sync(dev)  # the draft's cache, written on this stream, is read on `side` from here on

    def launch(vt, n):
        t = time.perf_counter()
        ids, positions, mask = verify.verify_inputs(models.target, vt, st.target_len, n - 1)
        logits = kvcache.forward(models.target, st.target_cache, ids, positions, mask)
        return logits, positions, time.perf_counter() - t

    rows, window = [], None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuday-target") as pool:
        for i in range(repeats + 1):
            window = Window(models.target, clock, dev) if i == 1 else window
            t0 = time.perf_counter()
            vt, n = subtree(tree, top_budget(tree.logp, shape.budget)), len(st.ids)
            plan = rep.plan(tree, vt)
            flight = pool.submit(launch, vt, n)  # pass k: stream + verify, launched on the worker's stream
            t1, n0 = time.perf_counter(), counter[0]
            with on_side():  # tree k + 1, from pass k's replayed path and bonus
                commit_draft(st, tree, vt, dctx, plan.path)
                upcoming = st.ids + plan.tokens()
                dctx = DraftContext(st.draft_len, upcoming[st.draft_len :], len(upcoming) - 1)
                nxt = grow_tree(models.draft, st.draft_cache, dctx, shape, params)
            t2, forwards = time.perf_counter(), counter[0] - n0
            logits, positions, launched = flight.result()
            if side is not None:
                torch.cuda.current_stream(dev).synchronize()  # pass k done (its copies and compute)
            t3 = time.perf_counter()
            acc = verify.accept_tree(vt, logits, params, None, n, models.eos_ids, LIMIT, depth=positions - (n - 1))
            commit_target(st, acc)
            t4 = time.perf_counter()
            if acc.tokens != plan.tokens():
                raise RuntimeError("the replayed acceptance was not what the target's walk emitted")
            tree = nxt
            rows.append(
                dict(draft=t2 - t1, launch=launched, wait=t3 - t2, accept=t4 - t3, step=t4 - t0)
                | dict(forwards=forwards, tokens=len(acc.tokens))
            )
    return dict(mean_of(rows[1:]), **window.close(repeats), steps=rows)
