"""Routed experts held apart from their decoder layer: read on demand from disk into a bounded RAM cache.

Contract:
- `splits_experts(model_type, device_type, packed)`: THE rule (the memory plan asks it too): on a CPU a
  disk-tier layer of a MoE family (arch/moe.MOE_FAMILIES, GGUF and MXFP4 included) streams only its dense
  part, and reads its routed experts after the router chose them. CUDA and packed-linear checkpoints (NF4,
  AWQ/GPTQ/compressed-tensors: `streams_whole(config)`) stream whole layers.
- `is_expert(name)`: a layer-relative name of one expert (`mlp.experts.3.w1.weight`) or of all fused
  (gpt-oss's (E, ...) tensors, GGUF's `ffn_*_exps`: expert e is row e).
- `expert_layers(entries, specs, align)` -> {e: storage.DiskLayer} (pure: the plan sizes the cache with it);
  `split_layer`: (dense part, experts) of one disk layer; `held_experts(...)`: the loader's step.
- `ExpertStore(reader, experts, capacity, pool, top_k)`: `capacity` LRU slots of `slot_bytes`
  in one "expert_cache" buffer (`cache_capacity`: what the room holds, at least one layer's, at most all).
  `fetch(layer, e)` -> (buffer, layout, read?); counters `reads`, `bytes_read` (also the model's
  `stats.streamed_bytes_per_pass`). `stream(layer, es)`: each in order, a worker reading up to `capacity` - 1
  ahead; a pass of more than `top_k` experts that would miss enough in the next expert layer
  (expertbulk.worth_whole) has that layer read whole meanwhile (`layers_read_whole`). Reader threads avoid
  torch kernels (`_repack`). `attach(layers, stats)`: an ExpertList binds expert e to its slot (only a
  read re-binds); fused experts (RoutedExperts) get its parts as views.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from offload.arch.gptoss_experts import RoutedExperts
from offload.arch.moe import MOE_FAMILIES, ExpertList
from offload.errors import OffloadError
from offload.formats.st_index import TensorEntry
from offload.stream.devmem import DevicePool
from offload.stream.expertbulk import REQUEST_BYTES, WholeReads, layer_spans, param_offsets, whole_from
from offload.stream.hostmem import IO_ALIGN, align_up, aligned_empty
from offload.stream.storage import (
    MERGE_GAP,
    DirectReader,
    DiskLayer,
    ParamSpec,
    file_layout,
    packed_layout,
    store_param,
)

MARK = ".experts."


def splits_experts(model_type: str | None, device_type: str, packed: bool = False) -> bool:
    return device_type == "cpu" and not packed and (model_type or "") in MOE_FAMILIES


def streams_whole(config: dict) -> bool:
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") in ("awq", "gptq", "compressed-tensors", "bitsandbytes")


def is_expert(name: str) -> bool:
    return MARK in name


def _parts(entries: dict[str, TensorEntry], specs: dict[str, ParamSpec]) -> dict[int, dict[str, tuple]]:
    """{expert id: {name: (its entry, its spec)}}: per-expert tensors as they are, fused ones sliced (expert e's
    row; a block-quantized one, stored flat, stays flat)."""
    out: dict[int, dict[str, tuple]] = {}
    for name, sp in specs.items():
        if not is_expert(name):
            continue
        entry = entries[name]
        tail = name.split(MARK, 1)[1].split(".", 1)[0]
        if tail.isdigit():  # one expert's own tensor: `mlp.experts.3.w1.weight`
            out.setdefault(int(tail), {})[name] = (entry, sp)
            continue
        # the fused tensor's experts: its outer dimension (a GGUF's flat block bytes: its logical shape's)
        n = entry.meta["shape"][0] if entry.qtype is not None else sp.shape[0]
        step = entry.nbytes // n
        shape = tuple(entry.shape[1:]) if entry.qtype is None else (step,)
        part_spec = ParamSpec(name, tuple(sp.shape[1:]) if entry.qtype is None else shape, sp.dtype, nf4=sp.nf4)
        for e in range(n):
            part = replace(entry, shape=shape, begin=entry.begin + e * step, end=entry.begin + (e + 1) * step)
            out.setdefault(e, {})[name] = (part, part_spec)
    return out


def expert_layers(entries: dict[str, TensorEntry], specs: dict[str, ParamSpec], align: int) -> dict[int, DiskLayer]:
    out = {}
    for e, parts in sorted(_parts(entries, specs).items()):
        raw, spans = file_layout({n: entry for n, (entry, _) in parts.items()}, merge_gap=0)
        sp = [s for _, s in parts.values()]
        out[e] = DiskLayer(spans, raw, packed_layout(sp), sp, align)
    return out


def split_layer(
    entries: dict[str, TensorEntry], specs: list[ParamSpec], align: int
) -> tuple[DiskLayer, dict[int, DiskLayer]]:
    """(dense part, routed experts) of one disk layer; a layer without routed experts comes back whole."""
    experts = expert_layers(entries, {sp.name: sp for sp in specs}, align)
    keep = [sp for sp in specs if not is_expert(sp.name)] if experts else specs
    raw, spans = file_layout({sp.name: entries[sp.name] for sp in keep}, merge_gap=0 if experts else MERGE_GAP)
    return DiskLayer(spans, raw, packed_layout(keep), keep, align), experts


def held_experts(index, disk, config, device, mode: str, capacity, memplan, pool, reader, room):
    """({layer: dense part, or the whole layer}, ExpertStore | None); cache size `capacity`, else the memory
    plan's, else what `room` host bytes hold."""
    if mode not in ("auto", "on-demand", "layers"):
        raise OffloadError(f"experts must be auto, on-demand or layers, got {mode!r}")
    planned = (getattr(memplan, "experts", None) or {}).get("mode")
    mode = ("on-demand" if planned == "on-demand" else "layers") if mode == "auto" and planned else mode
    if mode == "layers" or not disk or not splits_experts(config.model_type, device.type, streams_whole(index.config)):
        return disk, None
    dense, held = {}, {}  # {layer: dense part}, {(layer, e): expert}
    for i, d in disk.items():
        entries = {sp.name: index.get(f"model.layers.{i}.{sp.name}") for sp in d.specs}
        dense[i], experts = split_layer(entries, d.specs, d.align)
        held.update({(i, e): x for e, x in experts.items()})
    if not held:
        return disk, None
    if capacity is None:
        capacity = (getattr(memplan, "experts", None) or {}).get("cache_experts")
    if capacity is None:
        per_layer = 1 + max(e for _, e in held)
        capacity = cache_capacity(per_layer, len(held), slot_bytes(held.values()), room)
    k = int(getattr(config, "num_experts_per_tok", None) or 1)
    return dense, ExpertStore(reader, held, capacity, pool, top_k=k)


def param_slot(layer: nn.Module, name: str) -> tuple[nn.Module, str, str]:
    """(module, attribute, name) of the layer's parameter (or submodule) `name`, layer-relative."""
    mod, _, attr = name.rpartition(".")
    return layer.get_submodule(mod), attr, name


def slot_bytes(experts) -> int:
    return max((align_up(d.layout.nbytes, IO_ALIGN) for d in experts), default=0)


def cache_capacity(per_layer: int, on_disk: int, slot: int, room: int | None) -> int:
    fit = room // slot if room is not None and slot else 0
    return min(on_disk, max(per_layer, fit))


def _repack(d: DiskLayer, raw: torch.Tensor, dest: torch.Tensor, at: dict[str, int] | None = None) -> None:
    """Expert `d`'s parameters from its file layout in `raw` (parameter p at `at[p]`, else its d.raw offset)
    into its compute layout in `dest`. No torch kernel where possible: on the reader thread a torch copy
    starts an OpenMP team that spins on the compute's cores. Same dtype: memmove; bf16 -> fp32: the 16 bits
    shifted into the high half (exact); both release the GIL. Any other cast: torch."""
    for sp in d.specs:
        src, dst = d.raw.slices[sp.name], d.packed.slices[sp.name]
        o = src.offset if at is None else at[sp.name]
        if src.dtype == dst.dtype:
            ctypes.memmove(dest.data_ptr() + dst.offset, raw.data_ptr() + o, src.nbytes)
        elif src.dtype == torch.bfloat16 and dst.dtype == torch.float32:
            bits = raw[o : o + src.nbytes].numpy().view(np.uint16)
            out = dest[dst.offset : dst.offset + dst.nbytes].numpy().view(np.uint32)
            np.left_shift(bits, 16, out=out, dtype=np.uint32)
        else:
            store_param(raw[o : o + src.nbytes].view(src.dtype).view(src.shape), sp, d.packed.view(dest, sp.name))


class ExpertStore:
    def __init__(
        self,
        reader: DirectReader,
        experts: dict[tuple[int, int], DiskLayer],
        capacity: int,
        pool: DevicePool,
        top_k: int = 1,
    ):
        self.reader = DirectReader(reader.direct, reader.depth, reader.chunk)  # its own files, closed with it
        self.experts = experts
        self.capacity = max(1, min(capacity, len(experts)))
        self.slot = slot_bytes(experts.values())
        self.cache = pool.alloc(self.capacity * self.slot, "expert_cache")
        raw = max((d.raw.nbytes for d in experts.values() if d.repack), default=0)
        self.scratch = aligned_empty(raw) if raw else None
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, e) -> slot, least recent first
        self.reads = self.bytes_read = 0
        self.stats = None  # an OffloadStats whose streamed_bytes_per_pass counts the spans read too
        self._worker: ThreadPoolExecutor | None = None  # stream's read-ahead thread, started on first use
        # a layer read whole, ahead, when the layer before routed to many experts (offload/stream/expertbulk.py)
        self.layer_reads, self._landing = layer_spans(experts)
        self._whole_at = {k: param_offsets(d, self._landing[k]) for k, d in experts.items() if d.repack}
        self.whole_from = {i: whole_from(r, experts, i, REQUEST_BYTES) for i, r in self.layer_reads.items()}
        nbytes = max(r.nbytes for r in self.layer_reads.values())
        self.whole = WholeReads(self.reader, nbytes, lambda n: pool.alloc(n, "expert_readahead"))
        self.layers_read_whole, self.top_k = 0, top_k
        self.per_layer = {i: sum(1 for li, _ in experts if li == i) for i in self.layer_reads}
        held = sorted(self.layer_reads)  # the next layer holding experts apart; after the last, the next pass's first
        self.next_layer = dict(zip(held, held[1:] + held[:1]))

    def fetch(self, layer: int, e: int, whole=None) -> tuple[torch.Tensor, object, bool]:
        """(slot buffer, layout, read now?) of expert e; `whole`: the layer's whole read (future, buffer)."""
        key, d = (layer, e), self.experts[(layer, e)]
        if key in self.lru:
            self.lru.move_to_end(key)
            return self.slot_view(self.lru[key]), d.layout, False
        s = self.lru.popitem(last=False)[1] if len(self.lru) >= self.capacity else len(self.lru)
        self.lru[key] = s
        dest = self.slot_view(s)
        target = self.scratch if d.repack else dest
        if whole is not None:  # from the layer's whole read: its parameters, or its spans as they would land
            whole[0].result()
            if d.repack:
                _repack(d, whole[1], dest, self._whole_at[key])
            for off, span in self._landing[key] if not d.repack else ():
                ctypes.memmove(dest.data_ptr() + span.buf_offset, whole[1].data_ptr() + off, span.length)
        for span in d.spans if whole is None else ():
            self.reader.read_span(span, target)
            self._count(span.length)
        if d.repack and whole is None:
            _repack(d, target, dest)
        self.reads += 1
        return dest, d.layout, True

    def stream(self, layer: int, es: list[int]):
        """fetch(layer, e) for each of `es`, a worker reading ahead (see the contract); the reads ahead are the
        most recently used, so they never evict the expert the caller computes."""
        if self.capacity < 2 or len(es) < 2:
            yield from (self.fetch(layer, e) for e in es)
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="specx-experts")
        whole, nxt = self.whole.take(layer), self.next_layer[layer]
        if len(es) > self.top_k and self._misses(nxt, len(es)) >= self.whole_from[nxt]:  # many here: there too
            self.whole.submit(nxt, self.layer_reads[nxt])
            self.layers_read_whole += 1
            self._count(self.layer_reads[nxt].needed)
        depth = min(len(es), self.capacity - 1)
        ahead = deque(self._worker.submit(self.fetch, layer, e, whole) for e in es[:depth])
        try:
            for k in range(len(es)):
                got = ahead.popleft().result()
                if k + depth < len(es):
                    ahead.append(self._worker.submit(self.fetch, layer, es[k + depth], whole))
                yield got
        finally:
            for f in ahead:
                f.result()  # a stream left early: its reads land before their slots are reused

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self.whole.close()
        self.reader.close()

    def _misses(self, layer: int, d: int) -> float:
        """Expected misses of d routed experts of `layer` after this layer's d (its uncached share; at most
        `capacity` - d of its cached experts survive; none while its whole read is under way)."""
        if layer in self.whole.pending:
            return 0.0
        n = self.per_layer[layer]
        cached = min(sum(1 for li, _ in self.lru if li == layer), max(0, self.capacity - d))
        return d * (n - cached) / n

    def _count(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        if self.stats is not None:
            self.stats.streamed_bytes_per_pass += nbytes

    def slot_view(self, s: int) -> torch.Tensor:
        return self.cache[s * self.slot : (s + 1) * self.slot]

    def attach(self, layers: nn.ModuleList, stats) -> None:
        """Every held layer's experts read through this store (`_Source`); `stats` counts the bytes read too."""
        self.stats = stats
        for i in sorted(self.layer_reads):
            mlp = layers[i].mlp
            if not isinstance(mlp.experts, (ExpertList, RoutedExperts)):  # transformers' fused module (gpt-oss)
                mlp.experts = RoutedExperts.from_hf(mlp.experts)
            mlp.experts.source = _Source(self, i, layers[i], mlp.experts)


class _Source:
    """Expert e of one layer from its cache slot: an ExpertList's child with its parameters bound there
    (ExpertList.source; only a read re-binds), fused experts' {parameter name: its part} (RoutedExperts.source)."""

    def __init__(self, store: ExpertStore, i: int, layer: nn.Module, experts: nn.Module):
        self.store, self.i, self.experts = store, i, experts
        self.params = None  # fused experts: no child to bind
        if isinstance(experts, ExpertList):
            held = [(e, d) for (li, e), d in store.experts.items() if li == i]
            self.params = {e: [param_slot(layer, sp.name) for sp in d.specs] for e, d in held}

    def __call__(self, e: int):
        return self._bound(e, *self.store.fetch(self.i, e))

    def stream(self, es: list[int]):
        return (self._bound(e, *got) for e, got in zip(es, self.store.stream(self.i, es)))

    def _bound(self, e: int, buf: torch.Tensor, layout, read: bool):
        if self.params is None:
            return layout.parts(buf)
        if read:  # a hit's parameters still point at its slot
            for mod, attr, name in self.params[e]:
                mod._parameters[attr] = nn.Parameter(layout.view(buf, name), requires_grad=False)
        return self.experts[e]
