"""PackedLinear: an nn.Linear stand-in whose weight stays in its checkpoint's packed form.

Contract: `swap_packed_linears(layers, ckpt, compute_dtype)` replaces every decoder-layer nn.Linear
stored packed (`ckpt.packed`) by a `PackedLinear` whose parameters are its stored tensors (named by
stored suffix, with stored dtype and shape), so the loader streams and binds them like any parameter.
`forward(x)` is `x @ W.T + bias` in `compute_dtype`, returned in x's dtype, W from the reader's
`load_weight` on x's device, or `dense` once quant/dense.py dequantized it (the same values).
GGUF on CPU in fp32 multiplies by the packed bytes (cpu/ggml_kernel.py) for up to MAX_ROWS rows, and
for any batch when there is no `dense`; siblings share one kernel call (qfuse.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from offload.cpu import ggml_kernel
from offload.formats.base import Checkpoint, meta_param
from offload.formats.gguf import _rows_to
from offload.formats.gguf_quants import BLOCK
from offload.formats.qfuse import fuse_siblings


def gguf_kernel_type(ckpt, name: str, device, dtype: torch.dtype) -> int | None:
    """ggml type of GGUF weight `name` when the CPU kernel may serve it (a type in ggml_kernel.QTYPES, CPU, fp32,
    whole blocks a row, kernel not turned off; decided without compiling, so planner and loader agree), else None."""
    info = ckpt.tensors.get(name) if getattr(ckpt, "format", None) == "gguf" else None
    if info is None or info.qtype is None or ggml_kernel.turned_off():
        return None
    qtype = info.meta.get("ggml_type")
    ok = torch.device(device).type == "cpu" and dtype == torch.float32 and qtype in ggml_kernel.QTYPES
    return qtype if ok and info.meta["shape"][-1] % BLOCK[qtype][0] == 0 else None


def row_map(ckpt, name: str) -> torch.Tensor | None:
    """int32 (rows,): the HF row of each stored row of a Q/K weight llama.cpp permuted, else None."""
    heads = ckpt.tensors[name].meta.get("permute")
    return _rows_to(ckpt.shapes[name][0], heads, "cpu").to(torch.int32) if heads else None


class PackedLinear(nn.Module):
    def __init__(self, ckpt: Checkpoint, hf_weight_name: str, has_bias: bool, compute_dtype: torch.dtype):
        super().__init__()
        self.ckpt, self.hf_name, self.compute_dtype = ckpt, hf_weight_name, compute_dtype
        self.out_features, self.in_features = ckpt.logical_shape(hf_weight_name)
        base = hf_weight_name[: -len(".weight")]
        self.parts = {}  # parameter attr -> stored tensor name
        for stored in ckpt.stored_parts(hf_weight_name):
            attr = stored[len(base) + 1 :].replace(".", "_")
            self.parts[attr] = stored
            setattr(self, attr, meta_param(ckpt.tensors[stored]))
        self.bias = (
            nn.Parameter(torch.empty(self.out_features, device="meta"), requires_grad=False) if has_bias else None
        )
        self.dense: torch.Tensor | None = None  # (out, in) in compute_dtype, once dequantized
        self.ggml_type = gguf_kernel_type(ckpt, hf_weight_name, "cpu", compute_dtype)
        self.row_map = row_map(ckpt, hf_weight_name) if self.ggml_type is not None else None
        self.group = None  # a qfuse.FusedGroup computing its siblings in one call

    def parts_device(self) -> torch.device:
        """Where the stored parts are bound (meta until the loader binds them)."""
        return getattr(self, next(iter(self.parts))).device

    def dequantized(self, device) -> torch.Tensor:
        raw = {stored: getattr(self, attr) for attr, stored in self.parts.items()}
        return self.ckpt.reader.load_weight(self.ckpt, self.hf_name, raw, device, self.compute_dtype)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        """x W^T (+ b) from the packed GGUF bytes on CPU, or None where the kernel does not apply."""
        raw = getattr(self, next(iter(self.parts)))
        limit = ggml_kernel.MAX_ROWS if self.dense is not None else None  # beats per-call dequantization at any T
        if raw.device.type != "cpu" or not ggml_kernel.usable(x, self.ggml_type, limit):
            return None
        y = ggml_kernel.linear(x, raw, self.ggml_type, self.out_features, self.row_map)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None and (y := self.group.take(self, x)) is not None:
            return y
        if self.ggml_type is not None and (y := self._kernel(x)) is not None:
            return y
        w = self.dense if self.dense is not None else self.dequantized(x.device)  # (out, in), compute dtype
        if x.dtype == self.compute_dtype and self.bias is None:
            return F.linear(x, w)
        bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
        return F.linear(x.to(self.compute_dtype), w, bias).to(x.dtype)


def swap_packed_linears(layers: nn.ModuleList, ckpt: Checkpoint, compute_dtype: torch.dtype) -> None:
    for i, layer in enumerate(layers):
        for name, mod in list(layer.named_modules()):
            hf_name = f"model.layers.{i}.{name}.weight"
            if isinstance(mod, nn.Linear) and hf_name in ckpt.packed:
                parent_name, _, child = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, child, PackedLinear(ckpt, hf_name, mod.bias is not None, compute_dtype))
        fuse_siblings(layer)
