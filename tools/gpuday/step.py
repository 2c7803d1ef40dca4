"""The `step` phase: one speculative step of an 80-layer 70B-shaped nf4 target streamed from pinned RAM
with a 1B-shaped draft, its time split into draft, stream, verify and accept, without and with overlap.

Contract (`step(ctx)` returns the phase's JSON; ctx holds device, out, smoke, card):
- Target: stack.write_nf4_stack's LAYERS copies of one Llama-3-70B-shaped nf4 layer (fewer when 80% of
  the free disk or 60% of the available RAM hold fewer: the JSON says how many), loaded with every
  decoder layer in the RAM tier (pinned) and max_device_memory=0, so each pass streams them all. The
  passes phases' checkpoints are removed first to make room (a rerun of one writes them again), the
  stack itself when the phase ends. Smoke (CPU): SMOKE_LAYERS tiny layers in the disk tier: on a CPU a
  RAM-tier layer moves nothing, and the disk tier's read thread is what the link clock then times.
- Draft: the `draft` phase's 1B-shaped bf16 draft, resident. Random weights give near-uniform logits,
  so wide trees two levels deep; a trained draft is confident and grows deep ones. Per budget its final
  norm is scaled by the first of SCALES whose tree takes at least the trace's mean draft forwards per
  pass and reaches its mean depth (else the sharpest): the factor changes no kernel's work, only the
  tree's shape, and a replayed path needs a tree that deep.
- Both caches hold a PAST-token prefix; each mode starts from it. Budgets BUDGETS, the trace's tree
  limits, plain SpecExec scores (cumulative draft log-probs). Acceptance: replay.Replay over the
  trace's accepted counts at the budget (trace.py), the same sequence in both modes.
- Modes (stepmodes.py): "without", the engine's own step (engine.speculative_pass); "with", this
  phase's arrangement of the same functions with the next tree grown on a CUDA stream of its own while
  the target's pass streams and computes (specexec_cli has no overlapped step yet, issue 54.3).
- Each mode's splits (draft, stream, verify, accept, step; stepmodes.py says how each is timed) are the
  mean of REPEATS steps after one warm-up, beside predict.step's modelled figures (the planner's own
  model, fed the probe's rates, the stack's bytes and the trace's tokens per pass).
"""

from __future__ import annotations

import shutil

import psutil
import torch

from tools.gpuday import predict, replay, stack, stepmodes, trace

BUDGETS = (256, 1024)
LAYERS, SMOKE_LAYERS = 80, 4
PAST, SMOKE_PAST = 1024, 32
REPEATS, SMOKE_REPEATS = 4, 2
SCALES = (1.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0)
ROOT_TOKEN = 7


def free_scratch(ctx: dict) -> list[str]:
    """Remove the passes phases' checkpoints (the 16-bit stack, its nf4 cache, the Q4_K file)."""
    from offload.cachedir import cache_root

    work = ctx["out"] / "stack"
    gone = [p for p in (work / "bf16", work / "q4k.gguf", work / "q4k.done") if p.exists()]
    gone += list(cache_root().glob("bf16-nf4-*"))
    for p in gone:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return [p.name for p in gone]


def fit_layers(shape: dict, want: int, where) -> int:
    one = stack.nf4_layer_bytes(shape)
    where.mkdir(parents=True, exist_ok=True)
    free, ram = shutil.disk_usage(where).free, psutil.virtual_memory().available
    return max(1, min(want, int(0.8 * free) // one, int(0.6 * ram) // one))


def load_target(ctx: dict, layers: int, folder):
    """The nf4 stack written under `folder`, every layer streamed (RAM tier; smoke: disk tier)."""
    from offload import OffloadedCausalLM

    shape = stack.SMOKE_TARGET if ctx["smoke"] else stack.TARGET
    path = stack.write_nf4_stack(folder, shape, layers, ctx["device"])
    tier = dict(offload="disk", max_host_memory=0) if ctx["smoke"] else dict(offload="ram")
    return OffloadedCausalLM.from_pretrained(path, device=ctx["device"], dtype="nf4", max_device_memory=0, **tier)


def load_draft(ctx: dict):
    """The `draft` phase's 1B-shaped bf16 draft (written if this run has not yet), resident."""
    from offload import OffloadedCausalLM

    dshape = stack.SMOKE_DRAFT if ctx["smoke"] else stack.DRAFT
    path = stack.write_bf16(ctx["out"] / "stack" / "draft", dshape, dshape["layers"], ctx["device"], seed=1)
    return OffloadedCausalLM.from_pretrained(path, device=ctx["device"], dtype="bf16", offload="none")


def prefill(models, past: int, rows: int):
    """A DecodeState whose caches hold `past` random tokens, and a reset() back to it."""
    from specexec_cli.core import kvcache
    from specexec_cli.core.engine import DecodeState
    from specexec_cli.core.tree import causal_mask

    st = DecodeState()
    prefix = torch.randint(1, 500, (past,), generator=torch.Generator().manual_seed(0))
    for model, cache in ((models.target, st.target_cache), (models.draft, st.draft_cache)):
        kvcache.reserve(cache, model, rows)
        mask = causal_mask(0, past, kvcache.model_dtype(model), model.device)
        kvcache.forward(model, cache, prefix, torch.arange(past), mask, last_only=True)

    def reset():
        kvcache.crop(st.target_cache, past)
        kvcache.crop(st.draft_cache, past)
        st.ids, st.target_len, st.draft_len, st.noise = prefix.tolist() + [ROOT_TOKEN], past, past, None

    reset()
    return st, reset


def set_scale(draft, scale: float) -> None:
    with torch.no_grad():
        draft.norm.weight.fill_(scale)


def pick_scale(models, st, reset, shape, want: dict, counter: list) -> dict:
    """The first of SCALES whose tree takes at least want["forwards"] draft forwards and reaches
    want["depth"], else the sharpest tried."""
    from specexec_cli.core.draft import grow_tree
    from specexec_cli.core.engine import draft_context
    from specexec_cli.core.sampling import SamplingParams
    from specexec_cli.core.tree import subtree, top_budget

    tried = []
    for scale in SCALES:
        set_scale(models.draft, scale)
        reset()
        n0 = counter[0]
        tree = grow_tree(models.draft, st.draft_cache, draft_context(st), shape, SamplingParams())
        depth = int(subtree(tree, top_budget(tree.logp, shape.budget)).depth.max())
        tried.append(dict(scale=scale, forwards=counter[0] - n0, depth=depth))
        if tried[-1]["forwards"] >= want["forwards"] and depth >= want["depth"]:
            break
    set_scale(models.draft, tried[-1]["scale"])
    reset()
    return dict(tried[-1], tried=tried, want=want)


def run_budget(models, st, reset, budget: int, tr: dict, repeats: int, counter: list) -> dict:
    """Both modes at `budget` from the same prefix and the same replayed acceptance."""
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import GenerationConfig

    shape = TreeShape(budget=budget, **{k: tr[k] for k in ("max_depth", "max_beams", "max_branch")})
    cfg = GenerationConfig(method="specexec", shape=shape, extra={"scores": "draft"})
    rec = tr["budgets"][str(budget)]
    want = dict(forwards=trace.mean(rec["draft_forwards"]), depth=trace.mean(rec["tree_depth"]))
    out = dict(
        budget=budget,
        trace=dict(
            tokens_per_pass=trace.mean(rec["accepted"]) + 1,
            forwards=trace.mean(rec["draft_forwards"]),
            depth=trace.mean(rec["tree_depth"]),
            passes=len(rec["accepted"]),
        ),
        scale=pick_scale(models, st, reset, shape, want, counter),
    )
    clock = stepmodes.LayerClock(models.target, models.target.device)
    try:
        for name, mode in (("without", stepmodes.without_overlap), ("with", stepmodes.with_overlap)):
            reset()
            rep = replay.Replay(trace.accepted(tr, budget))
            with rep.patched():
                out[name] = mode(models, st, cfg, rep, clock, repeats, counter)
            out[name]["replayed"] = dict(accepted=rep.accepted, capped=rep.capped)
    finally:
        clock.close()
    return out


def step(ctx: dict) -> dict:
    from specexec_cli.core.state import Models

    smoke, card = ctx["smoke"], ctx["card"]
    shape, dshape = (stack.SMOKE_TARGET, stack.SMOKE_DRAFT) if smoke else (stack.TARGET, stack.DRAFT)
    past, repeats = (SMOKE_PAST, SMOKE_REPEATS) if smoke else (PAST, REPEATS)
    tr, folder, loaded = trace.load(), ctx["out"] / "step", []
    freed = free_scratch(ctx)
    layers = fit_layers(shape, SMOKE_LAYERS if smoke else LAYERS, ctx["out"])
    counter, rows = [0], past + 2 * max(BUDGETS) + (repeats + 3) * (tr["max_depth"] + 2)
    try:
        target = load_target(ctx, layers, folder)
        loaded.append(target)
        draft = load_draft(ctx)
        loaded.append(draft)
        draft.register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
        models = Models(target, draft, None, frozenset(), rows + 1)
        st, reset = prefill(models, past, rows)
        plan = target.plan
        staging = plan.slots * plan.slot_bytes
        draft_bytes = sum(p.numel() * p.element_size() for p in draft.parameters())
        budgets = []
        for budget in BUDGETS:
            rec = run_budget(models, st, reset, budget, tr, repeats, counter)
            target_in = dict(layers=layers, past=past, layer_bytes=plan.layer_bytes[0], staging_bytes=staging)
            tpp = rec["trace"]["tokens_per_pass"]
            rec["predicted"] = predict.step(card, shape, target_in, budget, dshape, draft_bytes, tpp, tr["max_beams"])
            budgets.append(rec)
        return dict(
            layers=layers,
            past=past,
            repeats=repeats,
            shape=shape,
            draft_shape=dshape,
            plan=plan.describe(),
            layer_bytes=plan.layer_bytes[0],
            streamed_bytes=target.stats.streamed_bytes_per_pass,
            staging_bytes=staging,
            draft_bytes=draft_bytes,
            freed=freed,
            trace={k: v for k, v in tr.items() if k != "budgets"},
            overlap="the phase's own arrangement (specexec_cli has no overlapped step yet): the target's pass "
            "launched from a worker thread, the next tree grown meanwhile on a CUDA stream of its own",
            budgets=budgets,
        )
    finally:
        for model in loaded:
            model.close()
        shutil.rmtree(folder, ignore_errors=True)
