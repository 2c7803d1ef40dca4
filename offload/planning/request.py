"""The plan's request and result types, and the device-memory margins every placement shares.

Contract: `PlanRequest` is the user's options, resolved; `MemoryPlan` the plan memplan.plan_memory
returns. The CUDA margin (`cuda_margin`) is CUDA_CONTEXT + STATIC_SLACK of the long-lived device bytes +
CHURN_SLACK of the activations; RAM_FRACTION of available RAM is what specx allows itself without --max-ram
(`capacity` on a CPU, `ram_cap` for the host tiers). Pure data and arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from offload.errors import OffloadError

CUDA_CONTEXT = 600 * 1024**2  # CUDA context, cuBLAS/cuBLASLt workspaces (measured ~0.5 GB on H100)
STATIC_SLACK = 0.02  # caching-allocator rounding of long-lived blocks (weights, caches)
CHURN_SLACK = 0.10  # fragmentation from per-pass temporaries, as a share of activations
RAM_FRACTION = 0.8  # share of available RAM specx allows itself without --max-ram
BUDGET_FLOOR = 16  # --budget auto never shrinks below this to fit


@dataclass(frozen=True)
class PlanRequest:
    """The user's options, resolved (no 'auto' dtype/device left)."""

    device: str  # "cuda" | "cpu": where compute runs
    dtype: str  # target weights: bf16 | fp16 | fp32 | nf4
    draft_dtype: str | None  # draft weights: bf16 | fp16 | fp32; None = no draft
    ram_free: int  # available host RAM (psutil)
    device_free: int | None = None  # free device memory as reported; None = unknown (no GPU here)
    offload: str = "auto"  # none | ram | disk | auto
    ctx: int = 8192  # tokens the KV caches hold (capped by max positions)
    budget: int = 64  # draft tree nodes verified per pass
    budget_auto: bool = False  # the plan may lower `budget` (down to BUDGET_FLOOR) to fit
    max_beams: int = 32  # draft nodes per tree-growth forward
    slots: int = 2  # staging buffers for streamed layers
    max_gpu_memory: int | None = None  # cap on ALL device bytes
    max_ram: int | None = None  # cap on host bytes for streamed layers
    embeddings: str = "auto"  # device | host | packed | auto
    attn: str = "sdpa"  # attention implementation: sdpa | eager
    self_draft: bool = False  # --draft self: the draft is low-bit substitutes of the streamed layers
    draft_bits: int | None = None  # --draft-bits 4 | 3 | 2 of those substitutes; None = the plan chooses
    sixteen_bit: bool = True  # --draft self: a 16-bit checkpoint exists to quantize substitutes from
    temperature: float = 0.0  # decoding temperature: the self-draft widths' tokens/pass depend on it
    memory_bps: float | None = None  # device memory bandwidth for the draft cost model; None = draftcost prior
    link_bps: float | None = None  # host->device bandwidth; None = draftcost prior
    bandwidth_source: str = ""  # where memory_bps comes from ("measured: ...", "published: ...")
    compare_self: bool = False  # with a small draft: also model the self-draft's widths as candidates
    cost_device: object = None  # passcost.Device the candidates are modelled with (None: from the fields above)
    timings: dict | None = None  # a matching profile's measured pass/draft times (session/profiles.plan_timings)


@dataclass
class MemoryPlan:
    device_bytes: dict[str, int]  # component -> bytes on the compute device
    host_bytes: dict[str, int]  # component -> bytes in host RAM (pinned on CUDA)
    device_capacity: int  # the cap all device bytes must fit
    host_capacity: int  # RAM the host components may use
    disk_bytes_per_pass: int  # bytes read from disk per target pass
    resident: list[int]  # layer ids kept on the device
    ram_layers: list[int]  # streamed from host RAM
    disk_layers: list[int]  # streamed from disk
    layer_bytes: list[int]  # packed bytes per layer
    embeddings: str  # "device" | "host" | "packed" (CPU GGUF: formats/packed_globals.py)
    ctx: int  # context the caches are sized for
    budget: int  # tree budget the run starts at (--budget auto: the speed model's pick)
    kv_rows: tuple[int, int]  # (target, draft) rows preallocated per cache
    pass_tokens: int  # most tokens one target pass processes (prefill chunk)
    device: str = "cuda"
    fits: bool = True
    reason: str = ""  # one line when not fits
    notes: list[str] = field(default_factory=list)
    elsewhere: str = ""  # planned for another machine (explicit caps): why THIS host cannot run it
    substitute_bits: int | None = None  # --draft self: the bits of the substitutes this plan counts
    skipped_layers: list[int] = field(default_factory=list)  # --draft self: streamed layers the draft skips
    candidates: list[dict] = field(default_factory=list)  # draftcost.Candidate.to_json() of every candidate draft
    choice: dict | None = None  # the candidate with the most modelled tokens/s (None: no draft fits)
    machine: dict = field(default_factory=dict)  # the passcost.Device the candidates were modelled with
    slots: int = 2  # device staging slots the loader allocates (leftover memory adds some)
    sized_budget: int = 0  # tree budget the activations and caches are sized for (>= budget; 0 = budget)
    row_bytes: int = 0  # device bytes per token of another request's tree in a forest pass
    dense_layers: list[int] = field(default_factory=list)  # resident layers dequantized once at load
    dense_draft_layers: list[int] = field(default_factory=list)  # --draft self: substitutes dequantized once
    kernel: dict = field(default_factory=dict)  # memlayers.kernel_terms: what the GGUF CPU kernel multiplies packed
    experts: dict | None = None  # mixture of experts: planning/experts.expert_plan (placement, modelled speed)
    replaced: MemoryPlan | None = None  # the whole-layer placement a split's bytes replaced (expert_plan's input)

    @property
    def device_total(self) -> int:
        return sum(self.device_bytes.values())

    @property
    def host_total(self) -> int:
        return sum(self.host_bytes.values())

    def to_json(self) -> dict:
        return dict(
            device_bytes=dict(self.device_bytes),
            device_total=self.device_total,
            device_capacity=self.device_capacity,
            host_bytes=dict(self.host_bytes),
            host_total=self.host_total,
            host_capacity=self.host_capacity,
            disk_bytes_per_pass=self.disk_bytes_per_pass,
            resident_layers=len(self.resident),
            streamed_layers={"ram": len(self.ram_layers), "disk": len(self.disk_layers)},
            fits=self.fits,
            embeddings=self.embeddings,
            ctx=self.ctx,
            budget=self.budget,
            sized_budget=self.sized_budget or self.budget,
            kv_rows=list(self.kv_rows),
            pass_tokens=self.pass_tokens,
            device=self.device,
            reason=self.reason,
            notes=list(self.notes),
            elsewhere=self.elsewhere,
            substitute_bits=self.substitute_bits,
            skipped_layers=list(self.skipped_layers),
            layer_bytes_total=sum(self.layer_bytes),
            ram_bytes_per_pass=sum(self.layer_bytes[i] for i in self.ram_layers),
            candidates=list(self.candidates),
            choice=self.choice,
            slots=self.slots,
            machine=dict(self.machine),
            dense_layers=list(self.dense_layers),
            dense_draft_layers=list(self.dense_draft_layers),
            kernel=dict(self.kernel),
            experts=self.experts,
        )


def cuda_margin(dev: dict[str, int], cuda: bool) -> int:
    """CUDA context + workspaces + allocator slack (long-lived blocks barely fragment; temporaries do)."""
    if not cuda:
        return 0
    static = sum(v for k, v in dev.items() if k != "activations")
    return CUDA_CONTEXT + int(STATIC_SLACK * static + CHURN_SLACK * dev.get("activations", 0))


def capacity(req: PlanRequest) -> int:
    """--max-gpu-memory, else what the device reports free (CPU: RAM_FRACTION of available RAM)."""
    if req.max_gpu_memory is not None:
        return req.max_gpu_memory
    if req.device == "cpu":
        return int(RAM_FRACTION * req.ram_free)
    if req.device_free is None:
        raise OffloadError(
            "no CUDA device here to ask for free memory; pass --max-gpu-memory "
            "(e.g. 24GB) to plan for a card of that size"
        )
    return req.device_free


def ram_cap(req: PlanRequest) -> int:
    """Host bytes specx may use: --max-ram, else RAM_FRACTION of the available RAM."""
    return req.max_ram if req.max_ram is not None else int(RAM_FRACTION * req.ram_free)
