"""A layer's routed experts read whole, ahead of the layer, for passes that route to many of them.

Contract (used by stream/expertstore.ExpertStore; priced by planning/expertcost.py):
- `layer_spans(experts)` -> ({layer: LayerRead}, {(layer, e): [(bulk offset, span)]}): per layer its experts'
  spans merged within MERGE_GAP into one buffer; per expert where its spans land there (IO_ALIGN-aligned).
- `worth_whole(d, expert_reads, expert_bytes, whole_reads, whole_bytes, request_bytes)`: THE rule: read whole
  when d routed experts read apart cost at least that, a request costing REQUEST_BYTES (512 KiB: a small
  O_DIRECT read inside a pass costs ~150 us of a 2-core CPU, ~0.28 MB at 1.8 GB/s, doubled because the whole
  read hides behind the layer before). `whole_from`: the fewest such d; `param_offsets`: where an expert's
  parameters sit in the whole read.
- `WholeReads(reader, nbytes, alloc)`: two buffers ("expert_readahead"), one thread (preadv only).
  `submit(layer, read)` fills the buffer not handed out last; `take(layer)` -> (future, buffer) | None, once.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from offload.stream.hostmem import IO_ALIGN, align_up, aligned_empty
from offload.stream.storage import MERGE_GAP, DirectReader, DiskLayer, Span

REQUEST_BYTES = 512 * 1024


@dataclass(frozen=True)
class LayerRead:
    spans: list[Span]  # merged covering spans, buf_offset into the whole-layer buffer
    nbytes: int  # the buffer's bytes (IO_ALIGN multiple)
    needed: int  # file bytes requested


def layer_spans(experts: dict[tuple[int, int], DiskLayer]) -> tuple[dict[int, LayerRead], dict]:
    by_layer: dict[int, list[Span]] = {}
    for (i, _), d in experts.items():
        by_layer.setdefault(i, []).extend(d.spans)
    reads = {}
    for i, spans in by_layer.items():
        merged: list[list] = []  # [file, start, end, needed end]
        for s in sorted(spans, key=lambda s: (str(s.file), s.offset)):
            last = merged[-1] if merged else None
            if last is not None and last[0] == s.file and s.offset <= last[2] + MERGE_GAP:
                last[2], last[3] = max(last[2], s.offset + s.length), max(last[3], s.offset + s.needed)
            else:
                merged.append([s.file, s.offset, s.offset + s.length, s.offset + s.needed])
        out, off = [], 0
        for f, start, end, needed in merged:
            out.append(Span(f, start, align_up(end - start, IO_ALIGN), needed - start, off))
            off += out[-1].length
        reads[i] = LayerRead(out, off, sum(s.needed for s in out))
    where = {(i, e): [(_landing(reads[i].spans, s), s) for s in d.spans] for (i, e), d in experts.items()}
    return reads, where


def _landing(merged: list[Span], s: Span) -> int:
    """Where span `s` lands in the whole-layer buffer: inside the merged span that covers it."""
    m = next(m for m in merged if m.file == s.file and m.offset <= s.offset < m.offset + m.length)
    return m.buf_offset + s.offset - m.offset


def worth_whole(
    d: float, expert_reads: int, expert_bytes: int, whole_reads: int, whole_bytes: int, request_bytes: int
) -> bool:
    return d * (expert_reads * request_bytes + expert_bytes) >= whole_reads * request_bytes + whole_bytes


def whole_from(read: LayerRead, experts: dict[tuple[int, int], DiskLayer], i: int, request_bytes: int) -> int:
    """The fewest routed experts of layer i worth its whole read (its experts' most requests and mean bytes
    against `read`'s); more than it holds: never."""
    mine = [d for (li, _), d in experts.items() if li == i]
    reads = max(len(d.spans) for d in mine)
    nbytes = sum(s.needed for d in mine for s in d.spans) // len(mine)
    fits = (
        n for n in range(1, len(mine) + 1) if worth_whole(n, reads, nbytes, len(read.spans), read.needed, request_bytes)
    )
    return next(fits, len(mine) + 1)


def param_offsets(d: DiskLayer, landing: list[tuple[int, Span]]) -> dict[str, int]:
    """Where each of expert `d`'s parameters sits in its layer's whole read (`landing`: from `layer_spans`)."""
    out = {}
    for name, sl in d.raw.slices.items():
        off, span = next((o, s) for o, s in landing if s.buf_offset <= sl.offset < s.buf_offset + s.length)
        out[name] = off + sl.offset - span.buf_offset
    return out


class WholeReads:
    def __init__(self, reader: DirectReader, nbytes: int, alloc=aligned_empty):
        self.reader, self.nbytes, self.alloc = reader, nbytes, alloc
        self.bufs: list[torch.Tensor] = []
        self.pending: dict[int, tuple[Future, int]] = {}  # layer -> (its read, buffer index)
        self.given: int | None = None  # buffer index last handed out by take
        self._thread: ThreadPoolExecutor | None = None

    def submit(self, layer: int, read: LayerRead) -> None:
        if not self.bufs:
            self.bufs = [self.alloc(self.nbytes), self.alloc(self.nbytes)]
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="specx-experts-whole")
        b = 1 if self.given == 0 else 0
        for other in [k for k, (_, ob) in self.pending.items() if ob == b]:  # a read never taken: dropped
            self.pending.pop(other)[0].result()
        self.pending[layer] = (self._thread.submit(self._read, read, self.bufs[b]), b)

    def _read(self, read: LayerRead, buf: torch.Tensor) -> None:
        for span in read.spans:
            self.reader.read_span(span, buf)

    def take(self, layer: int) -> tuple[Future, torch.Tensor] | None:
        got = self.pending.pop(layer, None)
        if got is None:
            return None
        self.given = got[1]
        return got[0], self.bufs[got[1]]

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
