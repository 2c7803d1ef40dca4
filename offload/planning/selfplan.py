"""The memory plan of a self-draft (`--draft self`): substitute bytes per bit width, and the bits.

Contract:
- `substitute_bytes(ck, arch, req, bits, nf4_layers)`: per decoder layer the device bytes of its
  substitute: bits 4 = its NF4 packing (`nf4_layers`: packed bytes + its share of quant states and
  norms), bits 3 / 2 = HQQ codes + a scale and zero per group (quant/lowbit) + its other parameters, in
  the draft's compute dtype.
- `candidate_bits(req, prequant)`: `req.draft_bits` when set; else 4, 3, 2 (3, 2 for an nf4 or packed
  target: 4-bit would be the target itself); none for a pre-quantized checkpoint (no 16-bit weights).
- `plan_self_draft(target, req, nf4_layers, plan_with)` plans every width through `plan_with(substitute
  bytes, bits)` (memplan's search with them as the "draft" component) and returns the chosen plan with
  `substitute_bits` and notes; a pre-quantized target, or a mixture of experts with a layer streamed, gets
  a refused plan naming the fix.
- Where no width fits, `partial` looks for the fewest skipped layers that fit (influence.skip_order), kept
  only within the measured SKIP_FACTOR and above MIN_TOKENS_PER_PASS tokens/pass; else refused.
- Where every layer is resident, `skip_plan` plans the layer-skip self-draft (selfdraft/build.
  build_skip_draft: default_skip of the target's own layers left out, a shared KV cache, no bytes of its
  own; `substitute_bits` build.LAYER_SKIP, 0), modelled against plain decoding (draftcost.skip_spec).
- `choose(a, req, plans)` picks the fitting (bits, plan) with the most modelled tokens/s (draftcost.py; else
  the last tried) and returns every width's Candidate, the best-fitting plan tried for it (the plan's
  `candidates` / `choice`, printed by `--dry-run`).
"""

from __future__ import annotations

import itertools
import math

from offload.arch.moe import MOE_FAMILIES
from offload.planning.acceptance import tokens_per_pass
from offload.planning.draftcost import Spec, best, costing_for, finish, self_forward_bytes, skip_spec, sweep
from offload.planning.membytes import arch_of, dtype_bytes, substitute_kernel
from offload.planning.memlayers import substitutes_are_blocks
from offload.planning.passcost import linear_weights
from offload.sizes import format_bytes

RESIDENT_SKIP = 0.5
"""Share of the layers the layer-skip self-draft of a resident target leaves out: on SmolLM2-135M (30 layers)
leaving out the 15 least influential kept 2.82 tokens per pass, as many as 10 (selfdraft_resident.json)."""


def default_skip(n_layers: int) -> int:
    """Layers the layer-skip self-draft of a resident target leaves out (RESIDENT_SKIP of them, at least 1)."""
    return max(1, min(n_layers - 2, round(n_layers * RESIDENT_SKIP)))


SKIP_FACTOR = {0.0: 1.0, 0.125: 0.480, 0.25: 0.333, 0.375: 0.268, 0.5: 0.234}
"""Tokens per pass of a self-draft that skips a middle block of this fraction of the layers, relative to one
that skips none (bench/results/selfdraft_skip_middle.json: the shared pair, nf4 substitutes, budget 64, T = 0);
a pessimistic prior: a 15.7M model of 8 layers loses far more per skipped layer than a 70B of 80."""
MIN_TOKENS_PER_PASS = 1.5  # below this a partial self-draft is refused: a small trained draft does better


def skip_factor(fraction: float) -> float | None:
    """Linear interpolation of SKIP_FACTOR; None beyond the largest measured fraction."""
    pts = sorted(SKIP_FACTOR.items())
    if fraction > pts[-1][0] + 1e-9:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if fraction <= x1:
            return y0 + (y1 - y0) * (fraction - x0) / (x1 - x0)
    return pts[-1][1]


def substitute_bytes(ck, arch, req, bits: int, nf4_layers) -> list[int]:
    import torch

    from offload.quant.lowbit import blocks_serve, lowbit_weight_bytes

    if bits == 4:
        q = nf4_layers
        return [b + (q.quant + q.pinned) // len(q.packed) for b in q.packed]
    c = dtype_bytes(req.draft_dtype)
    compute = torch.float32 if c == 4 else None

    def sub(shape: tuple[int, ...]) -> int:  # one substitute weight: the kernel's blocks or HQQ's codes
        blocks = blocks_serve(shape, bits, req.device, compute)
        return lowbit_weight_bytes(shape if blocks else (math.prod(shape),), bits, c, blocks)

    out = []
    for i in range(arch.layers):
        prefix = f"model.layers.{i}."
        if getattr(ck, "packed", None):  # AWQ/GPTQ/compressed-tensors: substitutes of the dequantized weights
            layer = {n: s for n, s in ck.shapes.items() if n.startswith(prefix)}
            out.append(sum(sub(tuple(s)) if n in ck.packed else math.prod(s) * c for n, s in layer.items()))
            continue
        total = 0
        for name, e in ck.tensors.items():
            if not name.startswith(prefix) or not name.endswith(("weight", "bias")):
                continue
            quantized = name.endswith("_proj.weight") and (len(e.shape) == 2 or e.dtype.itemsize == 1)
            numel = math.prod(e.shape) * (2 if e.dtype.itemsize == 1 and quantized else 1)
            shape = tuple(e.shape) if e.dtype.itemsize != 1 else (numel,)
            total += sub(shape) if quantized else numel * c
        out.append(total)
    return out


def candidate_bits(req, prequant: bool, packed: bool = False) -> list[int]:
    if prequant:
        return []
    if req.draft_bits is not None:
        return [req.draft_bits]
    return [3, 2] if req.dtype == "nf4" or packed else [4, 3, 2]


def self_spec(a, req, bits: int, plan):
    """The draftcost.Spec of the self-draft at `bits` under this plan: its bytes, FLOPs and kernel."""
    c = dtype_bytes(req.draft_dtype)
    weight, kv, deq = self_forward_bytes(a, plan, bits, c, req.dtype == "nf4", req.device)
    run = len(plan.layer_bytes) - len(plan.skipped_layers)
    n = len(plan.layer_bytes)
    factor = (skip_factor(len(plan.skipped_layers) / n) or 0.0) if n else 1.0
    weights = a.layers * linear_weights(a) + a.vocab * a.hidden  # the target's: its size picks the prior
    tpp = lambda b: tokens_per_pass(bits, req.temperature, b, weights) * factor  # noqa: E731
    flops = 2.0 * (linear_weights(a) * run + a.hidden * a.vocab)
    blocks = blocks_forward(a, req, bits, plan)
    if blocks is not None:  # every layer it runs through the CPU kernel's blocks (quant/lowbit_pack.py)
        packed, weight, stack = blocks
        return Spec("self", bits, f"self-{bits}", tpp, weight, kv, 0, flops, "sx-blocks", packed, stack)
    return Spec("self", bits, f"self-{bits}", tpp, weight, kv, deq, flops, substitute_kernel(bits, req.device))


def blocks_forward(a, req, bits: int, plan) -> tuple[float, int, bool] | None:
    """(packed bytes x ggml_kernel.COST, other weight bytes, on the one-call stack) of one self-draft forward
    whose substitutes are the CPU kernel's SX blocks and whose resident layers the GGUF kernel serves (then
    selfdraft/build.py gives the draft a LeanStack); None otherwise."""
    from offload.cpu.ggml_kernel import COST, MAX_ROWS, SX2, SX3

    k = getattr(plan, "kernel", None) or {}
    if bits not in (2, 3) or not substitutes_are_blocks(req, a, bits) or set(plan.resident) - set(k.get("layers", ())):
        return None
    factor = k.get("cost", {})
    packed = plan.device_bytes.get("draft", 0) * COST[SX3 if bits == 3 else SX2]
    packed += sum(plan.layer_bytes[i] * factor.get(i, 1.0) for i in plan.resident)
    head = k.get("head_bytes", 0)
    packed += head * k.get("draft_head_cost", k.get("head_cost", 1.0))  # a Q8_0 head read as Q8A
    weight = 0 if head else a.vocab * a.hidden * dtype_bytes(req.draft_dtype)
    stack = req.max_beams <= MAX_ROWS and bool(k.get("llama"))
    return packed, weight, stack


def choose(a, req, plans: list[tuple[int, object]]) -> tuple[tuple[int, object], list]:
    cands, pairs = {}, {}
    for bits, plan in plans:
        c = sweep(self_spec(a, req, bits, plan), costing_for(a, req), plan, req.budget_auto)  # best budget if auto
        if bits not in cands or (c.fits and c.tokens_per_second >= cands[bits].tokens_per_second):
            cands[bits], pairs[bits] = c, (bits, plan)
    top = best(list(cands.values()))
    return (pairs[top.bits] if top else plans[-1]), list(cands.values())


def plan_self_draft(target, req, nf4_layers, plan_with):
    a = arch_of(target.config)
    tried = []
    for bits in candidate_bits(req, not req.sixteen_bit, bool(getattr(target, "packed", None))) or [4]:
        plan = plan_with(substitute_bytes(target, a, req, bits, nf4_layers), bits)
        plan.substitute_bits = bits
        tried.append((bits, plan))
    if target.config.get("model_type") in MOE_FAMILIES and (tried[0][1].ram_layers or tried[0][1].disk_layers):
        from offload.selfdraft.build import MOE_REFUSED

        tried[0][1].fits, tried[0][1].reason = False, MOE_REFUSED  # the loader's check_self_draft refuses it too
        return tried[0][1]
    if not req.sixteen_bit:
        plan = tried[0][1]
        if not plan.ram_layers and not plan.disk_layers:  # nothing to substitute: the layer-skip draft needs no 16 bits
            return skip_plan(target, a, req, plan_with)
        plan.fits = False
        plan.reason = (
            "--draft self: a pre-quantized checkpoint has no 16-bit weights to make substitutes from; "
            "fix: --target the 16-bit checkpoint with --dtype nf4, or a small --draft DIR"
        )
        return plan
    if not any(p.fits for _, p in tried):
        tried += [pair for pair in (partial(target, a, req, b, nf4_layers, plan_with) for b, _ in tried) if pair]
    (bits, plan), cands = choose(a, req, tried)
    if not plan.ram_layers and not plan.disk_layers:  # an explicit width refused keeps its reason
        return plan if not plan.fits and req.draft_bits is not None else skip_plan(target, a, req, plan_with)
    chosen = next((c for c in cands if c.bits == bits and c.fits), None)
    if chosen is not None and req.budget_auto:
        plan.budget = chosen.budget  # the budget with the most modelled tokens/s (within what the plan sized)
    finish(plan, cands, costing_for(a, req))
    plan.choice = chosen.to_json() if chosen else None
    streamed, skipped = len(plan.ram_layers) + len(plan.disk_layers), len(plan.skipped_layers)
    plan.notes.append(
        f"self-draft: {bits}-bit substitutes of {streamed - skipped} of the {streamed} streamed layers"
        f" ({format_bytes(plan.device_bytes.get('draft', 0))} on the device), "
        f"{len(plan.resident)} layers resident and shared"
        + (f"; the draft leaves out {skip_note(target, plan)}" if skipped else "")
    )
    if not plan.fits:
        plan.reason = refusal(plan, req, bits)
    return plan


def skip_plan(target, a, req, plan_with):
    from offload.selfdraft.build import LAYER_SKIP

    plan = plan_with([0] * a.layers, None)  # no substitutes; its draft runs the target's (dequantizing) layers
    order, _ = skip_order_for(target, a.layers)
    plan.substitute_bits, plan.skipped_layers = LAYER_SKIP, sorted(order[: default_skip(a.layers)])
    cost = costing_for(a, req)
    cand = sweep(skip_spec(a, plan, cost), cost, plan, req.budget_auto)
    if cand.fits and req.budget_auto:
        plan.budget = cand.budget
    finish(plan, [cand], cost)
    plan.notes.append(
        f"self-draft: every target layer is resident, so the draft is the target itself with "
        f"{len(plan.skipped_layers)} of its {a.layers} layers left out ({skip_note(target, plan)}), "
        "sharing its weights and KV cache"
    )
    return plan


def skip_order_for(target, n_layers: int) -> tuple[list[int], bool]:
    """(the order layers are left out in, whether it comes from measured influence): the influence
    stored for this checkpoint (or the 16-bit one behind its nf4 cache), else the middle-out order."""
    from offload.quant.quant_cache import manifest_source
    from offload.selfdraft.influence import skip_order, stored_influence

    root = getattr(target, "root", None)
    influence = stored_influence(manifest_source(root) or root, n_layers) if root is not None else None
    return skip_order(n_layers, influence), influence is not None


def partial(target, a, req, bits: int, nf4_layers, plan_with):
    """(bits, plan) with the fewest layers left out that fits at this width, or None."""
    full = substitute_bytes(target, a, req, bits, nf4_layers)
    order, _ = skip_order_for(target, a.layers)

    def attempt(n_skip: int):
        skip = set(order[:n_skip])
        plan = plan_with([0 if i in skip else b for i, b in enumerate(full)], bits)
        plan.substitute_bits, plan.skipped_layers = bits, sorted(skip - set(plan.resident))
        return plan

    lo, hi = 1, a.layers - 2  # binary search on the skipped count: more skipped, fewer bytes
    if not attempt(hi).fits:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if attempt(mid).fits else (mid + 1, hi)
    plan = attempt(lo)
    factor = skip_factor(len(plan.skipped_layers) / a.layers)
    if factor is None or tokens_per_pass(bits, req.temperature, plan.budget) * factor < MIN_TOKENS_PER_PASS:
        plan.fits = False
    return bits, plan


def format_layers(layers: list[int]) -> str:
    """[3, 4, 5, 9] -> "3-5, 9"."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def skip_note(target, plan) -> str:
    """Which layers the draft leaves out and how they were chosen."""
    _, measured = skip_order_for(target, len(plan.layer_bytes))
    if measured:
        return f"layers {format_layers(plan.skipped_layers)}, the least influential as measured"
    if plan.substitute_bits == 0:  # build.LAYER_SKIP: every layer is a candidate
        return (
            f"the least influential, measured by one target pass at the first load; until then the "
            f"middle block {format_layers(plan.skipped_layers)} stands in"
        )
    return (
        f"the {len(plan.skipped_layers)} least influential layers, measured by one target pass at the first "
        f"load (until then the middle block {format_layers(plan.skipped_layers)} stands in)"
    )


def refusal(plan, req, bits: int) -> str:
    """Why no self-draft fits here, in one line with the fix."""
    if plan.skipped_layers:
        return (
            f"--draft self does not fit in {format_bytes(plan.device_capacity)}: the {bits}-bit substitutes "
            f"would have to leave out {len(plan.skipped_layers)} of {len(plan.layer_bytes)} layers, beyond "
            f"what keeps the draft useful (measured up to {max(SKIP_FACTOR):.0%} left out); fix: a small "
            f"--draft DIR, or a larger --max-gpu-memory"
        )
    return plan.reason
