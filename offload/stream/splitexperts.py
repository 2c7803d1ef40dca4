"""Routed experts split by tier and computed where they live: the "split" placement (llama.cpp's --n-cpu-moe).

Contract:
- `wants_split(mode, memplan)`: experts="split", or "auto" where the memory plan chose "split".
- `tier_order(layers, e, counts)`: (layer, expert) pairs, hottest first by routing `counts` (flattened layer by
  layer), else evenly (rank r of every layer, then r + 1). `tier_ids(order, n_layers, gpu, ram)` -> {tier: per
  layer sorted ids}: the first `gpu` on the device, the next `ram` in RAM, the rest on disk. `split_ids`: the
  plan's ids, else `cache` on the device and what `ram_room` bytes hold in RAM.
- `load_split(...)` -> SplitExperts: gpu/ram experts read once in their packed compute layout ("expert_cache",
  or host "experts_ram", page-locked on CUDA); the disk tier in an ExpertStore. `attach(layers)` wraps each
  sparse experts module in a `SplitBlock` (unregistered: parameter names stay the checkpoint's).
- `SplitBlock.forward(hidden (T, H), top_k_index (T, K), top_k_weights (T, K))`: cached experts compute on the
  device (other slots marked E, "unassigned"); rows routed elsewhere move to the CPU ONCE, compute there, and
  their weighted sum moves back ONCE. A pass of n >= `stream_from` tokens (the plan's, else
  DEFAULT_STREAM_FROM) computes EVERY routed expert on the device, each uncached one copied into the next
  `Staging` slot (2 x top-k slots, one "expert_staging" buffer; counters `copies`, `bytes`).
"""

from __future__ import annotations

import torch
from torch import nn

from offload.arch.gptoss_experts import RoutedExperts
from offload.arch.moe import ExpertList
from offload.errors import OffloadError
from offload.stream.devmem import DevicePool
from offload.stream.expertstore import ExpertStore, cache_capacity, expert_layers, is_expert, param_slot, slot_bytes
from offload.stream.hostmem import IO_ALIGN, HostPins, align_up, aligned_empty
from offload.stream.storage import CPU_ALIGN, DirectReader, DiskLayer

TIERS = ("gpu", "ram", "disk")
DEFAULT_STREAM_FROM = 32  # tokens: llama.cpp computes ops of a batch this large on host-held weights on the GPU


def wants_split(mode: str, memplan) -> bool:
    return mode == "split" or (mode == "auto" and (getattr(memplan, "experts", None) or {}).get("mode") == "split")


def tier_order(layers: list[int], e: int, counts: list[int] | None = None) -> list[tuple[int, int]]:
    even = [(i, x) for x in range(e) for i in layers]  # rank x of every layer, then rank x + 1
    if not counts or len(counts) != e * len(layers) or not any(counts):
        return even
    rank = {i: r for r, i in enumerate(layers)}
    return sorted(even, key=lambda p: -counts[rank[p[0]] * e + p[1]])  # stable: ties keep the even order


def tier_ids(order: list[tuple[int, int]], n_layers: int, gpu: int, ram: int) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {t: [[] for _ in range(n_layers)] for t in TIERS}
    for r, (i, x) in enumerate(order):
        out["gpu" if r < gpu else "ram" if r < gpu + ram else "disk"][i].append(x)
    for ids in out.values():
        for row in ids:
            row.sort()
    return out


class SplitExperts:
    def __init__(self, device: torch.device, store: ExpertStore | None, host_pool: DevicePool):
        self.device, self.store, self.host_pool = device, store, host_pool
        self.held: dict[int, dict[int, tuple[torch.Tensor, DiskLayer]]] = {}  # layer -> e -> (buffer, expert)
        self.cached: dict[int, list[int]] = {}  # layer -> ids cached on the device
        self.disk: dict[int, list[int]] = {}  # layer -> ids read on demand
        self.stream_from: dict[int, int | None] = {}  # layer -> tokens from which a pass computes on the device
        self.staging: Staging | None = None

    def attach(self, layers: nn.ModuleList) -> None:
        for i, by_e in self.held.items():
            layer = layers[i]
            experts = layer.mlp.experts
            if not isinstance(experts, (ExpertList, RoutedExperts)):  # transformers' fused module (gpt-oss)
                experts = layer.mlp.experts = RoutedExperts.from_hf(experts)
            disk = experts.source if self.disk.get(i) else None  # the ExpertStore's, attached before
            params: dict = {}  # ExpertList: where each expert's parameters bind (layer-relative)
            if isinstance(experts, ExpertList):
                specs = [(e, d.specs) for e, (_, d) in by_e.items()]
                specs += [(e, self.store.experts[(i, e)].specs) for e in self.disk.get(i, [])]
                params = {e: [param_slot(layer, sp.name) for sp in sps] for e, sps in specs}
                for e, (buf, d) in by_e.items():  # a held expert's child: bound to its buffer for good
                    for mod, attr, name in params[e]:
                        mod._parameters[attr] = nn.Parameter(d.packed.view(buf, name), requires_grad=False)
                held = {e: experts[e] for e in by_e}
            else:
                held = {e: d.packed.parts(buf) for e, (buf, d) in by_e.items()}
            tiers = experts.source = _Tiers(held, disk)
            tiers.layer = i
            tiers.store = self.store
            tiers.params = params
            tiers.host = {e: (buf, d.packed) for e, (buf, d) in by_e.items() if e not in self.cached.get(i, [])}
            block = SplitBlock(experts, self.cached.get(i, []), self.device)
            block.stream_from, block.staging = self.stream_from.get(i), self.staging
            layer.mlp.experts = block


def _layer_experts(index, i: int, specs) -> dict[int, DiskLayer]:
    """Layer i's routed experts {e: DiskLayer} (CPU_ALIGN: the disk tier computes on the CPU)."""
    keep = {sp.name: sp for sp in specs if is_expert(sp.name)}
    entries = {n: index.get(f"model.layers.{i}.{n}") for n in keep}
    return expert_layers(entries, keep, CPU_ALIGN) if keep else {}


def load_split(
    index, specs, device: torch.device, pool: DevicePool, ids: dict, reader: DirectReader, memplan=None
) -> SplitExperts:
    """Every sparse layer's experts read into their tiers (see the contract); `ids`: tier_ids' output."""
    host_pool = DevicePool(torch.device("cpu"))
    pins = HostPins(device)  # CUDA: the RAM tier page-locked, so a pass that streams it copies at the link's rate
    held: dict[int, dict[int, tuple[torch.Tensor, DiskLayer]]] = {}
    on_disk: dict[tuple[int, int], DiskLayer] = {}
    out = SplitExperts(device, None, host_pool)
    for i, s in enumerate(specs):
        experts = _layer_experts(index, i, s)
        if not experts:
            continue
        held[i] = {}
        for e, d in experts.items():
            if e in ids["disk"][i]:
                on_disk[(i, e)] = d
                continue
            gpu = e in ids["gpu"][i]
            host = host_pool.alloc(d.packed.nbytes, "experts_ram") if not gpu else aligned_empty(d.packed.nbytes)
            d.read(reader, aligned_empty(d.raw.nbytes), host)  # packed compute layout
            if not gpu:
                pins.pin(host, "the split's RAM experts")
            # a cached expert: one counted device copy (on a CPU device the pool's buffer is RAM)
            held[i][e] = (pool.alloc(d.packed.nbytes, "expert_cache").copy_(host) if gpu else host, d)
        out.cached[i] = sorted(e for e in held[i] if e in ids["gpu"][i])
        out.disk[i] = sorted(e for (li, e) in on_disk if li == i)
    out.held = held
    pins.attach(out)
    pins.notice("a pass that streams them to the card copies at pageable speed")
    cfg = index.hf_config
    k = int(getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "experts_per_token", None) or 1)
    if on_disk:  # top_k: a one-token pass reads only its routed experts, never a layer whole (expertbulk)
        per_layer = max(len(ids["gpu"][i]) + len(ids["ram"][i]) + len(ids["disk"][i]) for i in held)
        capacity = cache_capacity(per_layer, len(on_disk), slot_bytes(on_disk.values()), None)
        out.store = ExpertStore(reader, on_disk, capacity, host_pool, top_k=k)
    planned = (getattr(memplan, "experts", None) or {}).get("stream_from")
    out.stream_from = {i: planned[i] if planned else DEFAULT_STREAM_FROM for i in held}
    sizes = [d.packed.nbytes for by_e in held.values() for _, d in by_e.values()]
    slot = align_up(max(sizes + [d.layout.nbytes for d in on_disk.values()]), IO_ALIGN)
    out.staging = Staging(pool, slot, 2 * k)
    return out


def split_ids(memplan, specs, index, cache: int | None, ram_room: int, e: int) -> dict:
    planned = getattr(memplan, "experts", None) or {}
    if cache is None and "gpu_ids" in planned:
        return {t: planned[f"{t}_ids"] for t in TIERS}
    layers = [i for i, s in enumerate(specs) if any(is_expert(sp.name) for sp in s)]
    if not layers or e < 1:
        raise OffloadError("experts='split' needs a mixture-of-experts model with routed experts")
    largest = max(max(d.packed.nbytes for d in _layer_experts(index, i, specs[i]).values()) for i in layers)
    gpu = min(cache or 0, e * len(layers))
    ram = max(0, ram_room) // largest
    return tier_ids(tier_order(layers, e), len(specs), gpu, ram)


class _Tiers:
    """An experts module's source: expert e as held in its tier, else the ExpertStore's source. For _Staged:
    `host` {e: (buffer, layout)} of the RAM tier, `store` and `layer` (the disk tier's slots), `params`
    (ExpertList: per expert where its parameters bind)."""

    def __init__(self, held: dict, disk):
        self.held, self.disk = held, disk
        self.host: dict[int, tuple[torch.Tensor, object]] = {}
        self.store: ExpertStore | None = None
        self.layer, self.params = -1, {}

    def __call__(self, e: int):
        return self.held[e] if e in self.held else self.disk(e)

    def stream(self, es: list[int]):
        away = [e for e in es if e not in self.held]
        read = iter(self.disk.stream(away)) if away else iter(())
        return (self.held[e] if e in self.held else next(read) for e in es)

    def buffer(self, e: int) -> tuple[torch.Tensor, object]:
        """(host buffer, layout) of uncached expert e: its RAM buffer, else its (fetched) ExpertStore slot."""
        if e in self.host:
            return self.host[e]
        key = (self.layer, e)
        return self.store.slot_view(self.store.lru[key]), self.store.experts[key].layout


class Staging:
    def __init__(self, pool: DevicePool, slot: int, slots: int):
        self.pool, self.slot, self.slots = pool, slot, slots
        self.buf: torch.Tensor | None = None
        self.next = self.copies = self.bytes = 0

    def put(self, src: torch.Tensor) -> torch.Tensor:
        """`src` (uint8, host) copied into the next slot on the compute stream; returns that slot's bytes."""
        if self.buf is None:
            self.buf = self.pool.alloc(self.slot * self.slots, "expert_staging")
        at, self.next = self.next * self.slot, (self.next + 1) % self.slots
        dest = self.buf[at : at + src.numel()]
        dest.copy_(src, non_blocking=True)
        self.copies, self.bytes = self.copies + 1, self.bytes + src.numel()
        return dest


class _Staged:
    """A device pass's source: a cached expert as held, any other copied into the staging area and bound there
    (ExpertList: until `restore`; fused: its parts as views)."""

    def __init__(self, tiers: _Tiers, cached: set[int], staging: Staging):
        self.tiers, self.cached, self.staging = tiers, cached, staging
        self.undo: list[tuple[nn.Module, str, nn.Parameter]] = []

    def __call__(self, e: int):
        t = self.tiers
        if e in self.cached:
            return t.held[e]
        got = t(e)  # a disk expert: fetched into its store slot (an ExpertList child bound there, as on the CPU)
        buf, layout = t.buffer(e)
        dev = self.staging.put(buf[: layout.nbytes])
        if isinstance(got, dict):  # fused experts: expert e's parts by name
            return layout.parts(dev)
        for mod, attr, name in t.params[e]:
            self.undo.append((mod, attr, mod._parameters[attr]))
            mod._parameters[attr] = nn.Parameter(layout.view(dev, name), requires_grad=False)
        return got

    def stream(self, es: list[int]):
        return (self(e) for e in es)

    def restore(self) -> None:
        for mod, attr, p in reversed(self.undo):
            mod._parameters[attr] = p


class SplitBlock(nn.Module):
    def __init__(self, inner: nn.Module, cached: list[int], device: torch.device):
        super().__init__()
        object.__setattr__(self, "inner", inner)  # unregistered: the layer's parameter names stay as stored
        self.num_experts = len(inner) if isinstance(inner, ExpertList) else inner.num_experts
        on = torch.zeros(self.num_experts + 1, dtype=torch.bool)  # index E: "unassigned", never cached
        on[cached] = True
        self.on_device, self.any_cached, self.cached = on.to(device), bool(cached), set(cached)
        self.stream_from: int | None = None  # tokens from which a pass computes every routed expert on the device
        self.staging: Staging | None = None

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        e, cpu = self.num_experts, torch.device("cpu")
        here = self.on_device[top_k_index]  # (T, K): the pair's expert is cached on the device
        big = self.stream_from is not None and hidden.shape[0] >= self.stream_from
        if big and self.staging is not None and not bool(here.all()):
            return self._staged(hidden, top_k_index, top_k_weights)
        # the CPU's inputs first (their copy waits for the router only), so that the cached experts' kernels,
        # queued next, run on a card while the CPU computes the rest
        rows = (~here).any(-1).nonzero()[:, 0]  # tokens routed to some RAM or disk expert
        away = None
        if rows.numel():
            idx = torch.where(here[rows], e, top_k_index[rows]).to(cpu)
            away = (hidden[rows].to(cpu), idx, top_k_weights[rows].to(cpu))
        if self.any_cached:
            out = self.inner(hidden, torch.where(here, top_k_index, e), top_k_weights)
        else:
            out = torch.zeros_like(hidden)
        if away is not None:
            y = self.inner(*away)  # (r, H) on the CPU
            out.index_add_(0, rows, y.to(out.device, out.dtype))
        return out

    def _staged(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tiers = self.inner.source
        staged = _Staged(tiers, self.cached, self.staging)
        self.inner.source = staged
        try:
            return self.inner(hidden, top_k_index, top_k_weights)
        finally:
            self.inner.source = tiers
            staged.restore()
