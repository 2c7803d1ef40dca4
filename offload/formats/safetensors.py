"""Safetensors model directories in 16/32 bits, or pre-quantized bitsandbytes 4-bit (nf4/fp4).

Contract: `READER` claims any directory with config.json and *.safetensors (the quantized layouts are
detected before it). `open` validates the headers (st_index), refuses a `quantization_config` other than
bitsandbytes 4-bit (prequant.bnb4_config) and checks the tensor set against config.json's architecture
(validate.check_tensors; a bnb weight is its packed uint8 tensor plus its quant state). Format:
"bnb-nf4", else the decoder weights' dtype ("bf16" / "fp16" / "fp32"). `load_weight` casts a plain
weight; a bnb weight goes through bitsandbytes' own `dequantize_4bit`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from offload.errors import OffloadError
from offload.formats import hfdir, validate
from offload.formats.base import Checkpoint, as_stored
from offload.formats.st_index import SafetensorsIndex

_FLOAT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def float_format(tensors) -> str:
    """The dtype most decoder-weight bytes are stored in, as a format name."""
    by = {}
    for t in tensors.values():
        if t.name.startswith("model.layers.") and t.dtype in _FLOAT_FORMATS:
            by[t.dtype] = by.get(t.dtype, 0) + t.nbytes
    if not by:
        by = {t.dtype: t.nbytes for t in tensors.values() if t.dtype in _FLOAT_FORMATS}
    return _FLOAT_FORMATS[max(by, key=by.get)] if by else "fp32"


def bnb_parts(tensors) -> dict[str, tuple[str, ...]]:
    """HF weight -> (packed uint8 tensor, its quant-state tensors) of every bnb-packed weight."""
    from offload.formats.prequant import QS_KINDS, QS_PARTS

    out = {}
    for name in tensors:
        base, sep, kind = name.rpartition(".quant_state.bitsandbytes__")
        if sep and kind in QS_KINDS:
            out[base] = (base, *(f"{base}.{p}" for p in QS_PARTS if f"{base}.{p}" in tensors), name)
    return out


class SafetensorsReader:
    name = "safetensors"

    def detect(self, path: Path) -> bool:
        return hfdir.is_st_dir(path)

    def open(self, path: Path) -> Checkpoint:
        from offload.formats.prequant import bnb4_config, packed_nf4_shape

        cfg = hfdir.read_config(path)
        index = SafetensorsIndex(path)
        config = hfdir.hf_config(path)
        try:
            quant = bnb4_config(config)
        except OffloadError as exc:
            raise OffloadError(f"{path / 'config.json'}: {exc}") from None
        packed = bnb_parts(index.entries) if quant is not None else {}
        fmt = "bnb-nf4" if quant is not None else float_format(index.entries)
        ckpt = hfdir.checkpoint(path, self, fmt, cfg, config, quant, packed, index)

        def parts(name, shape):
            if name not in packed:
                return None
            return {p: (packed_nf4_shape(shape) if p == name else None) for p in packed[name]}

        ckpt.shapes = validate.check_tensors(ckpt, parts)
        self.check_uint8(ckpt, packed, "packed 4-bit")
        return ckpt

    def check_uint8(self, ckpt: Checkpoint, names, what: str) -> None:
        """Refuses the first of the stored tensors `names` (sorted) that is not uint8 (`what`: its packing)."""
        for name in sorted(names):
            e = ckpt.tensors[name]
            if e.dtype != torch.uint8:
                raise OffloadError(
                    f"{e.file}: tensor {name!r} is {e.dtype}, expected {what} uint8; the checkpoint is corrupt - "
                    "re-download it"
                )

    def load_weight(self, ckpt: Checkpoint, hf_weight_name: str, raw, device, dtype) -> torch.Tensor:
        if hf_weight_name not in ckpt.packed:
            info = ckpt.tensors[hf_weight_name]
            return as_stored(info, raw[hf_weight_name]).to(device=device, dtype=dtype)
        from bitsandbytes.functional import QuantState, dequantize_4bit

        names = ckpt.packed[hf_weight_name]
        parts = {n[len(hf_weight_name) + 1 :]: as_stored(ckpt.tensors[n], raw[n]).to(device) for n in names[1:]}
        state = QuantState.from_dict(parts, device=torch.device(device))
        packed = as_stored(ckpt.tensors[names[0]], raw[names[0]]).to(device)
        return dequantize_4bit(packed, state).to(dtype)


READER = SafetensorsReader()
