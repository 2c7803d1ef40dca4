"""gpt-oss checkpoints whose experts are stored as MXFP4 (the published weights), read as stored.

Contract: `READER` claims a safetensors directory whose config.json has `quantization_config.quant_method
== "mxfp4"` (before the plain safetensors reader); a model other than gpt-oss is one OffloadError line.
Format "mxfp4". The experts' two fused matrices of each layer, logically `mlp.experts.gate_up_proj`
(E, H, 2I) and `mlp.experts.down_proj` (E, I, H) (x @ W per expert), are stored as
  `<name>_blocks` (E, N, K/32, 16) uint8: per expert, output column n, group g of 32 inputs, byte j holds
                 input 32g + 2j in its low nibble and 32g + 2j + 1 in its high nibble, FP4 e2m1 codes
                 (FP4_VALUES: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6);
  `<name>_scales` (E, N, K/32) uint8: the group's E8M0 exponent s, the group's weights being value * 2^(s - 127);
with K the input size (H or I) and N the output size (2I or H): 4.25 bits a weight. Everything else,
the experts' biases included, is a plain 16/32-bit tensor. `stored_shapes(name, shape)` maps a logical
(E, K, N) expert matrix to its two stored tensors; `dequantize(blocks, scales, dtype)` gives the
(..., N, K) weights in `dtype`, the values transformers' `convert_moe_packed_tensors` gives (a FP4 value
times a power of two: exact in any float dtype wide enough); `dequantize_t(blocks, scales, dtype)` one expert's
(N, K) matrix as its transposed (K, N) weights, the bits of `dequantize(...).t().contiguous()`, in one pass of
the C kernel on a CPU (cpu/mxfp4_kernel.py, fed a (256, 16) table of every scale x code that `dequantize`
itself computes), else by that torch path. `Mxfp4Experts` (an arch RoutedExperts)
holds the stored tensors as its parameters, so the loader keeps, streams and caches the bytes as
stored; each routed expert's two matrices are dequantized into the compute dtype when it computes.
`swap_mxfp4_experts(layers, dtype)` puts one in every decoder layer of a meta-built GptOssForCausalLM.
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
    """blocks (N, G, 16) uint8, scales (N, G) uint8 (one expert's matrix) -> its transposed weights (32 G, N) in
    `dtype`, the bits of `dequantize(blocks, scales, dtype).t().contiguous()`: one pass of the C kernel
    (cpu/mxfp4_kernel.py: a lookup in `_values`) on the CPU where it is built, else that torch path."""
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
        for name, e in sorted(ckpt.tensors.items()):
            if name.endswith(("_blocks", "_scales")) and e.dtype != torch.uint8:
                raise OffloadError(
                    f"{e.file}: tensor {name!r} is {e.dtype}, expected MXFP4 uint8; the checkpoint is corrupt - "
                    "re-download it"
                )
        return ckpt


READER = Mxfp4Reader()


def _stored_param(shape: tuple[int, ...]) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8, device="meta"), requires_grad=False)


class Mxfp4Experts(RoutedExperts):
    """gpt-oss's experts from their MXFP4 blocks and scales (see the contract)."""

    names = (
        "gate_up_proj_blocks",
        "gate_up_proj_scales",
        "gate_up_proj_bias",
        "down_proj_blocks",
        "down_proj_scales",
        "down_proj_bias",
    )

    def __init__(self, experts: nn.Module, compute_dtype: torch.dtype):
        super().__init__(experts.num_experts, experts.alpha, experts.limit)
        self.compute_dtype = compute_dtype
        for proj in ("gate_up_proj", "down_proj"):
            for name, shape in stored_shapes(proj, tuple(getattr(experts, proj).shape)).items():
                setattr(self, name, _stored_param(shape))
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
    """Every decoder layer's experts (transformers' GptOssExperts, meta) become an Mxfp4Experts."""
    for layer in layers:
        layer.mlp.experts = Mxfp4Experts(layer.mlp.experts, compute_dtype)
