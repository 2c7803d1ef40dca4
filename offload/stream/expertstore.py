"""Routed experts held apart from their decoder layer: read on demand from disk into a bounded RAM cache.

Contract:
- `splits_experts(model_type, device_type)` is THE rule of where experts may be held apart, asked by the memory
  plan (`plan.experts`, offload/planning/experts.py, which chooses whether they are by modelled speed) and by
  the loader alike: on a CPU device a disk-tier decoder layer of a
  mixture-of-experts family (arch/moe.MOE_FAMILIES: Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss in 16/32 bits
  or MXFP4, and their GGUFs, any block type) streams only its dense part (attention, norms, the router, a
  shared expert), and its routed experts are read after the router chose them, only those. Resident and
  RAM-tier layers keep their experts in their arena (on a CPU that is RAM, computed in place). A CUDA
  device streams whole layers, and so does a checkpoint whose experts are packed linears of another format
  (`packed`: NF4, AWQ/GPTQ/compressed-tensors; `streams_whole(config)` says it of a checkpoint, a GGUF's
  experts being rows of its fused tensors: expert e computes from its rows' bytes as stored, with the GGUF
  kernel where a whole layer's would, formats/qlinear.py; gpt-oss's dequantized per routed expert).
- `is_expert(name)`: a layer-relative parameter name belongs to the routed experts: one expert's
  (`mlp.experts.3.w1.weight`, `expert_id(name)` its id) or all of them fused (`is_fused`: gpt-oss's
  `mlp.experts.gate_up_proj` (E, H, 2I), its MXFP4 `_blocks`/`_scales`, the biases (E, ...)), whose expert e
  is row e, a contiguous 1/E of its bytes (`slice_entry`; a block-quantized tensor stored flat, as a GGUF's
  `ffn_*_exps`, slices the same way).
- `expert_layers(entries, specs, align)` -> {expert id: storage.DiskLayer}: per routed expert of one layer
  its covering file spans (its tensors or its rows of the fused ones, IO_ALIGN-aligned, merged only where
  they touch) and the layout it computes in (the file's where offsets sit on `align` and no cast is needed,
  else a packed one). Pure: the plan sizes the cache from the headers with it, the loader reads with it.
- `split_layer(entries, specs, align)` -> (dense part, {e: expert}) of one disk layer; `split_disk(index,
  disk)` does it to the loader's disk layers. The dense part's spans never cover an expert's bytes.
- `held_experts(...)`: the loader's step (disk layers in, dense parts and an ExpertStore out); with
  experts="auto" it follows the memory plan's choice (plan.experts["mode"], planning/experts.py prices both).
- `slot_bytes(experts)`: one cache slot (the largest expert's compute layout, page-aligned: O_DIRECT lands
  there); `cache_capacity(per_layer, on_disk, slot, room)`: experts the cache holds: what `room` bytes
  hold (None: nothing beyond the minimum), at least one layer's experts (a pass may route to all of them),
  at most every expert on disk.
- `ExpertStore(reader, experts {(layer, e): DiskLayer}, capacity, pool, request_bytes, top_k)`: one pool buffer
  ("expert_cache") of `capacity` slots. `fetch(layer, e)` -> (buffer, layout): a cached expert as it is
  (a hit: it becomes the most recently used), else its spans read by `reader` (storage.DirectReader) into
  the least recently used slot. Counters: `reads`, `hits`, `bytes_read` (file bytes of the spans read),
  also added to `stats.streamed_bytes_per_pass` when the model sets `stats`. `stream(layer, es)` fetches
  each of `es` in order, read by a worker thread up to `capacity` - 1 experts ahead of the one the caller
  computes (a cache of one expert: one at a time); `close()` stops the threads and closes the files. Per pass,
  by its size: where `es` holds more than one token's `top_k` experts (plain decoding keeps its routed reads)
  and would make enough misses in the next layer holding experts apart (after the last, the next pass's first;
  misses: d x the share of its experts not cached, at most `capacity` - d of them surviving) for
  expertbulk.worth_whole (`whole_from[layer]`), that layer's experts are read whole, in as few requests as the
  file allows (expertbulk.layer_spans), by a second thread while this layer computes (`layers_read_whole`
  counts them; their bytes count when submitted), into one of two buffers of a layer's expert bytes (allocated
  on first use, the pool's "expert_readahead": memory beyond the cache), and that layer's misses are copied
  (repacked) out of it instead of read; small passes read only their routed experts. The reader threads run no
  torch kernel where they can help it: a repack copies with memmove, bf16 -> fp32 by a shift (`_repack`).
  `attach(i, layer, experts_module)` gives layer i's arch/moe.ExpertList a source that binds expert e's
  parameters to its slot before it computes (only a read re-binds: a hit's parameters still point there);
  fused experts (arch/gptoss_experts.RoutedExperts, which replaces transformers' GptOssExperts there) get a
  source returning expert e's parts, views of its slot by parameter name.
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
    """True where a disk layer's routed experts are read on demand (see the contract); `packed`: a
    4-bit or otherwise packed checkpoint (its experts stream with their layer)."""
    return device_type == "cpu" and not packed and (model_type or "") in MOE_FAMILIES


def streams_whole(config: dict) -> bool:
    """`packed` of `splits_experts` for a checkpoint's config.json-style dict: packed-int4 linears (AWQ, GPTQ,
    compressed-tensors, pre-quantized NF4) stream with their layer; a GGUF's experts are read apart as stored
    (see the contract)."""
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") in ("awq", "gptq", "compressed-tensors", "bitsandbytes")


def is_expert(name: str) -> bool:
    return MARK in name


def is_fused(name: str) -> bool:
    """A routed-experts tensor holding every expert, [E, ...] (gpt-oss's `mlp.experts.gate_up_proj`)."""
    return is_expert(name) and not name.split(MARK, 1)[1].split(".", 1)[0].isdigit()


def expert_id(name: str) -> int:
    return int(name.split(MARK, 1)[1].split(".", 1)[0])


def slice_entry(entry: TensorEntry, e: int, n: int) -> TensorEntry:
    """Expert e's part of a fused tensor of n experts: row e, a contiguous 1/n of its bytes (a block-quantized
    tensor, stored flat, keeps its flat form)."""
    step = entry.nbytes // n
    shape = tuple(entry.shape[1:]) if entry.qtype is None else (step,)
    return replace(entry, shape=shape, begin=entry.begin + e * step, end=entry.begin + (e + 1) * step)


def _parts(entries: dict[str, TensorEntry], specs: dict[str, ParamSpec]) -> dict[int, dict[str, tuple]]:
    """{expert id: {name: (its entry, its spec)}}: per-expert tensors as they are, fused ones sliced."""
    out: dict[int, dict[str, tuple]] = {}
    for name, sp in specs.items():
        if not is_expert(name):
            continue
        if not is_fused(name):
            out.setdefault(expert_id(name), {})[name] = (entries[name], sp)
            continue
        entry = entries[name]
        # the fused tensor's experts: its outer dimension (a GGUF's flat block bytes: its logical shape's)
        n = entry.meta["shape"][0] if entry.qtype is not None else sp.shape[0]
        for e in range(n):
            part = slice_entry(entry, e, n)
            shape = part.shape if entry.qtype is not None else tuple(sp.shape[1:])
            out.setdefault(e, {})[name] = (part, ParamSpec(name, shape, sp.dtype, nf4=sp.nf4))
    return out


def expert_layers(entries: dict[str, TensorEntry], specs: dict[str, ParamSpec], align: int) -> dict[int, DiskLayer]:
    """Per routed expert of one layer (names layer-relative): its spans and compute layout (see the contract)."""
    out = {}
    for e, parts in sorted(_parts(entries, specs).items()):
        raw, spans = file_layout({n: entry for n, (entry, _) in parts.items()}, merge_gap=0)
        sp = [s for _, s in parts.values()]
        convert = any(raw.slices[s.name].dtype != s.dtype for s in sp)
        out[e] = DiskLayer(spans, raw, packed_layout(sp), sp, convert, align)
    return out


def split_layer(
    entries: dict[str, TensorEntry], specs: list[ParamSpec], align: int
) -> tuple[DiskLayer, dict[int, DiskLayer]]:
    """One disk layer held apart (names layer-relative): (its dense part, its routed experts); a layer
    without routed experts (a dense MLP layer) comes back whole, with none."""
    experts = expert_layers(entries, {sp.name: sp for sp in specs}, align)
    keep = [sp for sp in specs if not is_expert(sp.name)] if experts else specs
    raw, spans = file_layout({sp.name: entries[sp.name] for sp in keep}, merge_gap=0 if experts else MERGE_GAP)
    packed = packed_layout(keep)
    convert = any(raw.slices[sp.name].dtype != packed.slices[sp.name].dtype for sp in keep)
    return DiskLayer(spans, raw, packed, keep, convert, align), experts


def split_disk(index, disk: dict[int, DiskLayer]) -> tuple[dict[int, DiskLayer], dict[tuple[int, int], DiskLayer]]:
    """The loader's disk layers held apart: ({layer: dense part}, {(layer, expert): expert})."""
    dense, held = {}, {}
    for i, d in disk.items():
        entries = {sp.name: index.get(f"model.layers.{i}.{sp.name}") for sp in d.specs}
        dense[i], experts = split_layer(entries, d.specs, d.align)
        held.update({(i, e): x for e, x in experts.items()})
    return dense, held


def held_experts(index, disk, config, device, mode: str, capacity, memplan, pool, reader, room):
    """The loader's disk layers with their routed experts held apart where `splits_experts` allows it and
    `mode` is "on-demand", or "auto" where the memory plan chose it (its plan.experts mode, priced by
    planning/experts.expert_plan; no plan: where allowed) ("layers": whole layers):
    ({layer: dense part, or the whole layer}, ExpertStore | None).
    The cache's experts: `capacity`, else the memory plan's, else `cache_capacity` of `room` host bytes."""
    if mode not in ("auto", "on-demand", "layers"):
        raise OffloadError(f"experts must be auto, on-demand or layers, got {mode!r}")
    planned = (getattr(memplan, "experts", None) or {}).get("mode")
    mode = ("on-demand" if planned == "on-demand" else "layers") if mode == "auto" and planned else mode
    if mode == "layers" or not disk or not splits_experts(config.model_type, device.type, streams_whole(index.config)):
        return disk, None
    dense, held = split_disk(index, disk)
    if not held:
        return disk, None
    if capacity is None:
        capacity = (getattr(memplan, "experts", None) or {}).get("cache_experts")
    if capacity is None:
        per_layer = 1 + max(e for _, e in held)
        capacity = cache_capacity(per_layer, len(held), slot_bytes(held.values()), room)
    k = int(getattr(config, "num_experts_per_tok", None) or 1)
    return dense, ExpertStore(DirectReader(reader.direct, reader.depth, reader.chunk), held, capacity, pool, top_k=k)


def slot_bytes(experts) -> int:
    return max((align_up(d.layout.nbytes, IO_ALIGN) for d in experts), default=0)


def cache_capacity(per_layer: int, on_disk: int, slot: int, room: int | None) -> int:
    """Experts the RAM cache holds (see the contract)."""
    fit = room // slot if room is not None and slot else 0
    return min(on_disk, max(per_layer, fit))


def _repack(d: DiskLayer, raw: torch.Tensor, dest: torch.Tensor, at: dict[str, int] | None = None) -> None:
    """Expert `d`'s parameters from its file layout in `raw` (parameter p at `at[p]`, else at its d.raw offset)
    into its compute layout in `dest`, without a torch kernel where possible: the reader thread runs this beside
    the compute, and a torch copy there starts an OpenMP team of its own whose threads spin on the cores the
    compute uses. Same dtype: a memmove (ctypes releases the GIL); bf16 -> fp32: the 16 bits shifted into the
    high half of 32 (exact; numpy releases the GIL); any other cast: torch."""
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
        request_bytes: int = REQUEST_BYTES,
        top_k: int = 1,
    ):
        self.reader, self.experts = reader, experts
        self.capacity = max(1, min(capacity, len(experts)))
        self.slot = slot_bytes(experts.values())
        self.cache = pool.alloc(self.capacity * self.slot, "expert_cache")
        raw = max((d.raw.nbytes for d in experts.values() if d.repack), default=0)
        self.scratch = aligned_empty(raw) if raw else None
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, e) -> slot, least recent first
        self.reads = self.hits = self.bytes_read = 0
        self.stats = None  # an OffloadStats whose streamed_bytes_per_pass counts the spans read too
        self._worker: ThreadPoolExecutor | None = None  # stream's read-ahead thread, started on first use
        # a layer read whole, ahead, when the layer before routed to many experts (offload/stream/expertbulk.py)
        self.layer_reads, self._landing = layer_spans(experts)
        self._whole_at = {k: param_offsets(d, self._landing[k]) for k, d in experts.items() if d.repack}
        self.whole_from = {i: whole_from(r, experts, i, request_bytes) for i, r in self.layer_reads.items()}
        nbytes = max(r.nbytes for r in self.layer_reads.values())
        self.whole = WholeReads(reader, nbytes, lambda n: pool.alloc(n, "expert_readahead"))
        self.layers_read_whole, self.top_k = 0, top_k
        self.per_layer = {i: sum(1 for li, _ in experts if li == i) for i in self.layer_reads}
        held = sorted(self.layer_reads)  # the next layer holding experts apart; after the last, the next pass's first
        self.next_layer = dict(zip(held, held[1:] + held[:1]))

    def fetch(self, layer: int, e: int, whole=None) -> tuple[torch.Tensor, object, bool]:
        """(slot buffer, layout, read now?) of expert e of `layer` (see the contract); `whole`: the layer's
        whole read (future, buffer) a miss copies its spans from."""
        key, d = (layer, e), self.experts[(layer, e)]
        if key in self.lru:
            self.lru.move_to_end(key)
            self.hits += 1
            s = self.lru[key]
            return self._buf(s), d.layout, False
        s = self.lru.popitem(last=False)[1] if len(self.lru) >= self.capacity else len(self.lru)
        self.lru[key] = s
        dest = self._buf(s)
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
        """fetch(layer, e) for each of `es` in order, read by a worker thread up to `capacity` - 1 experts ahead of
        the one the caller computes (the reads ahead are the most recently used: they evict others, never it); a
        cache of one expert reads them one at a time. First, the layer's whole read (see the contract)."""
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
        """Stop the read-ahead thread and close the files (idempotent)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self.whole.close()
        self.reader.close()

    def _misses(self, layer: int, d: int) -> float:
        """The misses d routed experts of `layer` are expected to make after this layer's d (its share of experts
        cached now, of which at most `capacity` - d survive this layer's; none where its whole read is under way)."""
        if layer in self.whole.pending:
            return 0.0
        n = self.per_layer[layer]
        cached = min(sum(1 for li, _ in self.lru if li == layer), max(0, self.capacity - d))
        return d * (n - cached) / n

    def _count(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        if self.stats is not None:
            self.stats.streamed_bytes_per_pass += nbytes

    def _buf(self, s: int) -> torch.Tensor:
        return self.cache[s * self.slot : (s + 1) * self.slot]

    def attach(self, i: int, layer: nn.Module, experts: nn.Module) -> None:
        """Layer i's experts compute each routed expert from this store: an ExpertList by binding expert e's
        parameters, fused experts (gpt-oss; transformers' module becomes a RoutedExperts) from its parts."""
        if isinstance(experts, ExpertList):
            experts.source = _Source(self, i, layer, experts)
            return
        if not isinstance(experts, RoutedExperts):
            name = next(n for n, m in layer.named_modules() if m is experts)
            parent, _, attr = name.rpartition(".")
            experts = RoutedExperts.from_hf(experts)
            setattr(layer.get_submodule(parent), attr, experts)
        experts.source = _FusedSource(self, i)


class _Source:
    """Expert e of one layer with its parameters bound to its cache slot (ExpertList.source)."""

    def __init__(self, store: ExpertStore, i: int, layer: nn.Module, experts: nn.Module):
        self.store, self.i, self.experts = store, i, experts
        self.params = {}
        for (li, e), d in store.experts.items():
            if li == i:
                self.params[e] = [
                    (layer.get_submodule(sp.name.rpartition(".")[0]), sp.name.rpartition(".")[2], sp.name)
                    for sp in d.specs
                ]

    def __call__(self, e: int) -> nn.Module:
        return self._bound(e, *self.store.fetch(self.i, e))

    def stream(self, es: list[int]):
        """Each of `es` in order, bound, the next expert read while this one computes (ExpertStore.stream)."""
        return (self._bound(e, *got) for e, got in zip(es, self.store.stream(self.i, es)))

    def _bound(self, e: int, buf: torch.Tensor, layout, read: bool) -> nn.Module:
        if read:  # a hit's parameters still point at its slot
            for mod, attr, name in self.params[e]:
                mod._parameters[attr] = nn.Parameter(layout.view(buf, name), requires_grad=False)
        return self.experts[e]


class _FusedSource:
    """Expert e of one layer as {parameter name: its part in the cache slot} (RoutedExperts.source)."""

    def __init__(self, store: ExpertStore, i: int):
        self.store, self.i = store, i

    def __call__(self, e: int) -> dict[str, torch.Tensor]:
        return self._views(*self.store.fetch(self.i, e)[:2])

    def stream(self, es: list[int]):
        """The parts of each of `es` in order, the next expert read while this one computes (ExpertStore.stream)."""
        return (self._views(buf, layout) for buf, layout, _ in self.store.stream(self.i, es))

    @staticmethod
    def _views(buf: torch.Tensor, layout) -> dict[str, torch.Tensor]:
        return {name.rpartition(".")[2]: layout.view(buf, name) for name in layout.slices}
