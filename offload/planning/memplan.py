"""Device-memory plan: every byte the process will put on the compute device, before any is read.

Contract: `plan_memory(target, draft, request)` is a pure function of two `Checkpoint`s (config.json
plus safetensors headers, never weight bytes) and a `PlanRequest` (request.py, with the `MemoryPlan` and
the margins). It returns a `MemoryPlan` with one entry per device component:
- embeddings, final_norm, lm_head, rotary: target globals in the compute dtype (a GGUF head the CPU kernel
  serves keeps its packed bytes too; embeddings may live on the host, or stay packed on a CPU);
- resident_layers: packed arenas of the resident layers, spread evenly through the stack (`resident_ids`);
- dequantized_layers: resident layers of a packed checkpoint dequantized once at load (quant/dense.py), in
  layer order while the plan still fits; the others dequantize on every pass;
- staging_slots: device buffers of the largest streamed layer (storage.LayerStore); on CUDA memory a
  fitting plan leaves over becomes more slots, up to one per streamed layer;
- quant_states, pinned_params: NF4 statistics of every target linear, and every layer's norms and biases;
- draft: the draft's parameters + rotary buffers (tied head counted once); kv_target / kv_draft: caches
  of `kv_rows` rows; draft_step: the static draft step's buffers (membytes.draft_step_terms);
- activations: the largest single pass (membytes.activation_bytes); cuda_context: request.cuda_margin.
Components counted by `storage.DevicePool` (all but activations, draft_step and cuda_context) match the
loader's allocations byte for byte; tests check that on CPU.
Capacity: `--max-gpu-memory`, else the device's free memory; on CPU RAM_FRACTION of available RAM, which
host tiers share. Layers stay resident while the plan fits, then go to RAM (up to --max-ram or what is
left of RAM_FRACTION), then to disk; `fits` is False, with a one-line `reason` naming the fix
(verdict.py), when even zero resident layers do not fit. A mixture-of-experts "split" placement
(planning/experts.py) replaces these totals with its own (`replaced` keeps them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from offload.errors import OffloadError
from offload.formats.packed_globals import packed_globals_ok
from offload.formats.qlinear import gguf_kernel_type
from offload.sizes import format_bytes
from offload.planning.membytes import (
    Arch,
    activation_bytes,
    arch_of,
    compute_bytes,
    compute_dtype,
    draft_bytes,
    draft_step_terms,
    dtype_bytes,
    forest_row_bytes,
    kv_bytes,
    kv_rows,
    pass_tokens,
    prefill_chunk,
    rotary_bytes,
)
from offload.formats.base import Checkpoint
from offload.planning.memlayers import LayerSizes, dense_notes, dequantize_once, kernel_terms, layer_sizes
from offload.planning.draftcost import small_candidates
from offload.planning.experts import chose_whole_layers, expert_notes, expert_plan
from offload.planning.passcost import device_of
from offload.planning.request import (
    BUDGET_FLOOR,
    RAM_FRACTION,
    STATIC_SLACK,
    MemoryPlan,
    PlanRequest,
    capacity,
    cuda_margin,
)
from offload.planning.selfplan import plan_self_draft
from offload.planning.verdict import verdict
from offload.stream.storage import staging_slots


def _globals(ck: Checkpoint, a: Arch, req: PlanRequest, emb: str) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes of embeddings, final norm, lm_head and rotary buffers."""
    c = compute_bytes(req)
    table = a.vocab * a.hidden * c
    tied = a.tied and "lm_head.weight" not in ck.tensors
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    served = head in ck.tensors and gguf_kernel_type(ck, head, req.device, compute_dtype(req))
    packed = ck.tensors[head].nbytes if served else 0
    if emb == "packed":  # both as their GGUF bytes (formats/packed_globals.py); a tied head shares the table's
        embeddings = ck.tensors["model.embed_tokens.weight"].nbytes
        lm_head = 0 if tied else packed
    else:
        embeddings = table if emb == "device" else 0
        lm_head = (0 if tied and emb == "device" else table) + packed
    dev = {"embeddings": embeddings, "final_norm": a.hidden * c, "lm_head": lm_head, "rotary": rotary_bytes(a)}
    return dev, ({"embeddings": table} if emb == "host" else {})


@dataclass
class _Placement:
    resident: list[int]
    ram: list[int]
    disk: list[int]
    device: dict[str, int]
    host: dict[str, int]


def resident_ids(n: int, r: int) -> list[int]:
    """Which `r` of `n` layers stay resident: layer (2k+1)n // 2r for k < r, spread through the stack so the
    stream reads the next streamed layer while resident ones compute (a prefix would leave the link idle)."""
    if r <= 0 or r >= n:
        return list(range(max(0, min(r, n))))
    return [(2 * k + 1) * n // (2 * r) for k in range(r)]


def _place(lay: LayerSizes, r: int, req: PlanRequest, ram_budget: int) -> _Placement:
    """`r` layers resident (resident_ids); the rest, in order, in RAM while `ram_budget` lasts, then disk.
    Buffers follow storage.LayerStore: device slots (CPU: the host ring) of the largest streamed layout, a
    pinned staging ring of disk layouts (CUDA), one raw scratch buffer for disk layers that need a cast."""
    n, cuda = len(lay.packed), req.device == "cuda"
    resident = resident_ids(n, r)
    rest = [i for i in range(n) if i not in set(resident)]
    ram, used = [], 0
    for i in rest:
        if used + lay.packed[i] > ram_budget:
            break
        ram.append(i)
        used += lay.packed[i]
    disk = rest[len(ram) :]
    streamed = n - r
    slot = max([lay.disk_slot[i] for i in disk] + ([lay.packed[i] for i in ram] if cuda else []), default=0)
    stage = max(((lay.stage if cuda else lay.disk_slot)[i] for i in disk), default=0)
    slots = max(1, min(req.slots, streamed or 1))
    ring = staging_slots(slots, None, None, stage, streamed)
    # one raw read buffer: disk layers that need a cast, and on CPU those re-laid onto the 256-byte grid
    scratch = max((lay.raw[i] for i in disk if lay.convert[i] or (lay.repack[i] and not cuda)), default=0)
    device = {
        "resident_layers": sum(lay.packed[i] for i in resident),
        "staging_slots": (slots if cuda else ring) * slot,
    }
    host = {"ram_layers": used, "stage_buffers": ring * stage if cuda else 0, "read_buffers": scratch}
    return _Placement(resident, ram, disk, device, host)


def _extra_slots(lay: LayerSizes, req: PlanRequest, best: tuple, cap: int):
    """CUDA: the device memory a fitting plan `best` (placement, device, host, slots) leaves over becomes more
    staging slots (up to one per streamed layer, while the device and host totals fit): the same tuple."""
    pl, dev, host, _ = best
    for n in range(req.slots + 1, len(pl.ram) + len(pl.disk) + 1):
        more = _place(lay, len(pl.resident), replace(req, slots=n), sum(lay.packed[i] for i in pl.ram))
        d = {**dev, **more.device}
        d["cuda_context"] = cuda_margin(d, True)
        h = {**host, **more.host}
        if sum(d.values()) > cap or sum(h.values()) > req.ram_free or more.ram != pl.ram:
            break
        best = (more, d, h, n)
    return best


def _resident_choices(req: PlanRequest, n: int) -> range | list[int]:
    if req.offload == "none":
        return [n]
    if req.offload in ("ram", "disk") and req.max_gpu_memory is None:
        return [0]  # explicit streaming without a device cap: every layer streams (as before)
    return range(n, -1, -1)


def _ram_budget(req: PlanRequest, device_pre: int, host_fixed: int, resident: int) -> int:
    """Host bytes the RAM tier may use: --max-ram (on CPU with --offload auto it caps the resident layers too),
    else what RAM_FRACTION leaves after the other host buffers (on CPU, the "device" components too)."""
    if req.max_ram is not None:
        return req.max_ram - resident if _cpu_auto(req) else req.max_ram
    if req.offload == "ram":
        return 1 << 62
    if req.offload == "disk":
        return 0
    shared = device_pre if req.device == "cpu" else 0
    return max(0, int(RAM_FRACTION * req.ram_free) - shared - host_fixed)


def _cpu_auto(req: PlanRequest) -> bool:
    return req.device == "cpu" and req.offload == "auto"


def _draft_step(da: Arch | None, rows: tuple[int, int], req: PlanRequest) -> int:
    """The static draft step's buffers over the draft's cache rows (a self-draft's: the target's shared slabs)."""
    if da is None or req.draft_dtype is None:
        return 0
    graphs = req.device == "cuda" and not req.self_draft
    drows = rows[0] if req.self_draft else rows[1]
    terms = draft_step_terms(da, drows, dtype_bytes(req.draft_dtype), req.attn, graphs, req.device)
    return sum(terms.values())


def _fixed_bytes(
    target: Checkpoint, draft: Checkpoint | None, lay: LayerSizes, req: PlanRequest, budget: int, emb: str, chunk: int
) -> tuple[tuple[int, int], dict[str, int], dict[str, int]]:
    """(kv rows, device bytes, host bytes) of everything but the layers: globals, caches, draft, activations."""
    ta = arch_of(target.config)
    da = arch_of(draft.config) if draft is not None else (ta if req.self_draft else None)
    rows = kv_rows(req.ctx, budget, req.max_beams)
    if req.self_draft:  # shared KV: the draft's tree rows live in the target's slabs (kvcache.SharedCache)
        rows = (max(rows), 0)
    n = len(lay.packed)
    served = req.device == "cpu" and n > 0 and len(kernel_terms(target, n, req)["layers"]) == n
    fixed, ghost = _globals(target, ta, req, emb)
    fixed.update(
        quant_states=lay.quant,
        pinned_params=lay.pinned,
        draft=draft_bytes(draft, req.draft_dtype) if draft else 0,
        kv_target=kv_bytes(ta, rows[0], compute_bytes(req)),
        kv_draft=kv_bytes(da, rows[1], dtype_bytes(req.draft_dtype)) if da else 0,
        draft_step=_draft_step(da, rows, req),
        activations=activation_bytes(ta, da, req, rows, budget, chunk, served),
    )
    return rows, fixed, ghost


def _place_layers(lay: LayerSizes, req: PlanRequest, fixed: dict[str, int], ghost: dict[str, int], cap: int):
    """(placement, device bytes, host bytes, staging slots): the most resident layers that fit `cap`."""
    for r in _resident_choices(req, len(lay.packed)):
        res = resident_ids(len(lay.packed), r)
        kept = sum(lay.packed[i] for i in res)
        if _cpu_auto(req) and req.max_ram is not None and kept > req.max_ram:
            continue  # CPU: resident layers live in the RAM --max-ram allows
        if req.self_draft:  # every streamed layer has a substitute on the device
            fixed["draft"] = sum(v for i, v in enumerate(lay.substitute) if i not in set(res))
        pre = sum(fixed.values()) + kept
        buffers = max(max(lay.raw), req.slots * max(lay.disk_slot))  # disk staging, if anything ends up on disk
        pl = _place(lay, r, req, _ram_budget(req, pre, sum(ghost.values()) + buffers, kept))
        dev = {**fixed, **pl.device}
        dev["cuda_context"] = cuda_margin(dev, req.device == "cuda")
        host = {**ghost, **pl.host}
        if sum(dev.values()) <= cap:
            break
    slots = max(1, min(req.slots, len(pl.ram) + len(pl.disk) or 1))
    if req.device == "cuda" and (pl.ram or pl.disk) and sum(dev.values()) <= cap:
        return _extra_slots(lay, req, (pl, dev, host, slots), cap)
    return pl, dev, host, slots


def _plan_chunk(
    target: Checkpoint,
    draft: Checkpoint | None,
    lay: LayerSizes,
    req: PlanRequest,
    budget: int,
    emb: str,
    chunk: int | None,
) -> MemoryPlan:
    ta, cuda = arch_of(target.config), req.device == "cuda"
    cap = capacity(req)
    if chunk is None:
        chunk = prefill_chunk(ta, req, budget, cap if cap < 1 << 61 else req.ram_free)
    rows, fixed, ghost = _fixed_bytes(target, draft, lay, req, budget, emb, chunk)
    pl, dev, host, slots = _place_layers(lay, req, fixed, ghost, cap)
    # dequantize once (quant/dense.py) the resident layers the rest of the plan leaves room for
    used = sum(dev.values()) + (0 if cuda else sum(host.values()))  # CPU: host tiers share the RAM
    dense, dense_draft = dequantize_once(lay, pl.resident, req, ta, cap - used, 1 + STATIC_SLACK if cuda else 1)
    dense_bytes = {"dequantized_layers": dense.nbytes, "dequantized_draft": dense_draft.nbytes}
    dev.update({k: v for k, v in dense_bytes.items() if v})
    if dense.layers or dense_draft.layers:
        dev["cuda_context"] = cuda_margin({k: v for k, v in dev.items() if k != "cuda_context"}, cuda)
    plan = MemoryPlan(
        dev,
        host,
        cap,
        req.ram_free - (sum(dev.values()) if not cuda else 0),
        sum(lay.span_bytes[i] for i in pl.disk),
        pl.resident,
        pl.ram,
        pl.disk,
        list(lay.packed),
        emb,
        req.ctx,
        budget,
        rows,
        chunk,
        req.device,
        slots=slots,
        sized_budget=budget,
        row_bytes=forest_row_bytes(ta, req.ctx, compute_bytes(req)),
    )
    if slots > req.slots:
        plan.notes.append(
            f"staging: {slots} device slots, {slots - req.slots} of them from device memory left "
            "over, so the stream reads that many layers of the next pass while the draft grows its tree"
        )
    plan.dense_layers, plan.dense_draft_layers = dense.layers, dense_draft.layers
    plan.kernel = kernel_terms(target, len(lay.packed), req, streams=bool(pl.ram or pl.disk))
    plan.notes += dense_notes(dense, dense_draft, len(pl.resident))
    return _with_verdict(plan, target, lay, req)


def _with_verdict(plan: MemoryPlan, target: Checkpoint, lay: LayerSizes, req: PlanRequest) -> MemoryPlan:
    """`plan` with its verdict, its experts' placement (None for a dense model) and the nf4 cache's note."""
    plan.fits, plan.reason = verdict(plan, req)
    routing = (req.timings or {}).get("routing")  # a profile's measured routing counts, where it has them
    plan.experts = expert_plan(target, lay, req, plan, routing=routing)  # None for a dense model
    if plan.experts and plan.experts.get("cache_bytes"):  # routed experts read on demand: their RAM cache
        plan.device_bytes["expert_cache"] = plan.experts["cache_bytes"]
    if plan.experts and plan.experts["mode"] == "on-demand":  # and the store's two whole reads (expertbulk)
        plan.device_bytes["expert_readahead"] = 2 * max((lay.expert_whole[i] for i in plan.disk_layers), default=0)
    plan.notes += expert_notes(plan.experts)
    if lay.estimated:
        plan.notes.append(
            f"nf4: the first load writes a 4-bit cache of this checkpoint "
            f"(~{format_bytes(sum(lay.packed) + lay.quant)}) under $SPECX_CACHE; staging sizes are "
            "estimated until it exists"
        )
    return plan


def _adopt_split(plan: MemoryPlan) -> None:
    """The split placement's bytes as the plan's totals: every layer's dense part resident, the experts' tiers
    as experts.py sized them, the disk tier's share of top-k experts per sparse layer read per one-token pass."""
    ex, plan.replaced = plan.experts, replace(plan)
    host = {k: v for k, v in plan.host_bytes.items() if k not in ("ram_layers", "stage_buffers", "read_buffers")}
    plan.device_bytes, plan.host_bytes = dict(ex["device_bytes"]), {**host, **ex["host_bytes"]}
    plan.resident, plan.ram_layers, plan.disk_layers = list(range(len(plan.layer_bytes))), [], []
    on_disk = ex["disk_experts"] / max(1, ex["gpu_experts"] + ex["ram_experts"] + ex["disk_experts"])
    plan.disk_bytes_per_pass = int(ex["top_k"] * sum(ex["expert_bytes"]) * on_disk)


def plan_memory(target: Checkpoint, draft: Checkpoint | None, req: PlanRequest) -> MemoryPlan:
    if req.offload not in ("none", "ram", "disk", "auto"):
        raise OffloadError(f"offload must be none, ram, disk or auto, got {req.offload!r}")
    if req.embeddings not in ("auto", "device", "host", "packed"):
        raise OffloadError(f"--embeddings must be auto, device, host or packed, got {req.embeddings!r}")
    if req.embeddings == "packed" and not packed_globals_ok(target, req.device, compute_dtype(req)):
        raise OffloadError(
            "--embeddings packed needs a GGUF target on the CPU in fp32 whose embeddings and output layer "
            "the packed kernel reads; fix: --embeddings auto"
        )
    if req.ctx < 1 or req.budget < 0 or req.slots < 1:
        raise OffloadError("--ctx and --slots must be >= 1 and --budget >= 0")
    a = arch_of(target.config)
    limits = [a.max_positions] + ([arch_of(draft.config).max_positions] if draft else [])
    req = replace(req, ctx=min([req.ctx] + limits))
    lay = layer_sizes(target, a, req)
    if req.self_draft:  # a plan per substitute width: offload/planning/selfplan.py

        def plan_with(substitute: list[int], bits: int) -> MemoryPlan:
            lay.substitute = substitute
            return _plan_budgets(target, None, lay, replace(req, draft_bits=bits))

        nf4_layers = layer_sizes(target, a, replace(req, dtype="nf4"))
        return _with_machine(plan_self_draft(target, req, nf4_layers, plan_with), req)
    plan = _plan_budgets(target, draft, lay, req)
    if lay.apart and chose_whole_layers(plan.experts):  # apart models slower: again with whole layers' sizes
        plan = _plan_budgets(target, draft, layer_sizes(target, a, req, apart=False), req)
    if draft is not None:
        small_candidates(plan, target, draft, req, plan_memory)
    return _with_machine(plan, req)


def _with_machine(plan: MemoryPlan, req: PlanRequest) -> MemoryPlan:
    if plan.experts and plan.experts["mode"] == "split":  # the loader runs the split: its bytes are the plan's
        _adopt_split(plan)
        plan.fits, plan.reason = verdict(plan, req)
    plan.machine = asdict(device_of(req))
    return plan


def _plan_budgets(target: Checkpoint, draft: Checkpoint | None, lay: LayerSizes, req: PlanRequest) -> MemoryPlan:
    """The plan at `req.budget`, halved (budget auto) and with host embeddings tried, until one fits."""
    budgets = [req.budget]
    while req.budget_auto and budgets[-1] // 2 >= BUDGET_FLOOR:
        budgets.append(budgets[-1] // 2)
    if req.embeddings != "auto":
        embs = [req.embeddings]
    elif req.device == "cpu":  # packed: only where RAM is short (auto placement) and the file allows it
        short = req.offload == "auto" and req.max_ram is None and packed_globals_ok(target, "cpu", compute_dtype(req))
        embs = ["device", "packed"] if short else ["device"]
    else:
        embs = ["device", "host"]
    last = None
    for budget in budgets:
        fitting = None
        for emb in embs:
            # the biggest prefill chunk (membytes.prefill_chunk), halved down to pass_tokens(budget) until it fits
            plan = _plan_chunk(target, draft, lay, req, budget, emb, None)
            while not plan.fits and plan.pass_tokens // 2 >= min(pass_tokens(budget), req.ctx):
                plan = _plan_chunk(target, draft, lay, req, budget, emb, plan.pass_tokens // 2)
            streams = bool(plan.ram_layers or plan.disk_layers)
            if plan.fits and (emb != "device" or not streams or len(embs) == 1):
                return plan  # host or packed embeddings only when something streams: they free room for layers
            fitting = plan if plan.fits else fitting
            last = plan
        if fitting is not None:
            return fitting
    return last
