"""Dequantize once: a resident layer's packed linears keep their weight in the compute dtype.

Contract: a linear that rebuilds its weight from packed bytes on every forward (formats/qlinear.py
`PackedLinear`, quant/lowbit.py `LowbitLinear`) multiplies by its `dense` attribute once set, computed
by the module's own dequantization, so outputs are bitwise those of the per-forward path.
`densify(layer, pool, component)` sets it for every such linear of a bound layer (one counted `pool`
buffer each) and returns the bytes added; `dense_bytes(ckpt, i, elem)` is that cost for layer i (the
planner's figure). NF4 linears are left alone: bnb's own kernels are what they must equal.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from offload.formats.qlinear import PackedLinear
from offload.quant.lowbit import LowbitLinear

COMPONENT = "dequantized_layers"


def dense_linears(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in layer.named_modules() if isinstance(m, (PackedLinear, LowbitLinear))]


def dense_bytes(ckpt, i: int, elem: int) -> int:
    """Bytes of layer i's packed linears dequantized to `elem`-byte weights (none without `ckpt.packed`)."""
    packed = getattr(ckpt, "packed", None) or {}
    prefix = f"model.layers.{i}."
    return sum(math.prod(ckpt.logical_shape(n)) * elem for n in packed if n.startswith(prefix))


@torch.no_grad()
def densify(layer: nn.Module, pool, component: str = COMPONENT) -> int:
    added = 0
    for _, mod in dense_linears(layer):
        if mod.dense is not None:
            continue
        if isinstance(mod, PackedLinear):
            w = mod.dequantized(mod.parts_device())  # (out, in), the compute dtype
        else:
            w = mod.weight_now().to(mod.scale.dtype)
        mod.dense = pool.empty(tuple(w.shape), w.dtype, component).copy_(w)  # contiguous (out, in)
        added += mod.dense.numel() * mod.dense.element_size()
    return added
