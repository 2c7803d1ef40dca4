"""gpt-oss checkpoints whose experts are stored as MXFP4 (the published weights), read as stored.

Contract: `READER` claims a safetensors directory whose config.json has `quantization_config.quant_method
== "mxfp4"`; a model other than gpt-oss is one OffloadError line. Each layer's `mlp.experts.gate_up_proj`
(E, H, 2I) and `mlp.experts.down_proj` (E, I, H) (x @ W per expert; K inputs, N outputs) are stored as
  `<name>_blocks` (E, N, K/32, 16) uint8: byte j of group g holds inputs 32g + 2j (low nibble) and
                 32g + 2j + 1 (high nibble) as FP4 e2m1 codes (FP4_VALUES)
  `<name>_scales` (E, N, K/32) uint8: the group's E8M0 exponent s, its weights being value * 2^(s - 127)
and everything else as plain tensors. `dequantize(blocks, scales, dtype)` gives the (..., N, K) weights
transformers' `convert_moe_packed_tensors` gives; `dequantize_t` one expert's transposed (K, N), the
same bits, by the C kernel on a CPU (cpu/mxfp4_kernel.py, fed `_values`), else by torch.
`Mxfp4Experts` (an arch RoutedExperts) holds the stored tensors as its parameters and dequantizes each
routed expert when it computes; `swap_mxfp4_experts(layers, dtype)` puts one in every decoder layer.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from torch import nn

from offload.arch.gptoss_experts import RoutedExperts
from offload.cpu import mxfp4_kernel
from offload.errors import OffloadError
from offload.formats import hfdir, validate
from offload.formats.base import Checkpoint
from offload.formats.safetensors import SafetensorsReader

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # weights per scale
FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # the expert matrices stored as MXFP4
BIAS = 127  # E8M0 exponent bias


def stored_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Logical (E, K, N) expert matrix `name` -> {blocks name: (E, N, K/32, 16), scales name: (E, N, K/32)}."""
    e, k, n = shape
    return {f"{name}_blocks": (e, n, k // GROUP, GROUP // 2), f"{name}_scales": (e, n, k // GROUP)}


@cache
def _tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs (256,): byte b -> its two values (FP4_VALUES[b & 15], FP4_VALUES[b >> 4]) in `dtype`, packed in one
    integer word of twice the width, low value first in memory; powers (256,) fp32: E8M0 s -> 2^(s - 127))."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    pair = torch.stack((lut.repeat(16), lut.repeat_interleave(16)), dim=-1).contiguous()  # (256, 2): lo, hi
    word = {2: torch.int32, 4: torch.int64, 8: None}[lut.element_size()]
    if word is None:
        raise OffloadError(f"MXFP4 weights dequantize into 16/32-bit floats, not {dtype}")
    # 2^(s - 127) exactly (2^-127 is an fp32 subnormal, 2^128 overflows to inf, as transformers' ldexp gives)
    powers = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - BIAS).float()
    return pair.view(word).reshape(256).to(device), powers.to(device)


@cache
def _values(dtype: torch.dtype) -> torch.Tensor:
    """(256, 16) in `dtype`: [s, c] = FP4_VALUES[c] x 2^(s - 127) as `dequantize` computes it (the same ops on a
    group holding every code: bytes 0x10, 0x32, ..., 0xFE twice), the table cpu/mxfp4_kernel.py writes from."""
    codes = torch.tensor([lo | (lo + 1) << 4 for lo in range(0, 16, 2)] * 2, dtype=torch.uint8)
    blocks = codes.expand(256, 1, 16)
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1)
    return dequantize(blocks, scales, dtype)[:, :16].contiguous()


def dequantize_t(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks (N, G, 16), scales (N, G) uint8 (one expert) -> (32 G, N) in `dtype` (see the contract)."""
    if blocks.is_cpu and dtype in mxfp4_kernel.WIDTHS:
        out = mxfp4_kernel.dequantize_t(blocks, scales, _values(dtype), dtype)
        if out is not None:
            return out
    return dequantize(blocks, scales, dtype).t().contiguous()


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks (..., N, G, 16) uint8, scales (..., N, G) uint8 -> weights (..., N, 32 G) in `dtype`."""
    pairs, powers = _tables(dtype, blocks.device)
    # one gather: byte j of a group -> its two weights, inputs 2j (low nibble) and 2j + 1 (high nibble)
    vals = pairs[blocks.int()].view(dtype)  # (..., N, G, 32)
    # value * 2^(s - 127): the product is computed in fp32 and rounded into `dtype`, as transformers' ldexp
    vals.mul_(powers[scales.int()][..., None])
    return vals.reshape(*blocks.shape[:-2], -1)


class Mxfp4Reader(SafetensorsReader):
    name = "mxfp4"

    def detect(self, path: Path) -> bool:
        return hfdir.is_st_dir(path) and hfdir.quant_method(path) == "mxfp4"

    def open(self, path: Path) -> Checkpoint:
        cfg = hfdir.read_config(path)
        config = hfdir.hf_config(path)
        if config.model_type != "gpt_oss":
            raise OffloadError(
                f"{path / 'config.json'}: MXFP4 is read for gpt-oss's experts only, not {config.model_type!r}; "
                "use a 16-bit checkpoint"
            )
        ckpt = hfdir.checkpoint(path, self, "mxfp4", cfg, config, hfdir.quant_config(cfg))

        def parts(name, shape):
            return stored_shapes(name, shape) if name.endswith(FUSED) else None

        ckpt.shapes = validate.check_tensors(ckpt, parts)
        self.check_uint8(ckpt, [n for n in ckpt.tensors if n.endswith(("_blocks", "_scales"))], "MXFP4")
        return ckpt


READER = Mxfp4Reader()


class Mxfp4Experts(RoutedExperts):
    names = tuple(f"{p}_{s}" for p in ("gate_up_proj", "down_proj") for s in ("blocks", "scales", "bias"))

    def __init__(self, experts: nn.Module, compute_dtype: torch.dtype):
        super().__init__(experts, compute_dtype)
        for proj in ("gate_up_proj", "down_proj"):
            for name, shape in stored_shapes(proj, tuple(getattr(experts, proj).shape)).items():
                p = torch.empty(shape, dtype=torch.uint8, device="meta")
                setattr(self, name, nn.Parameter(p, requires_grad=False))
            setattr(self, f"{proj}_bias", getattr(experts, f"{proj}_bias"))

    def weights(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """One expert's (gate_up (H, 2I), its bias, down (I, H), its bias), dequantized into the compute dtype."""
        out = []
        for proj in ("gate_up_proj", "down_proj"):
            # (K, N): x @ W, laid out as transformers' (the torch path: at most two copies of gate_up at once,
            # the plan's mxfp4 temporaries)
            out += [dequantize_t(parts[f"{proj}_blocks"], parts[f"{proj}_scales"], self.compute_dtype)]
            out += [parts[f"{proj}_bias"]]
        return tuple(out)


def swap_mxfp4_experts(layers: nn.ModuleList, compute_dtype: torch.dtype) -> None:
    for layer in layers:
        layer.mlp.experts = Mxfp4Experts(layer.mlp.experts, compute_dtype)
