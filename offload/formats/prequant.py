"""Pre-quantized bitsandbytes 4-bit checkpoints: the format `save_pretrained` writes for a model
loaded with `BitsAndBytesConfig(load_in_4bit=True)` (and of the `*-bnb-4bit` repositories).

Contract: `bnb4_config(config)` is None for a 16-bit checkpoint, the `quantization_config` dict for a
bitsandbytes 4-bit one (nf4 or fp4, uint8 storage), else an OffloadError naming the setting. On disk a
quantized linear `X.weight` is its packed uint8 codes (two per byte, shape (ceil(n/2), 1)) beside its
quant state: `X.weight.absmax`, `.quant_map`, with double quantization `.nested_absmax` and
`.nested_quant_map`, and the JSON-in-uint8 `.quant_state.bitsandbytes__nf4|fp4`. `load_quant_state`
rebuilds bitsandbytes' QuantState (never re-quantizes); `quant_tensors(name, packed, state)` is its
inverse, for the 4-bit cache writer.
"""

from __future__ import annotations

import math

import torch

from offload.errors import OffloadError


def packed_nf4_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape of quantize_4bit's packed output: two 4-bit codes per byte, one column."""
    return ((math.prod(shape) + 1) // 2, 1)


QS_KINDS = ("nf4", "fp4")
QS_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def bnb4_config(config) -> dict | None:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    four = qc.get("load_in_4bit", qc.get("_load_in_4bit", False))
    if method != "bitsandbytes" or not four:
        what = f"{method} 8-bit" if method == "bitsandbytes" else str(method)
        raise OffloadError(
            f"quantization {what!r} is not supported; use a bitsandbytes 4-bit (nf4/fp4) "
            "checkpoint or a 16-bit one with --dtype nf4"
        )
    storage = qc.get("bnb_4bit_quant_storage", "uint8")
    if storage not in ("uint8", None):
        raise OffloadError(f"bnb_4bit_quant_storage {storage!r} is not supported; re-save with uint8 storage")
    return qc


def load_quant_state(index, name: str, device: torch.device, logical_shape: tuple[int, ...]):
    """QuantState of packed weight `name`, its small tensors on `device`; checks the logical shape."""
    from bitsandbytes.functional import QuantState

    keys = (f"{name}.quant_state.bitsandbytes__{kind}" for kind in QS_KINDS)
    key = next((k for k in keys if k in index.entries), None)
    if key is None:
        raise OffloadError(
            f"{index.source_name}: {name!r} has no bitsandbytes quant_state; the checkpoint is incomplete"
        )
    parts = {key[len(name) + 1 :]: index.read(key)}  # "quant_state.bitsandbytes__nf4": packed JSON
    for part in QS_PARTS:
        if f"{name}.{part}" in index.entries:
            parts[part] = index.read(f"{name}.{part}")
    try:
        state = QuantState.from_dict(parts, device=device)
    except (ValueError, KeyError, AssertionError) as exc:
        raise OffloadError(f"{index.get(key).file}: bad quant state for {name!r} ({exc}); re-download it") from None
    if tuple(state.shape) != tuple(logical_shape):
        raise OffloadError(
            f"{index.get(key).file}: {name!r} is quantized with shape {list(state.shape)}, "
            f"config.json implies {list(logical_shape)}; the checkpoint does not match its config"
        )
    return state


def quant_tensors(name: str, packed: torch.Tensor, state) -> dict[str, torch.Tensor]:
    """The tensors bitsandbytes/transformers save for one quantized weight (CPU, contiguous)."""
    out = {name: packed.cpu().contiguous()}
    for part, t in state.as_dict(packed=True).items():
        out[f"{name}.{part}"] = t.cpu().contiguous()
    return out
