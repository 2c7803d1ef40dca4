"""Routed experts' file spans merged into runs: one read request for each run of close spans.

Contract (stream/expertstore.py's ExpertStore.stream plans and reads a layer's routed experts of one pass so):
- `MergeRule(gap, cap, ratio)`: when the span after a run joins it (read in the same request): same file,
  and the bytes the merge adds to the disk's work fit in `gap`, the bytes one request's latency reads
  (disk_read_s x disk_bps): the bytes between the run's end and the span (none where they overlap: aligned
  spans of neighbouring rows share a page) plus `ratio` x the bytes the merge makes copy (a merged run is
  read into a buffer, so an expert computed in its file layout is copied out of it: the span's own bytes,
  and the run's first span's when the span is its second; a re-laid expert is cast out of the read buffer
  either way: no extra copy); and the run stays within `cap` bytes (RUN_REQUESTS x gap: a longer run
  saves under 1/RUN_REQUESTS of its read time, and a pass's first expert waits for its whole run).
  `MergeRule.of(machine)`: the rule of the memory plan's passcost.Device (plan.machine: `specx profile`'s
  disk latency, disk rate and memory bandwidth, else the priors), `ratio` = disk_bps / (memory_bps / 2)
  (a copy reads and writes); None (no plan): the CPU priors of planning/passcost.PRIORS, restated in
  PRIOR (the engine never imports the plan).
- `Piece(need, span, expert, dest)`: one file span of a routed expert to read: `need` the position of its
  expert in the pass's compute order, `span` the expert's (its buf_offset: where it lands in the expert's
  file layout), `expert` its storage.DiskLayer, `dest` its cache slot.
- `merge(pieces, rule)` -> runs, each [Piece], in the order the pass needs them (the run holding the
  first expert first; ties in file order): the pieces in (file, offset) order, each joining the run
  before it where `rule` allows. Pure.
- `read_run(reader, run, buf)` -> bytes requested: one `reader.read_span` of the run's covering span
  (the run's first offset to its furthest end, IO_ALIGN multiples, as its spans are), then every piece in
  its expert's slot: a lone piece of an expert computed in its file layout is read straight into the
  slot (O_DIRECT lands there); otherwise the run lands in `buf` (page-aligned, at least the run's length)
  and each piece is copied out of it, or its parameters cast out of it into the expert's packed layout
  (storage.store_param) where the expert is re-laid.
- `expected_requests(m, n, stride, rule, copied)` -> (requests, bytes between): the expected requests, and
  bytes read between merged spans, of one span group (the same tensor's rows of every expert, `stride`
  bytes apart; a safetensors expert's one span, in the file's order) when m of its n experts miss the
  cache, uniformly at random: m minus the expected consecutive missing pairs with j <= J experts between
  them, (n - 1 - j) x C(n - 2 - j, m - 2) / C(n, m) for each j, J the most experts whose bytes a merge reads
  (j x stride + ratio x the bytes it copies <= gap, priced as a run's second span, the dearer join;
  `copied`: the experts compute in their file layout). The cap's splits are left out: each adds one request
  to a run of at least RUN_REQUESTS requests' latency in bytes (under 1/RUN_REQUESTS of its read time).
  The memory plan prices a pass's reads with it (planning/expertcost.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offload.stream.hostmem import IO_ALIGN
from offload.stream.storage import DirectReader, DiskLayer, Span, store_param

RUN_REQUESTS = 16  # a run's cap, in requests' worth of latency bytes (see the contract)
MAX_RUN = 64 * 1024 * 1024  # the cap's ceiling: the read buffer's size whatever the machine's figures
PRIOR = dict(disk_read_s=1e-4, disk_bps=2e9, memory_bps=20e9)  # planning/passcost.PRIORS["cpu"]'s


@dataclass(frozen=True)
class MergeRule:
    gap: int  # bytes one request's latency reads
    cap: int  # the longest run a merge makes
    ratio: float  # disk seconds per byte over copy seconds per byte

    @classmethod
    def of(cls, machine: dict | None) -> MergeRule:
        """The rule of a passcost.Device as a dict (plan.machine), or of the CPU priors (see the contract)."""
        m = {k: (machine or {}).get(k) or v for k, v in PRIOR.items()}
        gap = int(m["disk_read_s"] * m["disk_bps"]) // IO_ALIGN * IO_ALIGN
        return cls(gap, min(RUN_REQUESTS * gap, MAX_RUN), m["disk_bps"] / (m["memory_bps"] / 2))


@dataclass(frozen=True)
class Piece:
    need: int
    span: Span
    expert: DiskLayer
    dest: torch.Tensor

    @property
    def copied(self) -> int:
        """Bytes a merged read makes copy for this piece: its own where its expert computes in its file layout."""
        return 0 if self.expert.repack else self.span.needed


def _end(run: list[Piece]) -> int:
    return max(p.span.offset + p.span.length for p in run)


def _joins(run: list[Piece], p: Piece, rule: MergeRule) -> bool:
    """Whether `p` (after `run` in file order) is read in the run's request (see the contract)."""
    first = run[0].span
    if p.span.file != first.file or max(_end(run), p.span.offset + p.span.length) - first.offset > rule.cap:
        return False
    between = max(0, p.span.offset - _end(run))
    copied = p.copied + (run[0].copied if len(run) == 1 else 0)
    return between + rule.ratio * copied <= rule.gap


def merge(pieces: list[Piece], rule: MergeRule) -> list[list[Piece]]:
    """The pieces in runs, in the order the pass needs them (see the contract)."""
    runs: list[list[Piece]] = []
    for p in sorted(pieces, key=lambda p: (str(p.span.file), p.span.offset)):
        if runs and _joins(runs[-1], p, rule):
            runs[-1].append(p)
        else:
            runs.append([p])
    return sorted(runs, key=lambda r: (min(p.need for p in r), str(r[0].span.file), r[0].span.offset))


def covering(run: list[Piece]) -> Span:
    """The one span a run is read as, landing at the start of the read buffer."""
    first = run[0].span
    needed = max(p.span.offset + p.span.needed for p in run) - first.offset
    return Span(first.file, first.offset, _end(run) - first.offset, needed, 0)


def read_run(reader: DirectReader, run: list[Piece], buf: torch.Tensor | None) -> int:
    """Read one run into its pieces' slots (see the contract); the bytes requested."""
    span = covering(run)
    if len(run) == 1 and not run[0].expert.repack:
        reader.read_span(run[0].span, run[0].dest)
        return span.length
    reader.read_span(span, buf)
    for p in run:
        at = p.span.offset - span.offset  # where the piece's first byte landed in buf
        d = p.expert
        if not d.repack:  # numpy's memcpy, one thread: torch's copy_ here would start an OpenMP team
            n, lo = p.span.needed, p.span.buf_offset  # in this worker thread, spinning beside the compute's
            p.dest.numpy()[lo : lo + n] = buf.numpy()[at : at + n]
            continue
        base = at - p.span.buf_offset  # buf offset of the expert's raw layout origin, for this span's tensors
        for sp in d.specs:
            s = d.raw.slices[sp.name]
            if p.span.buf_offset <= s.offset < p.span.buf_offset + p.span.length:
                raw = buf[base + s.offset : base + s.offset + s.nbytes].view(s.dtype).view(s.shape)
                store_param(raw, sp, d.packed.view(p.dest, sp.name))
    return span.length


def expected_requests(m: float, n: int, stride: int, rule: MergeRule, copied: bool) -> tuple[float, float]:
    """(expected requests, expected bytes read between merged spans) of one span group (see the contract)."""
    m = min(max(m, 0.0), float(n))
    if m < 2 or not stride:
        return m, 0.0
    # the join is priced as a run's second span (the dearer one: it copies the first span's bytes too)
    most = math.floor((rule.gap - rule.ratio * (2 * stride if copied else 0)) / stride)
    lo, frac = int(m), m - int(m)  # a fractional m (a cache's expected misses): between its neighbours
    out = []
    for k in (lo, min(lo + 1, n)):
        pairs = [(n - 1 - j) * math.comb(n - 2 - j, k - 2) / math.comb(n, k) for j in range(min(most, n - 2) + 1)]
        out.append((k - sum(pairs), sum(j * stride * c for j, c in enumerate(pairs))))
    (r0, b0), (r1, b1) = out
    return r0 + frac * (r1 - r0), b0 + frac * (b1 - b0)
