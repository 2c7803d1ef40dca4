"""Host/device storage for decoder-layer weights: packed arenas, O_DIRECT reads, staging slots.

Contract:
- A layer's parameters live in ONE uint8 buffer described by a `LayerLayout` (name -> offset/dtype/shape):
  packed (each tensor ARENA_ALIGN-aligned, NF4 as packed uint8) for resident and RAM layers; for disk
  layers the file's own layout where it needs no cast and its offsets sit on the device's grid (CUDA:
  ARENA_ALIGN; CPU: CPU_ALIGN, GGUF's 32), so a layer costs one read and one copy; else it is re-laid.
- `DirectReader` reads 4096-aligned ranges with O_DIRECT into page-aligned buffers, falling back to
  buffered reads (one warning) where O_DIRECT is unsupported.
- `LayerStore.read(layer, h)` / `copy(layer, host, d)` are the prefetcher's two stages: host staging slot
  h (on CPU the buffer compute reads; a RAM arena itself), then on CUDA device slot d on the caller's stream.
"""

from __future__ import annotations

import errno
import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload.errors import OffloadError, OffloadNotice
from offload.stream.devmem import DevicePool
from offload.stream.hostmem import ARENA_ALIGN, IO_ALIGN, HostPins, align_up, aligned_empty
from offload.formats.prequant import packed_nf4_shape
from offload.formats.base import read_exact
from offload.formats.st_index import SafetensorsIndex, TensorEntry

MERGE_GAP = 64 * 1024
CPU_ALIGN = 32   # where a CPU computes a disk layer in its file layout (see the contract)
READ_CHUNK = 64 * 1024 * 1024


@dataclass(frozen=True)
class Slice:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class LayerLayout:
    slices: dict[str, Slice]
    nbytes: int

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        s = self.slices[name]
        return buf[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)

    def parts(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """{attribute: view} of every parameter (a fused experts module's parts, by their last name)."""
        return {name.rpartition(".")[2]: self.view(buf, name) for name in self.slices}


@dataclass(frozen=True)
class ParamSpec:
    name: str                 # relative to the layer, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]    # logical (unquantized) shape
    dtype: torch.dtype        # storage dtype when not nf4
    nf4: bool = False


def packed_layout(specs: list[ParamSpec]) -> LayerLayout:
    """Pack tensors back to back, each ARENA_ALIGN-aligned; NF4 weights as (n/2, 1) uint8."""
    slices, off = {}, 0
    for sp in specs:
        shape, dtype = (packed_nf4_shape(sp.shape), torch.uint8) if sp.nf4 else (sp.shape, sp.dtype)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        off = align_up(off, ARENA_ALIGN)
        slices[sp.name] = Slice(off, nbytes, dtype, tuple(shape))
        off += nbytes
    return LayerLayout(slices, align_up(off, ARENA_ALIGN))


@dataclass(frozen=True)
class Span:
    file: Path
    offset: int      # IO_ALIGN-aligned file offset
    length: int      # IO_ALIGN-aligned length to request
    needed: int      # bytes that must actually arrive (the span's last tensor may end before EOF pad)
    buf_offset: int  # IO_ALIGN-aligned destination offset in the staging buffer


def file_layout(entries: dict[str, TensorEntry], merge_gap: int = MERGE_GAP) -> tuple[LayerLayout, list[Span]]:
    """Covering aligned spans of a layer's tensors (merged across gaps up to `merge_gap`) + views into them."""
    order = sorted(entries.items(), key=lambda kv: (str(kv[1].file), kv[1].begin))
    groups: list[list[tuple[str, TensorEntry]]] = []
    for name, e in order:
        last = groups[-1][-1][1] if groups else None
        if last is not None and last.file == e.file and e.begin - last.end <= merge_gap:
            groups[-1].append((name, e))
        else:
            groups.append([(name, e)])
    spans, slices, buf_off = [], {}, 0
    for group in groups:
        first, end = group[0][1], max(e.end for _, e in group)
        start = first.begin // IO_ALIGN * IO_ALIGN
        length = align_up(end - start, IO_ALIGN)
        spans.append(Span(first.file, start, length, end - start, buf_off))
        for name, e in group:
            slices[name] = Slice(buf_off + e.begin - start, e.nbytes, e.dtype, e.shape)
        buf_off += length
    return LayerLayout(slices, buf_off), spans


class DirectReader:
    """O_DIRECT reader: a span is read in `chunk`-byte requests (IO_ALIGN multiples), `depth` of them in
    flight at once (depth > 1: a small thread pool; preadv releases the GIL)."""

    def __init__(self, direct: bool = True, depth: int = 1, chunk: int = READ_CHUNK):
        self.direct = direct
        self.depth, self.chunk = max(1, depth), align_up(max(chunk, IO_ALIGN), IO_ALIGN)
        self._fds: dict[tuple[Path, bool], int] = {}
        self._lock = threading.Lock()
        self._pool = None

    def _fd(self, path: Path) -> int:
        with self._lock:
            key = (path, self.direct)
            if key in self._fds:
                return self._fds[key]
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if self.direct else 0)
            try:
                self._fds[key] = os.open(path, flags)
                return self._fds[key]
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise OffloadError(f"{path}: cannot open ({exc.strerror}); check the model directory") from None
        self._fallback(path)
        return self._fd(path)

    def _fallback(self, path: Path) -> None:
        if self.direct:
            warnings.warn(f"offload: O_DIRECT unsupported for {path}; using buffered reads (page cache)",
                          OffloadNotice, stacklevel=2)
        self.direct = False

    def _read_range(self, span: Span, mv: memoryview, lo: int, hi: int) -> None:
        """Bytes [lo, hi) of the span (offsets relative to the span), short reads retried."""
        done = lo
        while done < hi:
            try:
                n = os.preadv(self._fd(span.file), [mv[done:hi]], span.offset + done)
            except OSError as exc:
                if self.direct and exc.errno == errno.EINVAL:
                    self._fallback(span.file)
                    continue
                raise OffloadError(f"{span.file}: read failed ({exc.strerror})") from None
            if n <= 0:
                if done >= min(hi, span.needed):
                    return   # the aligned tail past EOF: nothing more to read
                raise OffloadError(f"{span.file}: truncated at byte {span.offset + done}; re-download it")
            done += n

    def read_span(self, span: Span, buf: torch.Tensor) -> None:
        """Read one aligned span into buf[span.buf_offset:]; buf must be page-aligned."""
        mv = memoryview(buf.numpy()).cast("B")[span.buf_offset:span.buf_offset + span.length]
        ranges = [(lo, min(lo + self.chunk, span.length)) for lo in range(0, span.needed, self.chunk)]
        if self.depth == 1 or len(ranges) == 1:
            for lo, hi in ranges:
                self._read_range(span, mv, lo, hi)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="offload-io")
        for fut in [self._pool.submit(self._read_range, span, mv, lo, hi) for lo, hi in ranges]:
            fut.result()

    def probe(self, path: Path) -> None:
        """Try one aligned O_DIRECT read so the plan can say whether O_DIRECT works here."""
        if path.stat().st_size >= IO_ALIGN:
            self.read_span(Span(path, 0, IO_ALIGN, IO_ALIGN, 0), aligned_empty(IO_ALIGN))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def store_param(src: torch.Tensor, spec: ParamSpec, dst: torch.Tensor) -> None:
    """Write one parameter into its arena view: packed nf4 bytes as they are, else cast."""
    if spec.nf4:
        if src.dtype != torch.uint8:
            raise OffloadError(f"{spec.name}: expected packed 4-bit uint8 bytes, got {src.dtype}")
        dst.copy_(src.view(dst.shape))
    else:
        dst.copy_(src.to(spec.dtype).view(dst.shape))


@torch.no_grad()
def fill_packed(index: SafetensorsIndex, prefix: str, specs: list[ParamSpec], layout: LayerLayout,
                buf: torch.Tensor, device: torch.device) -> None:
    """Load-time fill of a packed arena from the files (direct byte read when no cast)."""
    for sp in specs:
        e = index.get(prefix + sp.name)
        want = packed_nf4_shape(sp.shape) if sp.nf4 else tuple(sp.shape)
        if tuple(e.shape) != tuple(want):
            raise OffloadError(f"{e.file}: tensor {e.name!r} has shape {list(e.shape)}, config.json "
                               f"implies {list(want)}; the checkpoint does not match its config")
        dst = layout.view(buf, sp.name)
        if e.dtype == dst.dtype and buf.device.type == "cpu":
            read_exact(e.file, e.begin, buf[layout.slices[sp.name].offset:][:e.nbytes])
        else:
            store_param(index.read(e.name), sp, dst)


def is_aligned(layout: LayerLayout, align: int = ARENA_ALIGN) -> bool:
    return all(s.offset % align == 0 for s in layout.slices.values())


@dataclass
class DiskLayer:
    spans: list[Span]
    raw: LayerLayout           # views into the read buffer (file dtypes, file offsets)
    packed: LayerLayout        # aligned compute layout (cast / quantized where needed)
    specs: list[ParamSpec]
    align: int = ARENA_ALIGN   # boundary the compute device needs its tensors on (CPU_ALIGN on a CPU)
    convert: bool = field(init=False)  # a dtype cast is needed: the read buffer is never the compute buffer

    def __post_init__(self):
        # packed nf4 bytes stream as stored; only a 16-bit dtype change needs a per-pass cast
        self.convert = any(self.raw.slices[sp.name].dtype != self.packed.slices[sp.name].dtype for sp in self.specs)

    @property
    def repack(self) -> bool:
        """The compute buffer uses `packed`: a cast, or file offsets off the `align` grid."""
        return self.convert or not is_aligned(self.raw, self.align)

    @property
    def layout(self) -> LayerLayout:
        """The layout layers bind to (device slot on CUDA, host slot on CPU)."""
        return self.packed if self.repack else self.raw

    def read(self, reader: DirectReader, raw: torch.Tensor, dest: torch.Tensor) -> None:
        """The spans read into `raw`; where `dest` is another buffer, each parameter stored there (packed)."""
        for span in self.spans:
            reader.read_span(span, raw)
        if raw is not dest:
            for sp in self.specs:
                store_param(self.raw.view(raw, sp.name), sp, self.packed.view(dest, sp.name))

    @property
    def host_layout(self) -> LayerLayout:
        """CUDA: what the pinned staging slot holds (file layout unless a cast is needed)."""
        return self.packed if self.convert else self.raw


class LayerStore:
    """Streamed layers' buffers, all allocated here once: CPU, `host_slots` pool buffers; CUDA, `slots` device
    buffers and `host_slots` pinned staging buffers; a raw buffer for re-laid or cast layers. `pins` owns every
    page-locked region (the RAM arena too); `close()` unpins them."""

    def __init__(self, device: torch.device, pool: DevicePool, slots: int,
                 ram: dict[int, tuple[torch.Tensor, LayerLayout]], disk: dict[int, DiskLayer],
                 reader: DirectReader, host_slots: int | None, staging_bytes: int | None, pins: HostPins,
                 ram_pinned: bool):
        self.device, self.pool = device, pool
        self.ram, self.disk, self.reader = ram, disk, reader
        self.after_disk_read = None  # callable(layer, host buffer) after a disk read (CPU 4-bit layout)
        self.pins = pins
        pins.attach(self)
        cuda = device.type == "cuda"
        self.ram_staged = cuda and bool(ram) and not ram_pinned   # RAM arena pageable: copy via the ring
        n_streamed = len(ram) + len(disk)
        sizes = [lay.nbytes for _, lay in ram.values()] if cuda else []
        sizes += [d.layout.nbytes for d in disk.values()]
        self.slot_bytes = max(sizes, default=0)
        self.slots = max(1, min(slots, n_streamed or 1))
        stage = max((d.host_layout.nbytes if cuda else d.layout.nbytes for d in disk.values()), default=0)
        if self.ram_staged:
            stage = max([stage] + [lay.nbytes for _, lay in ram.values()])
        self.host_slots = staging_slots(self.slots, host_slots, staging_bytes, stage, n_streamed)
        n_dev = self.slots if cuda else self.host_slots
        self.dev_slots = [pool.alloc(self.slot_bytes, "staging_slots") for _ in range(n_dev)] if self.slot_bytes else []
        raw_max = max((d.raw.nbytes for d in disk.values() if d.convert or (d.repack and not cuda)), default=0)
        self.scratch = aligned_empty(raw_max) if raw_max else None
        self.host_stage = [aligned_empty(stage) for _ in range(self.host_slots)] if cuda and stage else []
        if self.host_stage and not all([self.pins.pin(b, "the staging ring") for b in self.host_stage]):
            self.pins.notice("host->device copies of disk layers will be pageable (slower)")
        # bytes that cross the link for one load (file bytes read, or the arena), asked once per layer per pass
        self._link_bytes = {i: lay.nbytes for i, (_, lay) in ram.items()}
        self._link_bytes.update({i: sum(s.length for s in d.spans) for i, d in disk.items()})

    def close(self) -> None:
        self.pins.release()

    def layout(self, layer: int) -> LayerLayout:
        return self.ram[layer][1] if layer in self.ram else self.disk[layer].layout

    def is_free(self, layer: int) -> bool:
        """True when reading is a no-op (a RAM-tier arena): nothing to overlap."""
        return layer in self.ram and not self.ram_staged

    def link_bytes(self, layer: int) -> int:
        return self._link_bytes[layer]

    def read(self, layer: int, h: int) -> torch.Tensor:
        """Stage A: layer's bytes in host staging slot h (CPU: the buffer compute reads)."""
        if layer in self.ram:
            out = self.ram[layer][0]
            if self.ram_staged:    # pageable arena: one host memcpy into the pinned ring
                out = self.host_stage[h][:out.numel()].copy_(out)
        else:
            out = self._read_disk(layer, self.host_stage[h] if self.host_stage else self.dev_slots[h])
            if self.after_disk_read is not None:
                self.after_disk_read(layer, out)     # e.g. the CPU 4-bit kernel's byte layout
        return out

    def copy(self, layer: int, host: torch.Tensor, d: int) -> torch.Tensor:
        """Stage B (CUDA): async copy into device slot d on the caller's current (side) stream; a file layout
        off the 256-byte grid goes tensor by tensor into its packed layout (same bytes)."""
        out = self.dev_slots[d]
        dl = self.disk.get(layer)
        if dl is not None and dl.repack and not dl.convert:
            for name, src in dl.raw.slices.items():
                dst = dl.packed.slices[name]
                out[dst.offset:dst.offset + src.nbytes].copy_(host[src.offset:src.offset + src.nbytes],
                                                              non_blocking=True)
            return out
        nbytes = self.layout(layer).nbytes
        out[:nbytes].copy_(host[:nbytes], non_blocking=True)
        return out

    def _read_disk(self, layer: int, dest: torch.Tensor) -> torch.Tensor:
        d = self.disk[layer]
        via_scratch = d.convert or (d.repack and self.device.type == "cpu")
        d.read(self.reader, self.scratch if via_scratch else dest, dest)
        return dest


DEFAULT_STAGING_BYTES = 1 << 30   # host staging for disk read-ahead when nobody plans it


def staging_slots(slots: int, host_slots: int | None, staging_bytes: int | None, layer_bytes: int,
                  n_streamed: int) -> int:
    """Host staging ring size: `host_slots`, else the disk layers `staging_bytes` (default 1 GiB) holds;
    at least the device slots, at most the streamed layers."""
    if host_slots is None:
        budget = DEFAULT_STAGING_BYTES if staging_bytes is None else staging_bytes
        host_slots = budget // layer_bytes if layer_bytes else slots
    return max(slots, min(host_slots, max(n_streamed, 1)))
