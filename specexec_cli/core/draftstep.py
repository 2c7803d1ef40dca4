"""The draft's forward over one tree step, at a few fixed shapes, so that CUDA can replay it as a graph.

Contract: `run(draft, cache, tokens, positions, n_past, anc_cols, *extra, causal=False)` is THE draft
forward of every method's tree growth. It runs B new tokens (host (B,) ids and positions) whose K/V
go to cache rows [start, start + B) (start = the cache's length) and returns their (B, V) logits on
the draft's device, with the staged positions and `extra` host tensors (one counted upload, as
`kvcache.stage`). Row i sees columns [0, n_past), its ancestors' columns (row i of the (B, D) host
table `anc_cols`, -1 = none), its own column start + i and, with `causal`, columns start .. start + i.
Afterwards the cache holds start + B rows, as an append of the B tokens would leave it.

How: the B rows are padded to the smallest bucket of `BUCKETS[device type]` that fits (none on the
CPU, nor on CUDA unless the pass is replayed as a graph), with buffers and one shared (LARGEST, W)
mask store allocated once. Padded rows carry PAD_TOKEN at position 0 and see only their own column;
their logits are dropped and their K/V rows lie past the cache's length, so a real row's logits
change only by a wider GEMM's rounding. Two ways to run (`kvcache.SlabCache.write_rows`): append (the
CPU's; bit-identical to an unpadded pass at P = B), or static (`STATIC` devices, a reserved SlabCache
of the draft's own): the mask covers the whole slab and K/V go to the device rows `Buffers.rows`, so
kernels and pointers are the same at every length; a resident CUDA draft (`capturable`) captures each
bucket's static pass as a CUDA graph after WARMUP eager ones. Passes wider than LARGEST run appended
with one-off buffers. A cache's step object lives as long as the cache (`step_for`).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from specexec_cli.core import kvcache
from specexec_cli.core.tree import build_mask

POWERS = (1, 2, 4, 8, 16, 32, 64, 128)
LARGEST = POWERS[-1]  # widest pass with buffers kept; wider ones get one-off buffers
BUCKETS: dict[str, tuple[int, ...]] = {"cuda": POWERS}  # device type -> pass widths; unlisted: exact widths
STATIC: set[str] = {"cuda"}  # device types whose bucketed passes run static (whole-slab mask, device rows)
WARMUP = 2  # eager static passes before a capture: lazy initialisations and kernel choices done
PAD_TOKEN = 0  # token id of padded rows


@dataclass
class Buffers:
    """One bucket's pass inputs, allocated once on the draft's device (P = the bucket's rows)."""

    ids: torch.Tensor  # (P,) long token ids; padded rows PAD_TOKEN (on the model's input device)
    positions: torch.Tensor  # (P,) long positions; padded rows 0
    rows: torch.Tensor  # (P,) long cache rows written = the rows' own mask columns: start + i
    iota: torch.Tensor  # (P,) long 0 .. P - 1
    graph: Any = None  # torch.cuda.CUDAGraph of this bucket's static pass; None = not captured
    out: torch.Tensor | None = None  # (P, V) logits the graph writes on each replay


def new_buffers(p: int, device: torch.device, ids_device: torch.device) -> Buffers:
    """A bucket's buffers (tests count the calls: once per bucket)."""
    ids = torch.full((p,), PAD_TOKEN, dtype=torch.long, device=ids_device)
    positions = torch.zeros(p, dtype=torch.long, device=device)
    for t in (ids, positions):  # device-resident inputs: kvcache.forward passes them on without a copy
        t._specx_uploaded = True  # type: ignore[attr-defined]
    iota = torch.arange(p, device=device)
    return Buffers(ids, positions, iota.clone(), iota)


def new_mask(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive mask store (rows, width), width a multiple of 8 (tests count the calls)."""
    return torch.empty(rows, -(-width // 8) * 8, dtype=dtype, device=device)


def capturable(model) -> bool:
    """A resident HF draft on CUDA, whose static pass can be captured (a streamed one waits on other streams)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or torch.device(model.device).type != "cuda":
        return False
    return all(p.device.type == "cuda" for p in model.parameters())


class StaticDraftStep:
    """The bucketed draft pass of one draft cache (module docstring); made by `step_for`."""

    def __init__(self, model):
        self.model = model
        self.device = torch.device(model.device)
        self.ids_device = torch.device(getattr(model, "input_device", self.device))
        self.dtype = kvcache.model_dtype(model)
        self.graphs = capturable(model)  # capture static passes (else run them eagerly)
        self.buffers: dict[int, Buffers] = {}  # bucket rows P -> its buffers
        self.mask: torch.Tensor | None = None  # (LARGEST, W) additive mask store the buckets share
        self.slab = 0  # data_ptr of the slab the graphs were captured over (0 = none)

    def bucket(self, cache, start: int, b: int) -> tuple[int, bool]:
        """(P, static) of a B-row pass at cache row `start`; exact (B, appended) where padding would
        not pay or would grow the slab."""
        widths = [w for w in BUCKETS.get(self.device.type, ()) if w >= b]
        cap = kvcache.slab_rows(cache)
        if b > LARGEST or not widths or (cap is not None and start + widths[0] > cap):
            return b, False
        static = self.device.type in STATIC and type(cache) is kvcache.SlabCache and cache.capacity is not None
        static = static and cap is not None
        if self.device.type == "cuda" and not (static and self.graphs):
            return b, False
        return widths[0], static

    def run(self, cache, tokens, positions, n_past: int, anc, *extra: torch.Tensor, causal: bool = False):
        """See the module docstring: -> ((B, V) logits, (B,) staged positions, [staged extras])."""
        b, start = int(tokens.numel()), kvcache.cache_len(cache)
        p, static = self.bucket(cache, start, b)
        cap = kvcache.slab_rows(cache)
        width = cap if static and cap is not None else start + p  # keys the attention sees: slab | live + new
        ids, pos, *rest = kvcache.stage(self.model, tokens, positions, *([] if anc is None else [anc]), *extra)
        anc_dev = rest.pop(0) if anc is not None else None
        slab = kvcache.slab_ptr(cache) if static else self.slab
        buf, store = self.inputs(cache, p, width, max(width, cap or 0), slab)
        buf.ids[:b].copy_(ids)
        buf.ids[b:].fill_(PAD_TOKEN)
        buf.positions[:b].copy_(pos)
        buf.positions[b:].fill_(0)
        torch.add(buf.iota, start, out=buf.rows)
        build_mask(store[:p, :width], buf.rows, b, n_past, start, anc_dev, causal)
        if static and self.graphs:
            logits = self.replay(cache, buf, store, width)
        else:
            logits = self.forward(cache, buf, store, width, static)
        if static:
            kvcache.set_length(cache, start + b)
        else:
            kvcache.drop_last(cache, p - b)  # the padded rows' K/V: past the length, overwritten next pass
        return logits[:b], pos, rest

    def inputs(self, cache, p: int, width: int, need: int, slab: int) -> tuple[Buffers, torch.Tensor]:
        """Bucket P's buffers and the mask store, >= `need` columns (one-off beyond LARGEST). A new
        `slab` (the one a static pass reads) is zeroed past its rows and voids the graphs, as a new store."""
        if p > LARGEST:
            return new_buffers(p, self.device, self.ids_device), new_mask(p, width, self.dtype, self.device)
        store = self.mask
        if store is None or store.shape[1] < need or slab != self.slab:
            grown = max(need, 2 * store.shape[1]) if store is not None and slab == self.slab else need  # appended: x2
            self.mask = store = new_mask(LARGEST, grown, self.dtype, self.device)
            if slab != self.slab:  # its never-written rows enter every static pass (0 * NaN is NaN)
                kvcache.zero_tail(cache)
            self.slab = slab
            for buf in self.buffers.values():  # captured graphs read the old store or slab
                buf.graph = buf.out = None
        if p not in self.buffers:
            self.buffers[p] = new_buffers(p, self.device, self.ids_device)
        return self.buffers[p], store

    def forward(self, cache, buf: Buffers, store: torch.Tensor, width: int, static: bool) -> torch.Tensor:
        """One eager pass over the bucket (a fresh mask view each pass: prepared masks are keyed on it)."""
        p = buf.ids.numel()
        mask = store[:p, :width][None, None]  # (1, 1, P, width)
        cache.write_rows = buf.rows if static else None
        try:
            return kvcache.forward(self.model, cache, buf.ids, buf.positions, mask)
        finally:
            cache.write_rows = None

    def replay(self, cache, buf: Buffers, store: torch.Tensor, width: int) -> torch.Tensor:
        """The bucket's captured pass (captured now, after WARMUP eager passes, the first time)."""
        out = buf.out if buf.graph is not None else self.capture(cache, buf, store, width)
        if out is None:
            return self.forward(cache, buf, store, width, True)
        buf.graph.replay()
        return out

    def capture(self, cache, buf: Buffers, store: torch.Tensor, width: int) -> torch.Tensor | None:
        """Capture the bucket's static pass into `buf` -> the logits its replays write (its inputs are
        already in the buffers). On a side stream, never a device-wide sync (torch.cuda.graph makes
        one). None, with one warning and graphs off, where the pass cannot be captured."""
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        side.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    self.forward(cache, buf, store, width, True)
                graph.capture_begin()
                try:
                    out = self.forward(cache, buf, store, width, True)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            warnings.warn(f"draft pass not captured as a CUDA graph, running it eagerly: {exc}", stacklevel=2)
            self.graphs = False
            return None
        finally:
            main.wait_stream(side)
        buf.graph, buf.out = graph, out
        return out


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft cache -> its StaticDraftStep


def step_for(model, cache) -> StaticDraftStep:
    """The step object of `cache` (made on first use, dropped with the cache)."""
    step = _STEPS.get(cache)
    if step is None or step.model is not model:
        step = _STEPS[cache] = StaticDraftStep(model)
    return step


def run(draft, cache, tokens, positions, n_past: int, anc, *extra: torch.Tensor, causal: bool = False):
    """The draft's pass over B new tokens (module docstring): -> ((B, V) logits, (B,) staged
    positions, [staged extras])."""
    return step_for(draft, cache).run(cache, tokens, positions, n_past, anc, *extra, causal=causal)
