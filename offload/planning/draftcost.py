"""The draft cost model: what a candidate draft costs per target pass, and the tokens/s it buys.

Contract (every figure is modelled from byte counts and bandwidths, none is measured here):
- `Machine`: the bandwidths a plan is for: device memory (`specx profile` measures it; `--gpu NAME`
  takes the published figure of a card from profiles/cards.json; else DEVICE_BPS), the host->device
  link and disk reads (LINK_BPS / DISK_BPS priors, or the card's published PCIe rate).
- `draft_seconds(forwards, weight, kv, dequant, bps)` = forwards per tree x (weight bytes + KV bytes
  read per draft forward + dequantization traffic) / device memory bandwidth.
- `forwards_per_tree(budget, max_beams)` = 1 (the pending tokens) + ceil(budget / max_beams): the draft
  grows its tree max_beams nodes per forward (core/draft.grow_tree) until it holds `budget` nodes.
- `pass_seconds(plan, m)` = FLOOR_S + max(stream seconds, target compute seconds): streamed RAM-tier bytes
  over the link plus disk bytes over the disk, overlapped with the target reading every layer, its
  KV cache and head from device memory.
- `hidden_seconds(plan, draft_s, m)`: the part of the draft's time the weight stream hides: while the
  draft grows its tree the prefetcher fills the free staging slots with the next pass's first layers
  (offload/stream/prefetch.py), so up to staging_slots bytes / (link or disk rate) of the next pass's stream
  runs under the draft.
- tokens/s = tokens per pass / (pass seconds + draft seconds - hidden seconds).
- `tokens_per_pass(kind, bits, temperature, budget)`: measured on the shared pair (TOKENS_PER_PASS,
  log-linear in the budget between the measured budgets, clamped at the ends); for a self-draft that
  skips layers, scaled by selfplan.skip_factor.
- `Candidate` holds one candidate's five figures and the inputs behind them; `best(cands)` is the
  fitting candidate with the most modelled tokens/s. `small_candidates` fills a small draft's plan
  with its candidate and the self-draft's widths (offload/planning/selfplan.py models those for --draft self).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from offload.planning.membytes import substitute_kernel

FLOOR_S = 0.05                              # per-pass latency streaming does not hide (kernel launches, sync)
DEVICE_BPS = {"cuda": 1000e9, "cpu": 20e9}  # device memory bandwidth priors (a 4090-class card; DDR4/5 host)
LINK_BPS = {"cuda": 24e9, "cpu": 10e9}      # RAM tier -> compute device (PCIe 4 x16 effective; memcpy)
DISK_BPS = {"cuda": 3e9, "cpu": 2e9}        # NVMe O_DIRECT reads
LINK_EFFICIENCY = 0.75                      # effective / published PCIe x16 rate (24 of 32 GB/s on PCIe 4)

DEQUANT_ELEMS = {"hqq-eager": 6, "nf4-dequant": 2, "hqq-compiled": 2, "none": 0}
"""Compute-dtype elements written or read per weight by a dequantizing linear, beyond its packed bytes:
hqq-eager (offload/quant/lowbit.LowbitLinear's reference: unpack writes 1, sub_ reads and writes 2, mul_ 2,
the matmul reads 1), nf4-dequant (bitsandbytes above a few tokens: dequantize writes 1, the matmul reads 1),
hqq-compiled (offload/quant/fused.py: the compiled kernel writes the weight, the matmul reads it; on CPU
Inductor's dynamic-shape graph writes it twice, see `dequant_elems`), none (a 16-bit weight)."""


def dequant_elems(kernel: str, device: str) -> int:
    """DEQUANT_ELEMS on `device`: the compiled HQQ graph on CPU writes the weight twice ((rows, group),
    then the (in, out) operand) and the matmul reads it once: 3 (offload/quant/fused.py's docstring).
    Which kernel a run uses is membytes.substitute_kernel(bits, device): on CPU, eager unless
    $SPECX_LOWBIT_KERNEL=fused."""
    return 3 if kernel == "hqq-compiled" and device == "cpu" else DEQUANT_ELEMS[kernel]

TOKENS_PER_PASS = {
    "small": {"greedy": {16: 4.388, 64: 5.436, 256: 6.695, 1024: 7.848},
              "sampled": {16: 2.721, 64: 3.308, 256: 4.018, 1024: 4.653}},
    4: {"greedy": {16: 12.548, 64: 24.225, 256: 33.262, 1024: 39.914},
        "sampled": {16: 11.7, 64: 19.522, 256: 28.508, 1024: 30.966}},
    3: {"greedy": {16: 10.802, 64: 18.065, 256: 23.812, 1024: 28.128},
        "sampled": {16: 9.234, 64: 14.254, 256: 19.956, 1024: 22.734}},
    2: {"greedy": {16: 8.433, 64: 13.39, 256: 17.176, 1024: 20.444},
        "sampled": {16: 6.664, 64: 9.63, 256: 12.604, 1024: 14.426}},
}
"""Tokens per target pass by draft and budget, measured on the shared pair (bench/selfdraft.py, specexec,
40 prompts, 128 new tokens, gap-featured node scores, shared KV): "small" = the 2.9M shared draft, 4 = nf4
substitutes of every layer, 3 / 2 = HQQ; greedy at T = 0 (bench/results/selfdraft_t0_gap*.json), sampled at
T = 0.7 (selfdraft_t07_gap*.json). A prior for other pairs: a 1B draft of a 70B is not the 2.9M of a 15.7M."""


@dataclass(frozen=True)
class Machine:
    """The bandwidths a plan is modelled with."""

    memory_bps: float   # device memory bandwidth, bytes/s (CPU: host memory)
    link_bps: float     # RAM tier -> device, bytes/s
    disk_bps: float     # disk reads, bytes/s
    source: str         # where memory_bps comes from: "measured: ...", "published: ...", "prior"


def machine_for(device: str, memory_bps: float | None = None, link_bps: float | None = None,
                source: str = "") -> Machine:
    """Given figures where known, the priors for `device` for the rest."""
    return Machine(memory_bps or DEVICE_BPS[device], link_bps or LINK_BPS[device], DISK_BPS[device],
                   source if memory_bps else "prior")


@dataclass
class Candidate:
    """One candidate draft with its modelled figures and the inputs behind them."""

    draft: str                  # "self" or the --draft directory as given
    bits: int | None            # substitute bits of a self-draft; None for a small draft (its own dtype)
    tokens_per_pass: float      # expected tokens emitted per target pass
    pass_seconds: float         # modelled target pass (streaming overlapped with compute)
    draft_seconds: float        # modelled tree growth per pass
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

    def to_json(self) -> dict:
        return {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def line(self) -> str:
        """One dry-run line with the five figures, marked as modelled."""
        name = f"self-draft {self.bits}-bit" if self.draft == "self" else f"draft {self.draft}"
        if not self.fits:
            return f"{name}: does not fit"
        return (f"{name}: {self.tokens_per_pass:.1f} tokens/pass, pass {self.pass_seconds:.2f} s, draft "
                f"{self.draft_seconds:.2f} s ({self.hidden_seconds:.2f} s hidden) -> {self.tokens_per_second:.2f} "
                f"tokens/s (modelled)")


def forwards_per_tree(budget: int, max_beams: int) -> int:
    return 1 + math.ceil(budget / max(1, max_beams))


def draft_seconds(forwards: int, weight: int, kv: int, dequant: int, bps: float) -> float:
    return forwards * (weight + kv + dequant) / bps


def stream_seconds(plan, m: Machine) -> float:
    ram = sum(plan.layer_bytes[i] for i in plan.ram_layers)
    return ram / m.link_bps + plan.disk_bytes_per_pass / m.disk_bps


def pass_seconds(plan, m: Machine) -> float:
    """FLOOR_S + max(streaming, the target reading its layers, KV cache and head from device memory)."""
    dev = plan.device_bytes
    compute = (sum(plan.layer_bytes) + dev.get("kv_target", 0) + dev.get("lm_head", 0)
               + dev.get("embeddings", 0) * (dev.get("lm_head", 0) == 0)) / m.memory_bps
    return FLOOR_S + max(stream_seconds(plan, m), compute)


def hidden_seconds(plan, draft_s: float, m: Machine) -> float:
    """Draft time under which the stream fills the free staging slots with the next pass's layers."""
    if not (plan.ram_layers or plan.disk_layers):
        return 0.0
    rate = m.link_bps if plan.ram_layers else m.disk_bps
    return min(draft_s, plan.device_bytes.get("staging_slots", 0) / rate)


def tokens_per_pass(kind, temperature: float, budget: int) -> float:
    """TOKENS_PER_PASS[kind] at `budget`: log-linear between measured budgets, clamped at the ends."""
    row = TOKENS_PER_PASS[kind]["sampled" if temperature > 0 else "greedy"]
    pts = sorted(row.items())
    b = max(pts[0][0], min(pts[-1][0], max(1, budget)))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if b <= x1:
            return y0 + (y1 - y0) * (math.log(b) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return pts[-1][1]


def candidate(draft: str, bits: int | None, tpp: float, plan, m: Machine, forwards: int, weight: int, kv: int,
              dequant: int, kernel: str = "none") -> Candidate:
    """The five figures of one candidate from its plan and the bytes of one draft forward."""
    t_pass = pass_seconds(plan, m)
    t_draft = draft_seconds(forwards, weight, kv, dequant, m.memory_bps)
    hidden = hidden_seconds(plan, t_draft, m)
    rate = tpp / (t_pass + t_draft - hidden) if plan.fits and tpp > 0 else 0.0
    return Candidate(draft, bits, tpp, t_pass, t_draft, rate, plan.fits, forwards, weight, kv, dequant, hidden,
                     len(plan.resident), plan.budget, kernel)


def best(cands: list[Candidate]) -> Candidate | None:
    """The fitting candidate with the most modelled tokens/s (the first listed on a tie)."""
    fitting = [c for c in cands if c.fits and c.tokens_per_second > 0]
    return max(fitting, key=lambda c: c.tokens_per_second) if fitting else None


def linear_numel(a) -> int:
    """Weights of one decoder layer's linears: q and o (hidden x heads*hd), k and v (hidden x kv*hd), the MLP."""
    return 2 * a.hidden * a.heads * a.head_dim + 2 * a.hidden * a.kv_heads * a.head_dim + 3 * a.hidden * a.intermediate


def self_forward_bytes(a, plan, bits: int, c: int, nf4_target: bool, device: str = "cuda") -> tuple[int, int, int]:
    """(weight, KV, dequantization) bytes of one self-draft forward: the resident target layers, the
    substitutes and the head; the shared KV of every layer it runs at the full planned context; the
    dequantization traffic of the substitutes (and of an nf4 target's resident layers)."""
    run = len(plan.layer_bytes) - len(plan.skipped_layers)
    n_sub = run - len(plan.resident)
    weight = sum(plan.layer_bytes[i] for i in plan.resident) + plan.device_bytes.get("draft", 0) + a.vocab * a.hidden * c
    kv = 2 * run * a.kv_heads * a.head_dim * plan.ctx * c
    dequant = linear_numel(a) * c * (n_sub * dequant_elems(substitute_kernel(bits, device), device)
                                     + (len(plan.resident) * DEQUANT_ELEMS["nf4-dequant"] if nf4_target else 0))
    return weight, kv, dequant


def small_forward_bytes(da, draft_param_bytes: int, ctx: int, dc: int) -> tuple[int, int, int]:
    """(weight, KV, dequantization) bytes of one forward of a small 16/32-bit draft: its parameters
    (an untied input embedding is only looked up, so left out), its own KV at the full context, none."""
    weight = draft_param_bytes - (0 if da.tied else da.vocab * da.hidden * dc)
    return weight, 2 * da.layers * da.kv_heads * da.head_dim * ctx * dc, 0


def small_candidates(plan, target, draft, req, plan_memory) -> None:
    """Set `plan.candidates` / `plan.choice` for a plan with a small draft: its candidate, and
    (`req.compare_self`, something streamed) the self-draft's widths, each planned on its own by
    `plan_memory` (memplan's); the choice is the one with the most modelled tokens/s."""
    from dataclasses import replace

    from offload.planning.membytes import arch_of, draft_bytes, dtype_bytes

    m = machine_for(req.device, req.memory_bps, req.link_bps, req.bandwidth_source)
    da, dc = arch_of(draft.config), dtype_bytes(req.draft_dtype)
    weight, kv, deq = small_forward_bytes(da, draft_bytes(draft, req.draft_dtype), plan.ctx, dc)
    cands = [candidate(str(draft.root), None, tokens_per_pass("small", req.temperature, plan.budget), plan, m,
                       forwards_per_tree(plan.budget, req.max_beams), weight, kv, deq)]
    if req.compare_self and (plan.ram_layers or plan.disk_layers):
        own_dtype = req.dtype if req.dtype != "nf4" else ("bf16" if req.device == "cuda" else "fp32")
        own = plan_memory(target, None, replace(req, self_draft=True, draft_dtype=own_dtype, compare_self=False))
        cands += [Candidate(**c) for c in own.candidates]
    plan.candidates = [c.to_json() for c in cands]
    top = best(cands)
    plan.choice = top.to_json() if top else None
    if top is not None and top is not cands[0]:
        plan.notes.append(f"draft cost model: the self-draft at {top.bits} bits is modelled faster "
                          f"({top.tokens_per_second:.2f} against {cands[0].tokens_per_second:.2f} tokens/s for "
                          f"{cands[0].draft}); --draft self (or no --draft) uses it")
