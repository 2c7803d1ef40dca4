"""The pass model: what one target pass and one draft forward cost, term by term, on one device.

Contract (a roofline per layer; every figure is modelled, each rate says where it comes from):
- `Device`: the rates -- device memory, host->device link and disk bytes/s, the disk's latency per read
  request (`disk_read_s`), matmul FLOP/s per compute dtype (16-bit: a card's tensor rate with FP32
  accumulate; 32-bit: FP32), the per-forward floors streaming does not hide -- and in `sources` each
  term's origin: "measured: ..." (`specx profile`), "published: ..." (profiles/cards.json) or "prior"
  (PRIORS). `device_for(kind, **given)` fills the rest from PRIORS; `device_of(req)` is a PlanRequest's.
- `model_ctx(plan)`: the context a pass is priced at (MODEL_CTX_SHARE of the planned one, at most
  MODEL_CTX_CAP tokens).
- `target_pass(a, plan, dev, n, ctx, c, kernel)` -> PassTerms of one DENSE target pass of n tokens at ctx
  committed tokens, compute dtype c bytes: per layer max(transfer_i, compute_i), summed (layer i+1
  streams while layer i computes), plus the head and one forward floor (`floor_term` names which).
  transfer_i = its bytes over the link (RAM tier) or the disk, 0 if resident. compute_i = max(2 x linear
  weights x n FLOPs / FLOP/s, weight bytes / memory bandwidth) + dequantization traffic (weights x c x
  dequant_elems(kernel); none for nf4 up to NF4_GEMV_TOKENS) at the kernel's rate (`Device.dequant_bps`,
  else memory bandwidth) + attention (4 x n x (ctx + n) x heads x head_dim FLOPs + K/V bytes,
  2 x (ctx + n) x kv_heads x head_dim x c). A layer dequantized once at load (`plan.dense_layers`) reads
  c bytes per weight and no dequantization; a layer or head the GGUF CPU kernel multiplies packed
  (`plan.kernel`) reads its packed bytes at the kernel's rate. Head = max(2 x n x hidden x vocab FLOPs,
  its bytes / memory bandwidth).
- `draft_step(weight, kv, dequant, flops, dev, c, kernel, packed, stack)` -> seconds of one draft forward =
  max(bytes / memory bandwidth (+ packed GGUF bytes at the kernel's rate), FLOPs / FLOP/s, the step floor
  or the one-call stack's); a tree costs forwards x that.
- PassTerms.seconds is the modelled pass; `bound` names the side that dominates it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

NF4_GEMV_TOKENS = 4  # bitsandbytes runs its fused 4-bit GEMV up to this many tokens: no 16-bit weight written

DISK_READ_S = 1e-4
"""Seconds one read request costs beyond its bytes where `specx profile` (tools/profiler.read_latency) did not
measure it: an NVMe drive answers a 4 KiB read in ~60-100 us, this machine's virtual disk in 59 us. Routed experts
read on demand pay it per file span (planning/expertcost.py)."""

STACK_FLOOR_CPU = 0.0018  # s: a SmolLM2-135M pass on the one-call stack beyond its matmuls (bench/pass_breakdown.py)

PRIORS = {
    "cuda": dict(
        memory_bps=1000e9,
        link_bps=24e9,
        disk_bps=3e9,
        flops16=165e12,
        flops32=82e12,
        forward_floor_s=0.01,
        step_floor_s=0.006,
        stack_floor_s=0.01,
        disk_read_s=DISK_READ_S,
    ),
    "cpu": dict(
        memory_bps=20e9,
        link_bps=10e9,
        disk_bps=2e9,
        flops16=5e9,
        flops32=100e9,
        forward_floor_s=0.01,
        step_floor_s=0.01,
        stack_floor_s=STACK_FLOOR_CPU,
        disk_read_s=DISK_READ_S,
    ),
}
"""Priors where neither a profile nor a card says: a 4090-class card (1 TB/s, 165 TFLOP/s bf16 with FP32
accumulate, PCIe 4 at 75%, NVMe) and a desktop CPU (DDR4/5, AVX2/512 fp32 GEMM; bf16 without native units
runs ~20x slower). Floors: a CUDA target pass pays its launches and two host syncs (~10 ms for 80 layers), a
1B draft step ~5-8 ms; on a CPU 10 ms is the measured floor of a SmolLM2-135M plain pass beyond its matmuls
(bench/results/pass_breakdown.json), and stack_floor_s the same for a pass the one-call stack runs
(cpu/leanstack.py; CUDA never runs it). `specx profile`'s measurements replace them all."""


@dataclass(frozen=True)
class Device:
    """The rates a pass is modelled with, and where each comes from."""

    kind: str  # "cuda" | "cpu"
    memory_bps: float  # device memory bandwidth, bytes/s (CPU: host memory)
    link_bps: float  # RAM tier -> device, bytes/s
    disk_bps: float  # disk reads, bytes/s
    flops16: float  # dense 16-bit matmul FLOP/s (card: published tensor rate, FP32 accumulate)
    flops32: float  # dense fp32 matmul FLOP/s
    forward_floor_s: float  # per target forward: launches, syncs, dispatch that streaming does not hide
    step_floor_s: float  # per draft forward: the same floor for one tree-growth step
    stack_floor_s: float  # per target forward the one-call stack runs (plan.kernel["stack"], n <= its rows)
    disk_read_s: float  # per disk read request, beyond its bytes (DISK_READ_S where not measured)
    source: str = "prior"  # origin of memory_bps (the figure the plan's caption shows)
    sources: dict = field(default_factory=dict)  # term -> "measured: ..." | "published: ..." | "prior"
    dequant_bps: dict = field(default_factory=dict)  # kernel -> measured rate of its traffic; else memory_bps

    def dequant_rate(self, kernel: str) -> float:
        """Bytes/s the dequantization traffic of `kernel` moves at: measured where profiled, else memory bandwidth."""
        return self.dequant_bps.get(kernel) or self.memory_bps

    def flops(self, c: int) -> float:
        """FLOP/s of matmuls in a c-byte compute dtype."""
        return self.flops16 if c <= 2 else self.flops32


TERMS = tuple(PRIORS["cpu"])  # the rates a Device holds, each with its prior


def device_for(kind: str, sources: dict | None = None, dequant_bps: dict | None = None, **given) -> Device:
    """A Device of `kind` with the `given` rates (None = unknown) and PRIORS for the rest; `sources` names each
    given rate's origin (default "measured"); `dequant_bps` the measured kernel rates."""
    vals, srcs = {}, {}
    for term in TERMS:
        v = given.get(term)
        vals[term] = v if v else PRIORS[kind][term]
        srcs[term] = (sources or {}).get(term, "measured") if v else "prior"
    if dequant_bps:
        srcs["dequant"] = (sources or {}).get("dequant", "measured")
    return Device(kind, **vals, source=srcs["memory_bps"], sources=srcs, dequant_bps=dict(dequant_bps or {}))


def device_of(req) -> Device:
    """A PlanRequest's Device: its `cost_device` (session/profiles.plan_device builds it from a profile or a
    card), else its bandwidths where known (from `req.bandwidth_source`) over PRIORS."""
    if getattr(req, "cost_device", None):
        return req.cost_device
    src = req.bandwidth_source or "measured"
    given = {"memory_bps": src, "link_bps": src}
    return device_for(req.device, given, memory_bps=req.memory_bps, link_bps=req.link_bps)


MODEL_CTX_SHARE = 0.5  # attention is modelled at this share of the planned context (a cache filling up)
MODEL_CTX_CAP = 1024  # ... and at most at this many tokens: a chat turn's context, not the window's


def model_ctx(plan) -> int:
    """Context tokens a pass's attention and KV reads are priced at (on SmolLM2 from disk a self-draft forward
    measured 13 ms where pricing its KV at half the 8192-token window modelled 24)."""
    return min(int(plan.ctx * MODEL_CTX_SHARE), MODEL_CTX_CAP)


@dataclass
class PassTerms:
    """One modelled target pass, term by term (seconds summed over the layers)."""

    tokens: int  # n tree tokens the pass verifies (root included)
    ctx: int  # committed tokens in the cache
    stream: float  # sum of the streamed layers' transfer seconds
    gemm: float  # sum of max(GEMM FLOPs / FLOP/s, weight bytes / memory bandwidth)
    dequant: float  # sum of dequantization traffic / memory bandwidth
    attention: float  # sum of attention FLOPs / FLOP/s + K/V bytes / memory bandwidth
    head: float  # the lm_head over the n rows
    floor: float  # the per-forward floor
    seconds: float  # floor + head + sum over layers of max(transfer, compute)
    bound: str  # "stream" if the transfers dominate the sum, else "compute"
    flops: float = 0.0  # the matmul FLOP/s of the pass's compute dtype (Device.flops(c))
    experts: float = 0.0  # MoE: routed experts' seconds, by the distinct experts routed (planning/experts.py)
    routed: str = ""  # MoE: where the routed experts ran ("gpu", "cpu", "stream"; experts.pass_terms)
    floor_term: str = "forward_floor_s"  # the Device term `floor` is (floor_term; "stack_floor_s": the stack's)

    def to_json(self) -> dict:
        return {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in asdict(self).items()}


DEQUANT_ELEMS = {"hqq-eager": 6, "nf4-dequant": 2, "hqq-compiled": 2, "int4-unpack": 3, "mxfp4": 6, "none": 0}
"""Compute-dtype elements written or read per weight by a dequantizing linear, beyond its packed bytes:
hqq-eager (quant/lowbit's reference: unpack 1, sub_ 2, mul_ 2, the matmul's read 1); nf4-dequant (above
NF4_GEMV_TOKENS: write 1, read 1); mxfp4 off the CPU (formats/mxfp4: gather 1, scale 2, transposed copy 2,
read 1); hqq-compiled (quant/fused.py: write 1, read 1); int4-unpack (formats/packed.py: the weight written,
then read); none (a 16-bit weight). On the CPU: `dequant_elems`."""


GGUF_KERNEL = "gguf-kernel"
"""The exact GGUF CPU kernel (cpu/ggml_kernel.py) dequantizes in registers: no dequantization traffic; its
packed bytes move at `Device.dequant_rate(GGUF_KERNEL)` (`specx profile`'s Q4_1 GEMV, else memory bandwidth)
times the type's factor (plan.kernel's `cost` and `head_cost`: ggml_kernel.COST)."""


def dequant_elems(kernel: str, device: str) -> int:
    """DEQUANT_ELEMS on `device`: on CPU the compiled HQQ graph writes the weight twice and the matmul reads
    it once (3); MXFP4 (cpu/mxfp4_kernel.py) writes the transposed weight once, read once (2)."""
    if device == "cpu" and kernel in ("hqq-compiled", "mxfp4"):
        return 3 if kernel == "hqq-compiled" else 2
    return DEQUANT_ELEMS[kernel]


def interpolate(points: dict, x: float) -> float:
    """Log-log interpolation of measured {x: seconds}; flat below the first point, proportional above the last."""
    import math

    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]] * x / xs[-1]
    hi = next(i for i, v in enumerate(xs) if v >= x)
    x0, x1 = xs[hi - 1], xs[hi]
    y0, y1 = max(points[x0], 1e-12), max(points[x1], 1e-12)
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))


def linear_weights(a) -> int:
    """Weights of one decoder layer's linears: q and o (hidden x heads*hd), k and v (hidden x kv*hd), the MLP."""
    return 2 * a.hidden * a.heads * a.head_dim + 2 * a.hidden * a.kv_heads * a.head_dim + 3 * a.hidden * a.intermediate


def dequant_bytes(a, kernel: str, c: int, n: int, device: str) -> int:
    if kernel == "nf4-dequant" and n <= NF4_GEMV_TOKENS:
        return 0
    return linear_weights(a) * c * dequant_elems(kernel, device)


def attention_seconds(a, n: int, ctx: int, c: int, dev: Device) -> float:
    """One layer's attention over n new tokens against ctx + n keys: FLOPs at the matmul rate plus K/V reads."""
    keys = ctx + n
    return 4 * n * keys * a.heads * a.head_dim / dev.flops(c) + 2 * keys * a.kv_heads * a.head_dim * c / dev.memory_bps


def floor_term(plan, n: int) -> str:
    """The Device floor a target pass of n tokens pays: "stack_floor_s" where the one-call stack runs the
    pass (plan.kernel["stack"] and n within the kernel's rows), else the layer-by-layer forward's."""
    k = getattr(plan, "kernel", None) or {}
    return "stack_floor_s" if k.get("stack") and n <= k.get("stack_rows", k.get("rows", 0)) else "forward_floor_s"


def forward_floor(plan, dev: Device, n: int) -> float:
    """Seconds of the per-forward floor a target pass of n tokens pays (`floor_term`)."""
    return getattr(dev, floor_term(plan, n))


def target_pass(a, plan, dev: Device, n: int, ctx: int, c: int, kernel: str = "none") -> PassTerms:
    if getattr(plan, "experts", None):
        raise ValueError("a mixture-of-experts plan: experts.pass_terms prices its passes")
    ram, disk = set(plan.ram_layers), set(plan.disk_layers)
    dense = set(getattr(plan, "dense_layers", ()))  # dequantized once at load: read in c, no dequantization
    # the GGUF CPU kernel (plan.kernel) reads these layers' packed bytes at its own rate: up to kernel["rows"]
    # tokens every layer it serves, above them only those without an fp32 copy dequantized once at load
    k = getattr(plan, "kernel", None) or {}
    small = n <= k.get("rows", 0)
    packed = {i for i in k.get("layers", ()) if small or i not in dense}
    kcost = k.get("cost", {})  # per type (ggml_kernel.COST)
    head_packed = k.get("head_bytes", 0) * k.get("head_cost", 1.0) if small else 0
    flops = 2 * linear_weights(a) * n / dev.flops(c)
    deq = dequant_bytes(a, kernel, c, n, dev.kind) / dev.dequant_rate(kernel)
    attn = attention_seconds(a, n, ctx, c, dev)
    total = stream = gemm_s = deq_s = 0.0
    for i, size in enumerate(plan.layer_bytes):
        rate = dev.link_bps if i in ram else dev.disk_bps if i in disk else 0.0
        transfer = size / rate if rate else 0.0
        if i in packed:
            read, layer_deq = size * kcost.get(i, 1.0) / dev.dequant_rate(GGUF_KERNEL), 0.0
        elif i in dense:
            read, layer_deq = linear_weights(a) * c / dev.memory_bps, 0.0
        else:
            read, layer_deq = size / dev.memory_bps, deq
        layer_gemm = max(flops, read)
        total += max(transfer, layer_gemm + layer_deq + attn)
        stream += transfer
        gemm_s += layer_gemm
        deq_s += layer_deq
    layers = len(plan.layer_bytes)
    head_read = head_packed / dev.dequant_rate(GGUF_KERNEL) if head_packed else a.hidden * a.vocab * c / dev.memory_bps
    head = max(2 * n * a.hidden * a.vocab / dev.flops(c), head_read)
    term = floor_term(plan, n)
    floor, attn_s = getattr(dev, term), layers * attn
    bound = "stream" if stream > gemm_s + deq_s + attn_s else "compute"
    return PassTerms(
        n, ctx, stream, gemm_s, deq_s, attn_s, head, floor, floor + head + total, bound, dev.flops(c), floor_term=term
    )


def draft_step(
    weight: int,
    kv: int,
    dequant: int,
    flops: float,
    dev: Device,
    c: int,
    kernel: str = "none",
    packed: int = 0,
    stack: bool = False,
) -> float:
    return max(
        (weight + kv) / dev.memory_bps + dequant / dev.dequant_rate(kernel) + packed / dev.dequant_rate(GGUF_KERNEL),
        flops / dev.flops(c),
        dev.stack_floor_s if stack else dev.step_floor_s,
    )
