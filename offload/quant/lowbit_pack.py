"""The self-draft's HQQ substitutes in blocks the CPU kernel reads directly (specx's SX3 / SX2 types).

Contract:
- `SX3`, `SX2` (cpu/kernels/ggml_blocks.h has the layouts): 3-bit codes in blocks of 64 values (28 bytes),
  2-bit in blocks of 32 (12 bytes), one fp16 pair (d, m) a block, w = d * q + m (the fp32 product, then
  + m, rounded apart). `TYPE_OF_BITS[bits]`; `BLOCKS[type] = (values, bytes)`.
- `pack(codes, scale, zero, bits, n_rows)` -> (N, row bytes) uint8: HQQ's W[g] = (q[g] - zero[g]) * scale[g]
  (groups of lowbit.GROUPS[bits] input values, row-major) as one block a group, d = scale,
  m = -zero * scale (each rounded to fp16 once); `dequantize(raw, qtype, N, K)` -> the (N, K) fp32 weight.
- For K a multiple of 64 the kernel multiplies 8-bit activations (cpu/kernels/sx_q8.h): per 64 values
  x ~ sx * xq, sx = amax / 127, y = xhat (d (q - C))^T + x (m + C d)^T with codes centred on C = 3.5 / 1.5,
  about 0.5% of |y| from x W^T (tests/test_lowbit_blocks.py's reference); other K: fp32.
- `KernelLowbitLinear(raw, qtype, out, in)`: y = x W^T through ggml_kernel.linear for fp32 CPU input, else
  by `dequantize`; it exposes what cpu/leanstack.py reads of a kernel-served linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from offload.cpu import ggml_kernel

SX3, SX2 = ggml_kernel.SX3, ggml_kernel.SX2
TYPE_OF_BITS = {3: SX3, 2: SX2}
BLOCKS = {t: ggml_kernel.BLOCKS[t] for t in (SX3, SX2)}  # values, bytes of one block (= one HQQ group)
_BITS = {SX3: 3, SX2: 2}
_HALF_BYTES = {3: 6, 2: 4}  # bytes of one half's field: 48 bits (3-bit), a u32 (2-bit)


def _words(fields: torch.Tensor, width: int) -> torch.Tensor:
    """(..., 32 // width) small ints -> (...,) int64 words: field j at bits width * j."""
    shifts = torch.arange(fields.shape[-1], dtype=torch.int64) * width
    return (fields.to(torch.int64) << shifts).sum(-1)


def _le_bytes(words: torch.Tensor, width: int) -> torch.Tensor:
    """(..., n) int64 holding `width`-byte values -> (..., width n) uint8, little-endian."""
    b = torch.stack([(words >> (8 * i)) & 0xFF for i in range(width)], dim=-1)
    return b.to(torch.uint8).flatten(-2)


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, n_rows: int) -> torch.Tensor:
    qtype = TYPE_OF_BITS[bits]
    values, nbytes = BLOCKS[qtype]
    q = codes.to(torch.int64).reshape(-1, values)  # (groups, group): one block each
    if q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):
        raise ValueError(f"{bits}-bit codes outside [0, {1 << bits})")
    s = scale.reshape(-1).float()
    d = s.to(torch.float16)
    m = (-zero.reshape(-1).float() * s).to(torch.float16)
    head = torch.stack([d, m], dim=1).view(torch.uint8)  # (groups, 4): fp16 d, fp16 m
    halves = q.reshape(q.shape[0], -1, 2, 16)  # (groups, sub-blocks, half, 16): value j at bits `bits` * j
    body = _le_bytes(_words(halves, bits), _HALF_BYTES[bits]).flatten(1)
    out = torch.cat([head, body], dim=1)
    assert out.shape[1] == nbytes
    return out.reshape(n_rows, -1).contiguous()


def _fields(words: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """(...,) int64 words -> (..., n) fields of `width` bits (the inverse of _words)."""
    shifts = torch.arange(n, dtype=torch.int64) * width
    return (words[..., None] >> shifts) & ((1 << width) - 1)


def dequantize(raw: torch.Tensor, qtype: int, n_rows: int, k: int) -> torch.Tensor:
    values, nbytes = BLOCKS[qtype]
    blk = raw.reshape(-1, nbytes)
    dm = blk[:, :4].contiguous().view(torch.float16).float()  # (groups, 2)
    body = blk[:, 4:].to(torch.int64)
    bits = _BITS[qtype]
    words = _words(body.reshape(blk.shape[0], -1, _HALF_BYTES[bits]), 8)  # (groups, halves): little-endian bytes
    q = _fields(words, bits, 16).reshape(blk.shape[0], values).float()
    return (q * dm[:, :1] + dm[:, 1:]).reshape(n_rows, k)


class KernelLowbitLinear(nn.Module):
    def __init__(self, raw: torch.Tensor, qtype: int, out_features: int, in_features: int):
        super().__init__()
        self.register_buffer("packed", raw)  # (out, in / values * bytes) uint8 kernel blocks
        self.parts = {"packed": "packed"}  # what leanstack.py reads: attribute of the bytes
        self.ggml_type, self.bits = qtype, _BITS[qtype]
        self.out_features, self.in_features = out_features, in_features
        self.bias, self.row_map, self.group, self.dense = None, None, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ggml_kernel.usable(x, self.ggml_type, max_rows=None):
            return ggml_kernel.linear(x, self.packed, self.ggml_type, self.out_features)
        w = dequantize(self.packed, self.ggml_type, self.out_features, self.in_features)
        return F.linear(x, w.to(device=x.device, dtype=x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, kernel blocks"
