"""Safetensors header parsing and tensor lookup, without the safetensors library.

Contract: `SafetensorsIndex(model_dir)` finds `model.safetensors` or the shards listed in
`model.safetensors.index.json`, parses each header (8-byte little-endian length, then JSON) and
exposes one `TensorEntry` per tensor with its absolute byte range. Headers are validated before any
tensor byte is allocated (bad JSON, truncation, unknown dtype, bad dims or offsets, byte ranges that
disagree with dtype x shape, overlapping tensors, a missing shard): OffloadError naming the file and
the first offending tensor.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from pathlib import Path

import torch

from offload.errors import OffloadError
from offload.formats.base import StoredTensors, TensorInfo

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024


# One stored tensor: name, file, dtype, shape, absolute [begin, end) byte range (formats/base.py).
TensorEntry = TensorInfo


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one safetensors file's header into entries with absolute offsets (validated)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise OffloadError(f"{path}: truncated safetensors file (no header); re-download it")
            (hlen,) = struct.unpack("<Q", head)
            if hlen < 2 or hlen > _MAX_HEADER or 8 + hlen > size:
                raise OffloadError(
                    f"{path}: corrupt or truncated safetensors header (declares {hlen} bytes, "
                    f"file has {size}); re-download it"
                )
            raw = fh.read(hlen)
    except OSError as exc:
        raise OffloadError(f"{path}: cannot read ({exc.strerror}); check the model directory") from None
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise OffloadError(f"{path}: corrupt safetensors header (bad JSON); re-download it") from None
    if not isinstance(meta, dict):
        raise OffloadError(f"{path}: corrupt safetensors header (not a JSON object); re-download it")
    entries = {n: _entry(path, n, info, 8 + hlen, size) for n, info in meta.items() if n != "__metadata__"}
    _check_overlaps(path, entries)
    return entries


def _ints(values, what: str, path: Path, name: str) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise OffloadError(f"{path}: tensor {name!r} has a bad {what} {str(values)[:60]}; re-download it")
    return tuple(values)


def _entry(path: Path, name: str, info, data_start: int, size: int) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise OffloadError(f"{path}: corrupt header entry for {name!r}; re-download it")
    dtype = ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise OffloadError(
            f"{path}: tensor {name!r} has unknown dtype {str(info['dtype'])[:30]!r}; "
            "re-download it or convert it to safetensors again"
        )
    shape = _ints(info["shape"], "shape", path, name)
    offsets = _ints(info["data_offsets"], "data_offsets", path, name)
    if len(offsets) != 2 or offsets[0] > offsets[1]:
        raise OffloadError(f"{path}: tensor {name!r} has bad data_offsets {list(offsets)}; re-download it")
    lo, hi = offsets
    # Python ints: a huge declared shape makes `expected` huge, never an allocation.
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if hi - lo != expected:
        raise OffloadError(
            f"{path}: tensor {name!r} byte range does not match its shape {list(shape)[:8]}; re-download it"
        )
    if data_start + hi > size:
        raise OffloadError(
            f"{path}: truncated (tensor {name!r} ends at byte {data_start + hi}, file has {size}); re-download it"
        )
    return TensorEntry(name, path, dtype, shape, data_start + lo, data_start + hi)


def _check_overlaps(path: Path, entries: dict[str, TensorEntry]) -> None:
    """Tensors must not share bytes (a crafted header could alias one region under many names)."""
    spans = sorted((e for e in entries.values() if e.nbytes), key=lambda e: (e.begin, e.end))
    for prev, e in itertools.pairwise(spans):
        if e.begin < prev.end:
            raise OffloadError(f"{path}: tensors {prev.name!r} and {e.name!r} overlap in the file; re-download it")


class SafetensorsIndex(StoredTensors):
    """All tensors of a HF model directory, by name."""

    def __init__(self, model_dir: str | os.PathLike):
        self.root = Path(model_dir)
        idx = self.root / "model.safetensors.index.json"
        weight_map = read_weight_map(idx) if idx.exists() else None
        self.files = self._discover(idx, weight_map)
        self.entries: dict[str, TensorEntry] = {}
        for f in self.files:
            for name, e in read_header(f).items():
                if name in self.entries:
                    raise OffloadError(
                        f"{f}: tensor {name!r} is also in {self.entries[name].file.name}; "
                        "the shards disagree, re-download the model"
                    )
                self.entries[name] = e
        # The file to name in "missing tensor" errors: the index json when sharded.
        self.source_name = idx if weight_map is not None else self.files[0]
        for name, shard in (weight_map or {}).items():
            if name not in self.entries or self.entries[name].file.name != Path(shard).name:
                raise OffloadError(
                    f"{idx}: tensor {name!r} is listed in {shard} but not stored there; re-download the model"
                )

    def _discover(self, idx: Path, weight_map: dict[str, str] | None) -> list[Path]:
        if weight_map is not None:
            files = [self.root / f for f in sorted(set(weight_map.values()))]
            for f in files:
                if not f.is_file():
                    raise OffloadError(f"{f}: shard listed in {idx.name} is missing; re-download it")
            return files
        single = self.root / "model.safetensors"
        if single.exists():
            return [single]
        found = sorted(self.root.glob("*.safetensors"))
        if not found:
            raise OffloadError(
                f"{self.root}: no model.safetensors or model.safetensors.index.json; "
                "convert the checkpoint to safetensors"
            )
        return found


def read_weight_map(idx: Path) -> dict[str, str]:
    """The index's tensor -> shard map; shard names must be plain files inside the model dir."""
    try:
        weight_map = json.loads(idx.read_bytes())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, RecursionError):
        raise OffloadError(f"{idx}: corrupt shard index (no weight_map); re-download it") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise OffloadError(f"{idx}: corrupt shard index (weight_map is not a tensor -> file map); re-download it")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise OffloadError(
                f"{idx}: tensor {name!r} maps to a bad shard name {str(shard)[:60]!r}; re-download the model"
            )
    return weight_map
