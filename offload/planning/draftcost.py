"""The draft cost model: what each candidate draft (and plain decoding) costs per target pass, and the tokens/s.

Contract (every figure is modelled on a passcost.Device; a matching profile's measured times replace them):
- pass seconds = passcost.target_pass (a mixture of experts: experts.pass_terms) at n = budget + 1 tokens
  and passcost.model_ctx. Where the profile measured t_target(n) for this target and placement (resident /
  RAM / disk layer counts), its log-log interpolation at n instead (source "measured").
- draft seconds = forwards_per_tree x passcost.draft_step(weights + KV at model_ctx + its kernel's
  dequantization traffic, FLOPs over draft_rows(budget, max_beams) nodes). Where the profile timed this
  draft (a small draft, or the self-draft per width, same placement), its measured seconds per pass at the
  budget instead (else its tree time, else forwards x its step).
- `forwards_per_tree(budget, max_beams, tpp)` = 1 (the pending tokens) + ceil(budget / max_beams) +
  ceil(tpp): max_beams nodes per forward until `budget`, and at least as deep as the accepted path.
- `hidden_seconds(plan, draft_s, m)`: the draft time under which the prefetcher fills the free staging
  slots with the next pass's layers, up to staging_slots bytes / (link or disk rate): on CUDA (its copy
  engine) and on a CPU reading from disk (O_DIRECT); a CPU's copies from RAM share the draft's cores.
- tokens/s = tokens per pass / (pass seconds + draft seconds - hidden seconds); tokens per pass from
  acceptance.tokens_per_pass (scaled by selfplan.skip_factor for a self-draft that skips layers); plain
  decoding: 1 token per pass of 1 token, no draft.
- `Candidate` holds one candidate's figures, pass terms, sources and (`by_budget`) its tokens/s at BUDGETS
  up to the plan's budget; `best(cands)` the fitting one with the most tokens/s; `sweep` settles `--budget
  auto`; `finish(plan, cands, cost)` sets plan.candidates (plain decoding last: `--draft auto` may take
  it) and plan.choice.
- `skip_spec(a, plan, cost)`: the layer-skip self-draft of a resident target: one forward reads the kept
  layers (in c bytes a weight where dequantized once), the head and their shared KV, dequantizes as the
  target's kernel does, and spends 2 x (kept linear weights + head) FLOPs per node.
- `small_candidates` fills a small draft's plan with its candidate and the self-draft's widths.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from collections.abc import Callable

from offload.planning.acceptance import tokens_per_pass
from offload.planning.experts import pass_terms
from offload.planning.membytes import arch_of, compute_bytes, draft_bytes, dtype_bytes, kv_bytes, substitute_kernel
from offload.planning.passcost import (
    DEQUANT_ELEMS, Device, dequant_elems, device_of, draft_step, interpolate, linear_weights, model_ctx, target_pass,
)

LINK_EFFICIENCY = 0.75      # effective / published PCIe x16 rate (24 of 32 GB/s on PCIe 4)
BUDGETS = (4, 8, 16, 64, 256, 1024)   # budgets the dry run shows tokens/s at (those within the plan's budget)
PLAIN = "none"              # Candidate.draft of plain decoding (no draft)


@dataclass
class Candidate:
    """One candidate draft with its modelled figures and the inputs behind them."""

    draft: str                  # "self", the --draft directory as given, or "none" (plain decoding)
    bits: int | None            # substitute bits of a self-draft; None for a small draft (its own dtype)
    tokens_per_pass: float      # expected tokens emitted per target pass
    pass_seconds: float         # target pass (modelled: streaming overlapped with compute; or measured)
    draft_seconds: float        # tree growth per pass (modelled or measured)
    tokens_per_second: float    # tokens_per_pass / (pass_seconds + draft_seconds - hidden_seconds); 0 if not fits
    fits: bool = True           # its memory plan fits the device
    forwards: int = 0           # draft forwards per tree
    weight_bytes: int = 0       # weight bytes one draft forward reads
    kv_bytes: int = 0           # KV bytes one draft forward reads (the full planned context)
    dequant_bytes: int = 0      # dequantization traffic of one draft forward
    hidden_seconds: float = 0.0  # draft time the weight stream hides
    resident_layers: int = 0    # target layers resident in its plan
    budget: int = 0             # tree budget of its plan (tokens_per_pass is at this budget)
    kernel: str = "none"        # dequantizing path its draft linears run on the plan's device (membytes.substitute_kernel)
    terms: dict = field(default_factory=dict)     # passcost.PassTerms of its target pass (modelled, seconds)
    sources: dict = field(default_factory=dict)   # "pass" / "draft" -> "measured" | "modelled"
    by_budget: list = field(default_factory=list)  # [{budget, tokens_per_pass, pass_seconds, draft_seconds, tokens_per_second}]

    def to_json(self) -> dict:
        return {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Spec:
    """What a candidate's draft is, independent of the budget."""

    draft: str                  # Candidate.draft
    bits: int | None            # Candidate.bits
    key: str                    # its key in a profile's measured draft timings: "small", "self-4", ...; "" none
    tpp: Callable[[int], float]  # expected tokens per pass at a budget
    weight: int = 0             # weight bytes one draft forward reads
    kv: int = 0                 # KV bytes one draft forward reads
    dequant: int = 0            # dequantization traffic of one draft forward
    flops_per_node: float = 0.0  # FLOPs one draft forward spends per tree node it runs
    kernel: str = "none"        # its dequantizing path
    packed: int = 0             # GGUF bytes one draft forward reads through the packed kernel
    stack: bool = False         # its forwards run on the one-call stack (cpu/leanstack.py): the stack's floor


@dataclass(frozen=True)
class Costing:
    """The target-side inputs every candidate of one plan shares."""

    arch: object                # the target's membytes.Arch
    c: int                      # bytes per element of the target's compute dtype
    kernel: str                 # dequantizing path of the target's layers (nf4-dequant, int4-unpack, none)
    dev: Device                 # the rates
    timings: dict               # a matching profile's measured figures (session/profiles.plan_timings); {} none
    max_beams: int              # draft nodes per tree-growth forward
    temperature: float          # decoding temperature (tokens per pass depend on it)


def costing_for(a, req) -> Costing:
    kernel = "nf4-dequant" if req.dtype == "nf4" else "int4-unpack" if a.packed else "none"
    return Costing(a, compute_bytes(req), kernel, device_of(req), getattr(req, "timings", None) or {},
                   req.max_beams, req.temperature)


ROWS_PER_BUDGET = 1 / 3
"""Tree nodes one draft forward runs, per node of the budget: 1.9 / 3.1 / 5.7 / 9.2 at budgets 4 / 8 / 16 /
32 (SmolLM2, 3-bit self-draft from disk, bench/spec_pass.py): the best-first frontier, not max_beams."""


def draft_rows(budget: int, max_beams: int) -> int:
    """Rows of one draft forward of a tree of `budget` nodes (ROWS_PER_BUDGET, at most max_beams)."""
    return max(1, min(max_beams, round(budget * ROWS_PER_BUDGET)))


def forwards_per_tree(budget: int, max_beams: int, tokens_per_pass: float = 0.0) -> int:
    """See the contract (measured on SmolLM2 from disk, 3-bit self-draft: 5.9 forwards per pass at budget 16
    with 4.0 tokens per pass, 8.8 at 64 with 5.0)."""
    return 1 + math.ceil(budget / max(1, max_beams)) + math.ceil(tokens_per_pass)


def measured(cost: Costing, plan, key: str) -> dict | None:
    """The profile's figures for this placement (key "target" or a draft's), None where it measured none."""
    t = cost.timings   # measured for a placement: [resident, RAM, disk] layer counts
    if not t or t.get("placement") != [len(plan.resident), len(plan.ram_layers), len(plan.disk_layers)]:
        return None
    return (t.get("draft") or {}).get(key) if key != "target" else ({"seconds": t["target_seconds"]}
                                                                     if t.get("target_seconds") else None)


def target_seconds(cost: Costing, plan, n: int) -> tuple[float, dict, str]:
    """(pass seconds, modelled PassTerms as JSON, "measured" | "modelled") for a pass of n tokens."""
    if getattr(plan, "experts", None):  # a mixture of experts: priced by the distinct experts its tokens route to
        terms = pass_terms(cost.arch, plan, cost.dev, n, model_ctx(plan), cost.c)
    else:
        terms = target_pass(cost.arch, plan, cost.dev, n, model_ctx(plan), cost.c, cost.kernel)
    got = measured(cost, plan, "target")
    if got:
        return interpolate({int(k): v for k, v in got["seconds"].items()}, n), terms.to_json(), "measured"
    return terms.seconds, terms.to_json(), "modelled"


def tree_seconds(spec: Spec, cost: Costing, plan, budget: int) -> tuple[float, str]:
    """(draft seconds per tree, "measured" | "modelled")."""
    if spec.draft == PLAIN:
        return 0.0, "modelled"
    forwards = forwards_per_tree(budget, cost.max_beams, spec.tpp(budget))
    got = measured(cost, plan, spec.key) if spec.key else None
    for key in ("pass_seconds", "grow_seconds"):   # a run's own draft figure per pass (tools/modeltimes.py)
        if got and got.get(key):
            return interpolate({int(k): v for k, v in got[key].items()}, budget), "measured"
    if got and got.get("step_seconds"):
        return forwards * got["step_seconds"], "measured"
    step = draft_step(spec.weight, spec.kv, spec.dequant, spec.flops_per_node * draft_rows(budget, cost.max_beams),
                      cost.dev, cost.c, spec.kernel, spec.packed, spec.stack)
    return forwards * step, "modelled"


def hidden_seconds(plan, draft_s: float, m: Device) -> float:
    """Draft time under which the stream fills the free staging slots with the next pass's layers (see the
    contract; from disk on a CPU a 5-node verify pass waited 3 ms for its layers where a plain step waits 19)."""
    if not (plan.ram_layers or plan.disk_layers) or (m.kind != "cuda" and (plan.ram_layers or not plan.disk_layers)):
        return 0.0
    rate = m.link_bps if plan.ram_layers else m.disk_bps
    return min(draft_s, plan.device_bytes.get("staging_slots", 0) / rate)


def evaluate(spec: Spec, cost: Costing, plan, budget: int) -> Candidate:
    """The candidate `spec` under `plan` at `budget` (plain decoding: 1 token, budget 0)."""
    plain = spec.draft == PLAIN
    n = 1 if plain else budget + 1
    t_pass, terms, pass_src = target_seconds(cost, plan, n)
    t_draft, draft_src = tree_seconds(spec, cost, plan, budget)
    # what the draft hides is stream time only: the pass still computes (its modelled compute terms)
    compute = terms["gemm"] + terms["dequant"] + terms["attention"] + terms["head"] + terms["floor"] + terms["experts"]
    hidden = min(hidden_seconds(plan, t_draft, cost.dev), max(0.0, t_pass - compute))
    tpp = spec.tpp(budget)
    rate = tpp / (t_pass + t_draft - hidden) if plan.fits and tpp > 0 else 0.0
    return Candidate(spec.draft, spec.bits, tpp, t_pass, t_draft, rate, plan.fits,
                     0 if plain else forwards_per_tree(budget, cost.max_beams, tpp), spec.weight, spec.kv, spec.dequant,
                     hidden, len(plan.resident), 0 if plain else budget, spec.kernel, terms,
                     {"pass": pass_src, "draft": draft_src})


def sweep(spec: Spec, cost: Costing, plan, auto: bool) -> Candidate:
    """The candidate at the plan's budget with its tokens/s at BUDGETS up to it; `auto` (--budget auto): at
    the budget with the most modelled tokens/s."""
    budgets = sorted({b for b in BUDGETS if b < plan.budget} | {plan.budget})
    rows = [evaluate(spec, cost, plan, b) for b in budgets]
    top = max(rows, key=lambda c: c.tokens_per_second) if auto else rows[-1]
    top.by_budget = [{"budget": c.budget, **{k: float(f"{getattr(c, k):.6g}") for k in (
        "tokens_per_pass", "pass_seconds", "draft_seconds", "hidden_seconds", "tokens_per_second")}} for c in rows]
    return top


def best(cands: list[Candidate]) -> Candidate | None:
    """The fitting candidate with the most modelled tokens/s (the first listed on a tie)."""
    fitting = [c for c in cands if c.fits and c.tokens_per_second > 0]
    return max(fitting, key=lambda c: c.tokens_per_second) if fitting else None


def finish(plan, cands: list[Candidate], cost: Costing) -> Candidate | None:
    """Set plan.candidates (plain decoding listed last) and plan.choice (the best draft); returns it."""
    top = best(cands)
    plain = evaluate(Spec(PLAIN, None, "", lambda _b: 1.0), cost, plan, 0)
    plan.candidates = [c.to_json() for c in cands + [plain]]
    plan.choice = top.to_json() if top else None
    return top


def self_forward_bytes(a, plan, bits: int, c: int, nf4_target: bool, device: str = "cuda") -> tuple[int, int, int]:
    """(weight, KV, dequantization) bytes of one self-draft forward: the resident layers, the substitutes and
    the head; the shared KV of every layer it runs; the substitutes' (and an nf4 target's) dequantization."""
    run = len(plan.layer_bytes) - len(plan.skipped_layers)
    n_sub = run - len(plan.resident)
    # substitutes dequantized once at load (plan.dense_draft_layers) read their linears in c bytes, undequantized
    n_dense = min(n_sub, len(getattr(plan, "dense_draft_layers", ())))
    packed = plan.device_bytes.get("draft", 0) * (n_sub - n_dense) / max(n_sub, 1)
    weight = (sum(plan.layer_bytes[i] for i in plan.resident) + int(packed) + n_dense * linear_weights(a) * c
              + a.vocab * a.hidden * c)
    kv = 2 * run * a.kv_heads * a.head_dim * model_ctx(plan) * c
    dequant = linear_weights(a) * c * ((n_sub - n_dense) * dequant_elems(substitute_kernel(bits, device), device)
                                     + (len(plan.resident) * DEQUANT_ELEMS["nf4-dequant"] if nf4_target else 0))
    return weight, kv, dequant


def skip_spec(a, plan, cost: Costing) -> Spec:
    from offload.selfdraft.build import LAYER_SKIP

    skipped, dense = set(plan.skipped_layers), set(getattr(plan, "dense_layers", ()))
    kept = [i for i in range(len(plan.layer_bytes)) if i not in skipped]
    run = len(kept)
    head = a.vocab * a.hidden * cost.c
    # a layer dequantized once at load (plan.dense_layers) reads its linears in c bytes, with no dequantization
    weight = sum(linear_weights(a) * cost.c if i in dense else plan.layer_bytes[i] for i in kept) + head
    kv = 2 * run * a.kv_heads * a.head_dim * model_ctx(plan) * cost.c
    undone = sum(1 for i in kept if i not in dense)  # layers not dequantized once
    dequant = undone * linear_weights(a) * cost.c * dequant_elems(cost.kernel, cost.dev.kind)
    flops = 2.0 * (linear_weights(a) * run + a.hidden * a.vocab)
    tpp = lambda b: tokens_per_pass("skip", cost.temperature, b)   # noqa: E731
    k = getattr(plan, "kernel", None) or {}
    if k.get("stack") and cost.max_beams <= k.get("rows", 0):
        # the kept layers on the one-call stack: their packed bytes and the packed head through the kernel
        factor = k.get("cost", {})    # per type: ggml_kernel.COST
        packed = (sum(plan.layer_bytes[i] * factor.get(i, 1.0) for i in kept)
                  + k.get("head_bytes", 0) * k.get("head_cost", 1.0))
        return Spec("self", LAYER_SKIP, "self-skip", tpp, 0, kv, 0, flops, cost.kernel, packed, stack=True)
    return Spec("self", LAYER_SKIP, "self-skip", tpp, weight, kv, dequant, flops, cost.kernel)


def small_forward_bytes(da, draft_param_bytes: int, ctx: int, dc: int) -> tuple[int, int, int]:
    """(weight, KV, dequantization) bytes of one forward of a small 16/32-bit draft: its parameters
    (an untied input embedding is only looked up, so left out), its own KV at the full context, none."""
    weight = draft_param_bytes - (0 if da.tied else da.vocab * da.hidden * dc)
    return weight, kv_bytes(da, ctx, dc), 0


def small_candidates(plan, target, draft, req, plan_memory) -> None:
    """Set `plan.candidates` / `plan.choice` for a plan with a small draft: its candidate, plain decoding, and
    (`req.compare_self`, something streamed) the self-draft's widths, each planned by `plan_memory`."""
    da, dc = arch_of(draft.config), dtype_bytes(req.draft_dtype)
    weight, kv, deq = small_forward_bytes(da, draft_bytes(draft, req.draft_dtype), model_ctx(plan), dc)
    cost = costing_for(arch_of(target.config), req)
    spec = Spec(str(draft.root), None, "small", lambda b: tokens_per_pass("small", req.temperature, b), weight, kv,
                deq, 2.0 * weight / dc)
    cands = [sweep(spec, cost, plan, req.budget_auto)]
    if req.compare_self and (plan.ram_layers or plan.disk_layers):
        own_dtype = req.dtype if req.dtype != "nf4" else ("bf16" if req.device == "cuda" else "fp32")
        own = plan_memory(target, None, replace(req, self_draft=True, draft_dtype=own_dtype, compare_self=False))
        cands += [Candidate(**c) for c in own.candidates if c["draft"] != PLAIN]
    if req.budget_auto and cands[0].fits:
        plan.budget = cands[0].budget
    top = finish(plan, cands, cost)
    if top is not None and top is not cands[0]:
        plan.notes.append(f"draft cost model: the self-draft at {top.bits} bits is modelled faster "
                          f"({top.tokens_per_second:.2f} against {cands[0].tokens_per_second:.2f} tokens/s for "
                          f"{cands[0].draft}); --draft self (or no --draft) uses it")
