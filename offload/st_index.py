"""Safetensors header parsing and tensor lookup, without the safetensors library.

Contract: `SafetensorsIndex(model_dir)` finds `model.safetensors` or the shards listed in
`model.safetensors.index.json`, parses each header itself (8-byte little-endian length, then
JSON), and exposes one `TensorEntry` per tensor with its absolute byte range in its file.
Headers are validated up front: unparsable JSON, a header or data region longer than the
file (truncation), byte ranges that disagree with dtype x shape, or a weight_map naming a
missing shard raise `OffloadError` naming the file. `read(name)` returns a CPU tensor in the
file's dtype via buffered reads (used at load time only; streaming uses storage.DirectReader).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import OffloadError

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset of the first byte in `file`
    end: int    # absolute offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one safetensors file's header into entries with absolute offsets."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise OffloadError(f"{path}: truncated safetensors file (no header); re-download it")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > _MAX_HEADER or 8 + hlen > size:
            raise OffloadError(f"{path}: corrupt or truncated safetensors header; re-download it")
        raw = fh.read(hlen)
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise OffloadError(f"{path}: corrupt safetensors header (bad JSON); re-download it") from None
    if not isinstance(meta, dict):
        raise OffloadError(f"{path}: corrupt safetensors header; re-download it")
    data_start = 8 + hlen
    entries = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, info, data_start, size)
    return entries


def _entry(path: Path, name: str, info, data_start: int, size: int) -> TensorEntry:
    try:
        dtype = ST_DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        lo, hi = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise OffloadError(f"{path}: corrupt header entry for {name!r}; re-download it") from None
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if hi - lo != expected or lo < 0:
        raise OffloadError(f"{path}: tensor {name!r} byte range does not match its shape; re-download it")
    if data_start + hi > size:
        raise OffloadError(
            f"{path}: truncated (tensor {name!r} ends at byte {data_start + hi}, file has {size}); re-download it"
        )
    return TensorEntry(name, path, dtype, shape, data_start + lo, data_start + hi)


class SafetensorsIndex:
    """All tensors of a HF model directory, by name."""

    def __init__(self, model_dir: str | os.PathLike):
        self.root = Path(model_dir)
        self.files = self._discover()
        self.entries: dict[str, TensorEntry] = {}
        for f in self.files:
            self.entries.update(read_header(f))
        # The file to name in "missing tensor" errors: the index json when sharded.
        idx = self.root / "model.safetensors.index.json"
        self.source_name = idx if idx.exists() else self.files[0]

    def _discover(self) -> list[Path]:
        idx = self.root / "model.safetensors.index.json"
        if idx.exists():
            try:
                weight_map = json.loads(idx.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise OffloadError(f"{idx}: corrupt shard index (no weight_map); re-download it") from None
            files = [self.root / f for f in sorted(set(weight_map.values()))]
            for f in files:
                if not f.exists():
                    raise OffloadError(f"{f}: shard listed in {idx.name} is missing; re-download it")
            return files
        single = self.root / "model.safetensors"
        if single.exists():
            return [single]
        found = sorted(self.root.glob("*.safetensors"))
        if not found:
            raise OffloadError(f"{self.root}: no model.safetensors or model.safetensors.index.json; "
                               "convert the checkpoint to safetensors")
        return found

    def get(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise OffloadError(f"{self.source_name}: missing tensor {name!r}; the checkpoint is incomplete "
                               "or does not match config.json") from None

    def read(self, name: str) -> torch.Tensor:
        """Read a tensor (CPU, file dtype) with buffered I/O."""
        e = self.get(name)
        out = torch.empty(e.nbytes, dtype=torch.uint8)
        read_exact(e.file, e.begin, out)
        return out.view(e.dtype).view(e.shape) if e.shape else out.view(e.dtype).reshape(())


def read_exact(path: Path, offset: int, out: torch.Tensor) -> None:
    """Buffered read of `out.numel()` bytes at `offset` straight into a uint8 tensor."""
    mv = memoryview(out.numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], offset + done)
            if n <= 0:
                raise OffloadError(f"{path}: truncated while reading at byte {offset + done}; re-download it")
            done += n
    finally:
        os.close(fd)
