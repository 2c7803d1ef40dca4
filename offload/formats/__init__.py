"""Checkpoint formats: one reader module per on-disk layout behind one small interface (base.py).

Contract: `open_checkpoint(path)` returns the `Checkpoint` of a model directory or file, opened
and validated once (headers and metadata only) by the first reader in READERS whose
`detect(path)` is true; a path no reader claims is one OffloadError line naming the fix. Order
matters: GGUF first, then the quantized safetensors layouts (awq, gptq, compressed-tensors,
mxfp4), then plain safetensors (16/32-bit, bitsandbytes 4-bit). `__all__` also re-exports,
lazily (PEP 562: imported on first use), what a front end needs of single readers.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from offload.errors import OffloadError
from offload.formats.base import FORMATS, Checkpoint
from offload.lazy import lazy_getattr

if TYPE_CHECKING:
    from offload.cpu.ggml_kernel import enabled as ggml_kernel_enabled
    from offload.cpu.ggml_kernel import linear as ggml_linear
    from offload.formats.gguf import READER as GGUF_READER
    from offload.formats.gguf_meta import read_part as read_gguf_part
    from offload.formats.gguf_meta import value as gguf_value
    from offload.formats.hfdir import read_config
    from offload.formats.mxfp4 import dequantize_t as mxfp4_dequantize_t
    from offload.formats.ollama import resolve as resolve_ollama
    from offload.formats.pydist import find as find_pydist

READERS = ("gguf", "awq", "gptq", "compressed", "mxfp4", "safetensors")

_LAZY = {  # name here -> (module, name there)
    "ggml_kernel_enabled": ("offload.cpu.ggml_kernel", "enabled"),
    "ggml_linear": ("offload.cpu.ggml_kernel", "linear"),
    "GGUF_READER": ("offload.formats.gguf", "READER"),
    "read_gguf_part": ("offload.formats.gguf_meta", "read_part"),
    "gguf_value": ("offload.formats.gguf_meta", "value"),
    "read_config": ("offload.formats.hfdir", "read_config"),
    "mxfp4_dequantize_t": ("offload.formats.mxfp4", "dequantize_t"),
    "resolve_ollama": ("offload.formats.ollama", "resolve"),
    "find_pydist": ("offload.formats.pydist", "find"),
}

__all__ = [
    "FORMATS",
    "GGUF_READER",
    "Checkpoint",
    "find_pydist",
    "ggml_kernel_enabled",
    "ggml_linear",
    "gguf_value",
    "mxfp4_dequantize_t",
    "open_checkpoint",
    "read_config",
    "read_gguf_part",
    "resolve_ollama",
]


__getattr__ = lazy_getattr(__name__, _LAZY)  # the names of _LAZY, looked up in their modules at each use


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`, validated; OffloadError (one line, naming the fix) otherwise."""
    path = Path(path).expanduser()
    if not path.exists():
        raise OffloadError(f"{path}: no such file or directory; pass a model directory or a .gguf file")
    for name in READERS:
        reader = importlib.import_module(f"{__name__}.{name}").READER
        if reader.detect(path):
            return reader.open(path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise OffloadError(f"{path}: missing config.json; pass a Hugging Face model directory or a .gguf file")
    raise OffloadError(
        f"{path}: no *.safetensors or .gguf weights found; pass a Hugging Face model directory "
        "with safetensors weights or a .gguf file"
    )
