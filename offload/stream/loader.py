"""Load-time placement: read the checkpoint into resident buffers, RAM arenas and disk plans.

Contract: `load_weights(..., opts)` (an OffloadOptions: from_pretrained's keywords) takes a Checkpoint
`open_checkpoint` validated, picks the placement (`plan_offload` or the caller's memory plan), checks host and
device bytes against what is free BEFORE allocating (OffloadError otherwise), then fills resident layers into
`DevicePool` buffers, RAM-tier layers into one page-aligned host region (page-locked on CUDA), and records file
spans for disk layers. NF4 layers stream only their packed weights; quant states and small tensors go to the
device once ("pinned"). `plan.dense`: resident layers dequantized once (the plan's, else `_dense_auto`). With
experts="split" every layer is resident with its dense part only (stream/splitexperts.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from offload.errors import OffloadError
from offload.formats import Checkpoint
from offload.formats.qlinear import PackedLinear
from offload.quant.dense import dense_bytes
from offload.quant.nf4 import Nf4Linear
from offload.stream.placement import OffloadPlan, plan_offload
from offload.formats.prequant import load_quant_state
from offload.sizes import format_bytes
from offload.stream.devmem import DevicePool
from offload.stream.globals import load_globals
from offload.stream.storage import (
    CPU_ALIGN,
    DirectReader,
    DiskLayer,
    LayerLayout,
    LayerStore,
    ParamSpec,
    aligned_empty,
    file_layout,
    fill_packed,
    packed_layout,
)
from offload.stream.hostmem import ARENA_ALIGN, HostPins
from offload.stream.expertstore import ExpertStore, held_experts, is_expert
from offload.stream.splitexperts import SplitExperts, load_split, split_ids, wants_split

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPES |= {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AUTO_RAM_FRACTION = 0.8
CUDA_HEADROOM = 1 << 30  # left free on the GPU for KV cache and activations in "auto"


def accelerator_half(device=None) -> torch.dtype:
    """THE 16-bit compute dtype of a CUDA device: bf16 where native (capability 8.0+), else fp16 (older GPUs
    emulate bf16 slowly or not at all); bf16 without a CUDA device (planning for another machine)."""
    if not torch.cuda.is_available():
        return torch.bfloat16
    try:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # older torch: no emulation flag
        native = torch.cuda.get_device_capability(device)[0] >= 8
    return torch.bfloat16 if native else torch.float16


def resolve_dtype(dtype, config, device: torch.device) -> tuple[torch.dtype, torch.dtype, bool]:
    """(storage dtype of non-quantized params, compute dtype, nf4?); a pre-quantized checkpoint
    with an explicit 16/32-bit dtype computes in that dtype (as transformers would)."""
    if wants_nf4(dtype):
        # NF4 linears; everything else (norms, embeddings) and the matmuls in the compute dtype:
        # bf16 on accelerators, fp32 on CPU (CPU bf16 matmuls without AVX512-BF16 are ~25x slower).
        compute = torch.float32 if device.type == "cpu" else accelerator_half(device)
        return compute, compute, True
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.lower(), dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):  # a torch.dtype's repr is its str
        raise OffloadError(f"unsupported dtype {dtype!r}; use float32, bfloat16, float16 or nf4")
    return dtype, dtype, False


def wants_nf4(dtype) -> bool:
    return isinstance(dtype, str) and dtype.lower() == "nf4"


@dataclass
class LoadedWeights:
    embed: nn.Module
    norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module
    plan: OffloadPlan
    pool: DevicePool
    store: LayerStore
    resident: dict[int, tuple[torch.Tensor, LayerLayout]]
    qstates: dict[int, dict]  # layer -> param name -> QuantState (nf4)
    pinned: dict[int, tuple[torch.Tensor, LayerLayout]]  # nf4: norms/biases, bound once
    experts: ExpertStore | None = None  # disk layers' routed experts, read on demand
    split: SplitExperts | None = None  # experts="split": every layer's dense part resident, experts by tier


def layer_specs(layer: nn.Module, storage_dtype: torch.dtype) -> list[ParamSpec]:
    """One spec per parameter: NF4 weights by logical shape, a PackedLinear's parts and integer parameters
    (MXFP4 blocks and scales) as stored, the rest in `storage_dtype`."""
    specs = []
    for name, p in layer.named_parameters():
        mod_name, _, attr = name.rpartition(".")
        mod = layer.get_submodule(mod_name) if mod_name else layer
        if isinstance(mod, Nf4Linear) and attr == "weight":
            specs.append(ParamSpec(name, mod.logical_shape, torch.uint8, nf4=True))
        elif (isinstance(mod, PackedLinear) and attr in mod.parts) or not p.dtype.is_floating_point:
            specs.append(ParamSpec(name, tuple(p.shape), p.dtype))  # stored bytes (MXFP4 blocks/scales too)
        else:
            specs.append(ParamSpec(name, tuple(p.shape), storage_dtype))
    return specs


def _budgets(offload, device, total, max_dev, max_host, free_ram):
    """Resolve None budgets per offload mode (explicit values always win)."""
    if offload == "none":
        return None, 0
    if offload == "ram":
        return (0 if max_dev is None else max_dev), (total if max_host is None else max_host)
    if offload == "disk":
        return (0 if max_dev is None else max_dev), (0 if max_host is None else max_host)
    ram_cap = int(free_ram * AUTO_RAM_FRACTION)
    if max_dev is None:
        if device.type == "cuda":
            max_dev = max(0, torch.cuda.mem_get_info(device)[0] - CUDA_HEADROOM)
        else:
            max_dev = total if total <= ram_cap else 0
    return max_dev, (ram_cap if max_host is None else max_host)


def _check_fits(plan: OffloadPlan, device: torch.device, free_ram: int, root: Path) -> None:
    host = plan.host_bytes + (plan.device_bytes if device.type == "cpu" else 0)
    if host > free_ram:
        raise OffloadError(
            f"{root}: placement needs {format_bytes(host)} host RAM but {format_bytes(free_ram)} is free; "
            "lower --max-host-memory / --max-device-memory or use --offload disk"
        )
    if device.type == "cuda":
        free_dev = torch.cuda.mem_get_info(device)[0]
        if plan.device_bytes > free_dev:
            raise OffloadError(
                f"{root}: placement needs {format_bytes(plan.device_bytes)} device memory but "
                f"{format_bytes(free_dev)} is free; lower --max-device-memory or --slots"
            )


@dataclass(frozen=True)
class Subset:
    """Load only some decoder layers and borrow the rest of the model (a self-draft's substitutes)."""

    layers: frozenset  # decoder-layer ids to load; the others get no weights here
    shared: tuple  # (embed, norm, lm_head, rotary) modules to use as they are, by reference


@dataclass(frozen=True)
class OffloadOptions:
    """OffloadedCausalLM.from_pretrained's keyword options, its defaults; `offload` is checked on construction."""

    offload: str = "auto"  # layers' tiers: "none" (all resident), "ram", "disk" or "auto" (the budgets decide)
    max_device_memory: int | None = None  # bytes of resident layers (None: the offload mode's, _budgets)
    max_host_memory: int | None = None  # bytes of RAM-tier layers (None: the offload mode's, _budgets)
    slots: int = 2  # device buffers the streamed layers rotate through
    progress: Callable[[int, int, str], None] | None = None  # called (done, total, what) as layers load
    host_slots: int | None = None  # buffers of the disk read-ahead ring (storage.staging_slots)
    staging_bytes: int | None = None  # bytes that ring holds when host_slots is None (None: 1 GiB)
    memplan: Any = None  # a planning.memplan.MemoryPlan fixing placement and embeddings (None: the budgets decide)
    pool: DevicePool | None = None  # a DevicePool shared with the caller (None: one of its own)
    subset: Subset | None = None  # load only its layers and share its globals (a self-draft's substitutes)
    nf4_compute: torch.dtype | None = None  # a 4-bit load's compute dtype (None: fp32 on CPU, else bf16/fp16)
    # routed experts of disk layers: "on-demand" (expertstore.py), "layers" (streamed with their layer), "split"
    # (splitexperts.py) or "auto" (the memory plan's choice; without one, on demand where they can be)
    experts: str = "auto"
    expert_cache: int | None = None  # experts cached (split: on the device; on demand: in RAM; None: the plan's)

    def __post_init__(self) -> None:
        if self.offload not in ("none", "ram", "disk", "auto"):
            raise OffloadError(f"offload must be none, ram, disk or auto, got {self.offload!r}")


def load_weights(
    index: Checkpoint, hf, device: torch.device, storage_dtype, compute_dtype, nf4: bool, opts: OffloadOptions
) -> LoadedWeights:
    config, layers, subset = index.hf_config, hf.model.layers, opts.subset
    all_specs = [layer_specs(layer, storage_dtype) for layer in layers]
    # nf4: only the packed weights stream; the small rest is pinned on the device once.
    specs = [[sp for sp in s if sp.nf4 or not nf4] for s in all_specs]
    splitting = subset is None and wants_split(opts.experts, opts.memplan)
    if splitting:  # the layers hold their dense parts only (resident), the experts their tiers (splitexperts.py)
        specs = [[sp for sp in s if not is_expert(sp.name)] for s in all_specs]
    layouts = [packed_layout(s) for s in specs]
    files = [file_layout({sp.name: index.get(f"model.layers.{i}.{sp.name}") for sp in s}) for i, s in enumerate(specs)]
    free_ram = psutil.virtual_memory().available
    layer_bytes = [lay.nbytes if subset is None or i in subset.layers else 0 for i, lay in enumerate(layouts)]
    plan, room = _place(index, layer_bytes, splitting, opts, device, compute_dtype, free_ram)
    pool = opts.pool if opts.pool is not None else DevicePool(device)
    if subset is not None:
        embed, norm, lm_head, rotary = subset.shared
    else:
        embeddings = opts.memplan.embeddings if opts.memplan is not None else "device"
        embed, norm, lm_head, rotary = load_globals(index, hf, config, device, compute_dtype, pool, embeddings)
    pins = HostPins(device)  # CUDA only: nothing is page-locked for --device cpu
    resident, ram, disk, qstates, pinned, ram_pinned = _fill_layers(
        index, all_specs, specs, layouts, files, plan, subset, nf4, device, pool, pins, opts.progress
    )
    reader = DirectReader()
    if disk:
        reader.probe(next(iter(disk.values())).spans[0].file)
        plan.direct_io = reader.direct
    disk, held, split = _experts(index, all_specs, disk, device, pool, reader, opts, splitting, room)
    store = LayerStore(
        device, pool, opts.slots, ram, disk, reader, opts.host_slots, opts.staging_bytes, pins, ram_pinned
    )
    for states in qstates.values():
        for state in states.values():
            _own_quant_state(state, pool)
    plan.device_bytes = sum(pool.by_component.get(c, 0) for c in ("resident_layers", "staging_slots", "expert_cache"))
    return LoadedWeights(embed, norm, lm_head, rotary, plan, pool, store, resident, qstates, pinned, held, split)


def _place(index, layer_bytes, splitting, opts: OffloadOptions, device, compute_dtype, free_ram):
    """(plan, room): the layers' placement, and the host bytes left for routed experts (None: the memory plan's)."""
    max_dev, max_host, slots = opts.max_device_memory, opts.max_host_memory, opts.slots
    if splitting:  # every layer resident (dense parts only); room: the split experts' RAM tier
        room = max_host if max_host is not None else 0 if opts.offload == "disk" else int(free_ram * AUTO_RAM_FRACTION)
        return OffloadPlan(list(range(len(layer_bytes))), [], [], [], layer_bytes, slots, 0, 0), room
    if opts.memplan is not None:
        return _from_memplan(opts.memplan, layer_bytes, slots), None
    dev_budget, host_budget = _budgets(opts.offload, device, sum(layer_bytes), max_dev, max_host, free_ram)
    plan = plan_offload(layer_bytes, dev_budget, host_budget, free_ram, slots)
    room = max(0, host_budget - plan.host_bytes)  # host bytes the budget leaves for an expert cache
    _check_fits(plan, device, free_ram, index.path)
    plan.dense = _dense_auto(index, plan, layer_bytes, compute_dtype, device, free_ram, max_dev)
    return plan, room


def _fill_layers(index, all_specs, specs, layouts, files, plan, subset, nf4, device, pool, pins, progress):
    """(resident, ram, disk, qstates, pinned, ram_pinned): every loaded layer's bytes in its tier."""
    resident, ram, disk, qstates, pinned = {}, {}, {}, {}, {}
    pinned_specs = [[sp for sp in s if nf4 and not sp.nf4] for s in all_specs]
    ram_region = aligned_empty(sum(plan.layer_bytes[i] for i in plan.ram_layers))
    ram_pinned = pins.pin(ram_region, "the RAM tier")
    pins.notice("RAM-tier layers will stream through the smaller pinned staging ring (slower)")
    offset, total = 0, len(specs)
    for i in range(total):
        if progress is not None:
            progress(i, total, f"loading layer {i}")
        prefix = f"model.layers.{i}."
        if subset is not None and i not in subset.layers:
            continue
        if nf4:
            qstates[i] = {sp.name: load_quant_state(index, prefix + sp.name, device, sp.shape) for sp in specs[i]}
            lay = packed_layout(pinned_specs[i])
            pinned[i] = (_fill_resident(index, prefix, pinned_specs[i], lay, pool, device, "pinned_params"), lay)
        if i in plan.resident:
            resident[i] = (_fill_resident(index, prefix, specs[i], layouts[i], pool, device), layouts[i])
        elif i in plan.ram_layers:
            buf = ram_region[offset : offset + layouts[i].nbytes]
            offset += layouts[i].nbytes
            fill_packed(index, prefix, specs[i], layouts[i], buf, device)
            ram[i] = (buf, layouts[i])
        else:
            raw, spans = files[i]
            disk[i] = DiskLayer(spans, raw, layouts[i], specs[i], CPU_ALIGN if device.type == "cpu" else ARENA_ALIGN)
    if progress is not None:
        progress(total, total, "loaded")
    return resident, ram, disk, qstates, pinned, ram_pinned


def _experts(index, all_specs, disk, device, pool, reader, opts: OffloadOptions, splitting, room):
    """(disk, held, split): the disk layers, their routed experts' store (on demand, or split's), the split experts."""
    config, memplan, cache = index.hf_config, opts.memplan, opts.expert_cache
    if not splitting:
        disk, held = held_experts(index, disk, config, device, opts.experts, cache, memplan, pool, reader, room)
        return disk, held, None
    e = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    ids = split_ids(memplan, all_specs, index, cache, room, e)
    split = load_split(index, all_specs, device, pool, ids, reader, memplan)  # memplan: its stream_from
    return disk, split.store, split


def _dense_auto(index, plan: OffloadPlan, layer_bytes, compute_dtype, device, free_ram, max_dev) -> list[int]:
    """Without a memory plan: the resident layers, in order, dequantized once while they fit what the budgets
    leave (CPU: AUTO_RAM_FRACTION of free RAM; CUDA: free memory less CUDA_HEADROOM; within --max-device-memory)."""
    elem = torch.empty((), dtype=compute_dtype).element_size()
    sizes = [dense_bytes(index, i, elem) if layer_bytes[i] else 0 for i in range(len(layer_bytes))]
    planned = sum(layer_bytes[i] for i in plan.resident)
    if device.type == "cpu":
        room = int(free_ram * AUTO_RAM_FRACTION) - planned - plan.host_bytes
    else:
        room = torch.cuda.mem_get_info(device)[0] - CUDA_HEADROOM - plan.device_bytes
    if max_dev is not None:
        room = min(room, max_dev - planned)
    dense, used = [], 0
    for i in plan.resident:
        if sizes[i] and used + sizes[i] <= room:
            dense.append(i)
            used += sizes[i]
    return dense


def _from_memplan(memplan, layer_bytes: list[int], slots: int) -> OffloadPlan:
    """The layer placement the memory plan chose (it already checked every byte against the caps)."""
    if memplan.layer_bytes != layer_bytes:
        raise OffloadError("memory plan and loader disagree on layer sizes; this is a bug, please report it")
    ram, disk = list(memplan.ram_layers), list(memplan.disk_layers)
    host = sum(layer_bytes[i] for i in ram)
    dense = list(getattr(memplan, "dense_layers", []))
    resident = list(memplan.resident)
    return OffloadPlan(resident, ram + disk, ram, disk, list(layer_bytes), slots, host, device_bytes=0, dense=dense)


def _own_quant_state(state, pool: DevicePool) -> None:
    """Move an NF4 QuantState's tensors into counted pool buffers ("quant_states"), one copy each."""
    for st in (state, state.state2) if getattr(state, "nested", False) else (state,):
        for attr in ("absmax", "code", "offset"):
            t = getattr(st, attr, None)
            if isinstance(t, torch.Tensor):
                setattr(st, attr, pool.copy(t, "quant_states"))


def _fill_resident(
    index, prefix, specs, layout, pool: DevicePool, device, component: str = "resident_layers"
) -> torch.Tensor:
    buf = pool.alloc(layout.nbytes, component)
    host = buf if device.type == "cpu" else aligned_empty(layout.nbytes)  # CUDA: filled on the host, copied once
    fill_packed(index, prefix, specs, layout, host, device)
    return buf if host is buf else buf.copy_(host)
