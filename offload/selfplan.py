"""The memory plan of a self-draft (`--draft self`): substitute bytes per bit width, and the bits.

Contract:
- `substitute_bytes(ck, arch, req, bits, nf4_layers)` lists, per decoder layer, the device bytes
  of its substitute: bits 4 = the layer's NF4 packing from the nf4 cache (`nf4_layers`, memlayers.
  LayerSizes at dtype nf4: packed bytes + its share of quant states and norms), bits 3 / 2 = HQQ
  codes + one scale and zero per group (offload.lowbit) + the layer's other parameters, all in the
  draft's compute dtype.
- `candidate_bits(req, prequant)`: the widths a plan may choose: `req.draft_bits` when set; else
  4, 3, 2 for a 16-bit target, 3, 2 for an nf4 one (4-bit substitutes would be the target itself);
  none for a pre-quantized checkpoint (no 16-bit weights to quantize from).
- `plan_self_draft(target, req, nf4_layers, plan_with)` plans every candidate width through
  `plan_with(substitute_bytes, bits)` (memplan's budget/embeddings search with those substitutes
  counted as the "draft" component) and returns the chosen plan with `substitute_bits` set and notes
  stating the bits, the resident layers and the figures behind the choice; a pre-quantized target
  gets a refused plan naming the fix; a target with nothing streamed, a note that no draft runs.
- Where no width fits with a substitute for every streamed layer, `partial` looks for the fewest
  skipped layers that make a width fit (in influence.skip_order: by the influence stored for this
  checkpoint, else the middle block the loader replaces after measuring), and keeps it only while
  the skipped fraction is within what was measured (SKIP_FACTOR) and the expected tokens/pass stays
  above MIN_TOKENS_PER_PASS; otherwise the plan is refused with that reason and the fix.
- `choose(plans, temperature)` picks, among fitting (bits, plan) pairs, the one with the most
  expected tokens/s: `tokens_per_pass(bits, temperature)` (measured greedy and sampled, see below) ÷ the plan's pass time (its streamed bytes over the
  link and disk priors LINK_BPS / DISK_BPS, plus a fixed compute floor). It returns the choice and
  one line per candidate with those figures, which `--dry-run` prints.
"""

from __future__ import annotations

import math

from .membytes import arch_of
from .sizes import format_bytes

TOKENS_PER_PASS = {"greedy": {4: 24.23, 3: 18.07, 2: 13.39}, "sampled": {4: 19.52, 3: 14.25, 2: 9.63}}
"""Tokens per target pass of the self-draft by substitute bits, measured on the shared pair with every
layer substituted (bench/selfdraft.py, specexec, budget 64, 40 prompts, 128 new tokens, gap-featured
node scores, the shared KV cache): greedy at T=0 (bench/results/selfdraft_t0_gap.json,
selfdraft_t0_gap_hqq.json), sampled at T=0.7 with one seed per prompt (selfdraft_t07_gap.json,
selfdraft_t07_gap_hqq.json). Only the ratios within a row matter."""


def tokens_per_pass(bits: int, temperature: float) -> float:
    return TOKENS_PER_PASS["sampled" if temperature > 0 else "greedy"][bits]
SKIP_FACTOR = {0.0: 1.0, 0.125: 0.480, 0.25: 0.333, 0.375: 0.268, 0.5: 0.234}
"""Tokens per pass of a self-draft that skips a middle block of this fraction of the layers, relative to
one that skips none: 11.64 / 8.08 / 6.50 / 5.66 against 24.23 for 1-4 of the 8 layers skipped
(bench/results/selfdraft_skip_middle.json: shared pair, nf4 substitutes, budget 64, T = 0, 128 tokens).
A 15.7M model with 8 layers loses far more per skipped layer than a 70B with 80 (prior, pessimistic)."""
MIN_TOKENS_PER_PASS = 1.5   # below this a partial self-draft is refused: a small trained draft does better


def skip_factor(fraction: float) -> float | None:
    """Linear interpolation of SKIP_FACTOR; None beyond the largest measured fraction."""
    pts = sorted(SKIP_FACTOR.items())
    if fraction > pts[-1][0] + 1e-9:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if fraction <= x1:
            return y0 + (y1 - y0) * (fraction - x0) / (x1 - x0)
    return pts[-1][1]


LINK_BPS = {"cuda": 24e9, "cpu": 10e9}     # RAM tier -> compute device (PCIe 4 x16 effective; memcpy)
DISK_BPS = {"cuda": 3e9, "cpu": 2e9}       # NVMe O_DIRECT reads
FLOOR_S = 0.05                              # per-pass compute and latency that streaming does not hide


def substitute_bytes(ck, arch, req, bits: int, nf4_layers) -> list[int]:
    from .lowbit import lowbit_weight_bytes
    from .membytes import dtype_bytes

    if bits == 4:
        q = nf4_layers
        return [b + (q.quant + q.pinned) // len(q.packed) for b in q.packed]
    c = dtype_bytes(req.draft_dtype)
    out = []
    for i in range(arch.layers):
        prefix, total = f"model.layers.{i}.", 0
        for name, e in ck.tensors.items():
            if not name.startswith(prefix) or not name.endswith(("weight", "bias")) or name.endswith("inv_freq"):
                continue
            quantized = name.endswith("_proj.weight") and (len(e.shape) == 2 or e.dtype.itemsize == 1)
            numel = math.prod(e.shape) * (2 if e.dtype.itemsize == 1 and quantized else 1)
            total += lowbit_weight_bytes((numel,), bits, c) if quantized else numel * c
        out.append(total)
    return out


def candidate_bits(req, prequant: bool) -> list[int]:
    if prequant:
        return []
    if req.draft_bits is not None:
        return [req.draft_bits]
    return [3, 2] if req.dtype == "nf4" else [4, 3, 2]


def pass_seconds(plan) -> float:
    """Expected target pass time from the plan's streamed bytes (priors, not a measurement)."""
    ram = sum(plan.layer_bytes[i] for i in plan.ram_layers)
    return FLOOR_S + ram / LINK_BPS[plan.device] + plan.disk_bytes_per_pass / DISK_BPS[plan.device]


def expected_tokens_per_pass(bits: int, plan, temperature: float) -> float:
    """Measured tokens/pass of this width, scaled for the layers the plan's draft skips."""
    n = len(plan.layer_bytes)
    factor = skip_factor(len(plan.skipped_layers) / n) if n else 1.0
    return tokens_per_pass(bits, temperature) * (factor or 0.0)


def choose(plans: list[tuple[int, object]], temperature: float = 0.0) -> tuple[tuple[int, object], list[str]]:
    """The (bits, plan) with the most expected tokens/s among those that fit (else the last tried)."""
    lines, best, best_rate = [], None, -1.0
    for bits, plan in plans:
        t, tpp = pass_seconds(plan), expected_tokens_per_pass(bits, plan, temperature)
        rate = tpp / t if plan.fits else 0.0
        skip = f", {len(plan.skipped_layers)} skipped" if plan.skipped_layers else ""
        figures = (f"~{tpp:.1f} tokens/pass at T={temperature:g} x {t:.2f} s/pass expected" if tpp
                   else "skips more layers than measured")
        lines.append(f"self-draft {bits}-bit: substitutes {format_bytes(plan.device_bytes.get('draft', 0))}, "
                     f"{len(plan.resident)} resident layers{skip}, {figures} -> "
                     + (f"~{rate:.1f} tokens/s" if plan.fits else "does not fit"))
        if plan.fits and rate > best_rate:
            best, best_rate = (bits, plan), rate
    return best or plans[-1], lines


def plan_self_draft(target, req, nf4_layers, plan_with):
    """The chosen self-draft plan (see the contract)."""
    a = arch_of(target.config)
    tried = []
    for bits in candidate_bits(req, not req.sixteen_bit) or [4]:
        plan = plan_with(substitute_bytes(target, a, req, bits, nf4_layers), bits)
        plan.substitute_bits = bits
        tried.append((bits, plan))
    if not req.sixteen_bit:
        plan = tried[0][1]
        plan.fits, plan.reason = False, ("--draft self: a pre-quantized checkpoint has no 16-bit weights to make "
                                         "substitutes from; fix: --target the 16-bit checkpoint with --dtype nf4, "
                                         "or a small --draft DIR")
        return plan
    if not any(p.fits for _, p in tried):
        tried += [pair for pair in (partial(target, a, req, b, nf4_layers, plan_with) for b, _ in tried) if pair]
    (bits, plan), lines = choose(tried, req.temperature)
    if not plan.ram_layers and not plan.disk_layers:
        plan.substitute_bits = None
        plan.notes.append("self-draft: every target layer is resident, so there is nothing to substitute; "
                          "decoding without a draft")
        return plan
    plan.notes.extend(lines if len(tried) > 1 else [])
    streamed, skipped = len(plan.ram_layers) + len(plan.disk_layers), len(plan.skipped_layers)
    plan.notes.append(f"self-draft: {bits}-bit substitutes of {streamed - skipped} of the {streamed} streamed layers"
                      f" ({format_bytes(plan.device_bytes.get('draft', 0))} on the device), "
                      f"{len(plan.resident)} layers resident and shared"
                      + (f"; the draft leaves out {skip_note(target, plan)}" if skipped else ""))
    if not plan.fits:
        plan.reason = refusal(plan, req, bits)
    return plan


def skip_order_for(target, n_layers: int) -> tuple[list[int], bool]:
    """(the order layers are left out in, whether it comes from measured influence): the influence
    stored for this checkpoint (or the 16-bit one behind its nf4 cache), else the middle-out order."""
    from .influence import skip_order, stored_influence
    from .quant_cache import manifest_source

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

    lo, hi = 1, a.layers - 2   # binary search on the skipped count: more skipped, fewer bytes
    if not attempt(hi).fits:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if attempt(mid).fits else (mid + 1, hi)
    plan = attempt(lo)
    factor = skip_factor(len(plan.skipped_layers) / a.layers)
    if factor is None or tokens_per_pass(bits, req.temperature) * factor < MIN_TOKENS_PER_PASS:
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
    return (f"the {len(plan.skipped_layers)} least influential layers, measured by one target pass at the first "
            f"load (until then the middle block {format_layers(plan.skipped_layers)} stands in)")


def refusal(plan, req, bits: int) -> str:
    """Why no self-draft fits here, in one line with the fix."""
    if plan.skipped_layers:
        return (f"--draft self does not fit in {format_bytes(plan.device_capacity)}: the {bits}-bit substitutes "
                f"would have to leave out {len(plan.skipped_layers)} of {len(plan.layer_bytes)} layers, beyond "
                f"what keeps the draft useful (measured up to {max(SKIP_FACTOR):.0%} left out); fix: a small "
                f"--draft DIR, or a larger --max-gpu-memory")
    return plan.reason
