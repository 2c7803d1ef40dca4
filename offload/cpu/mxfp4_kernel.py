"""One MXFP4 expert matrix rebuilt transposed on the CPU by kernels/mxfp4_dequant.c, in one pass.

Contract: `dequantize_t(blocks, scales, table, dtype)` -> the (K, N) weight in `dtype` (K = 32 G), or None
where the C library does not serve the call (the caller runs its torch path): blocks (N, G, 16) and
scales (N, G) uint8 on the CPU (formats/mxfp4.py's layout), `table` (256, 16) in `dtype` (fp32, bf16 or
fp16), entry [s, c] the value of FP4 code c times 2^(s - 127) as the caller's reference gives it, so the
output is that reference's bits: out[32 g + j, n] = table[scales[n, g], code j of blocks[n, g]].
Served where ggml_kernel.enabled(), on `ggml_kernel.threads()` threads.
"""

from __future__ import annotations

import ctypes

import torch

from offload.cpu import ggml_kernel

WIDTHS = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}  # output dtypes the kernel writes
_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2  # mxfp4_dequant_t's argument types


def dequantize_t(
    blocks: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    if (
        dtype not in WIDTHS
        or blocks.dim() != 3
        or not blocks.is_cpu
        or table.dtype != dtype
        or tuple(table.shape) != (256, 16)
        or not ggml_kernel.enabled()
    ):
        return None
    n, g, _ = blocks.shape
    if tuple(scales.shape) != (n, g) or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not one matrix's")
    blocks, scales, table = blocks.contiguous(), scales.contiguous(), table.contiguous()
    out = torch.empty(32 * g, n, dtype=dtype)
    ptrs = (blocks.data_ptr(), scales.data_ptr(), table.data_ptr(), out.data_ptr())
    rc = ggml_kernel.function("mxfp4_dequant_t", _ARGS)(*ptrs, n, g, WIDTHS[dtype], ggml_kernel.threads())
    if rc != 0:
        raise RuntimeError(f"mxfp4_dequant_t failed ({rc})")
    return out
