"""Checkpoint formats: one reader module per on-disk layout behind one small interface (base.py).

Contract: `open_checkpoint(path)` returns the `Checkpoint` of a model directory or file, opened
and validated once (headers and metadata only, no tensor data), by the first reader in
READERS whose `detect(path)` is true; a path no reader claims is one OffloadError line naming
the fix. Every reader module offload/formats/<name>.py exposes `READER` (a base.FormatReader).
Order matters: the quantized safetensors layouts (awq, gptq, compressed-tensors) are tried
before the plain safetensors reader (16/32-bit and bitsandbytes 4-bit), GGUF first of all.
`reader_for(ckpt)` is `ckpt.reader`; `load_weight` dequantizes one HF weight on the device.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from offload.errors import OffloadError
from offload.formats.base import FORMATS, Checkpoint, FormatReader, TensorInfo, as_stored  # noqa: F401 - the package API

READERS = ("gguf", "awq", "gptq", "compressed", "safetensors")


def readers() -> list[FormatReader]:
    """The registered readers in detection order (a reader module not present is skipped)."""
    out = []
    for name in READERS:
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            continue
        out.append(mod.READER)
    return out


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`, validated; OffloadError (one line, naming the fix) otherwise."""
    path = Path(path).expanduser()
    if not path.exists():
        raise OffloadError(f"{path}: no such file or directory; pass a model directory or a .gguf file")
    for reader in readers():
        if reader.detect(path):
            return reader.open(path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise OffloadError(f"{path}: missing config.json; pass a Hugging Face model directory or a .gguf file")
    raise OffloadError(
        f"{path}: no *.safetensors or .gguf weights found; pass a Hugging Face model directory "
        "with safetensors weights or a .gguf file"
    )


def load_weight(ckpt: Checkpoint, hf_weight_name: str, raw, device, dtype):
    """`ckpt.reader.load_weight(...)`: one HF weight, dequantized on `device` in `dtype`."""
    return ckpt.reader.load_weight(ckpt, hf_weight_name, raw, device, dtype)
