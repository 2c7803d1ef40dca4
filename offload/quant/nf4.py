"""bitsandbytes NF4: the one place that knows bnb's quirks.

Contract: `quantize_nf4(weight, device)` returns (packed uint8 ((n+1)//2, 1), QuantState on `device`)
exactly as `bitsandbytes.nn.Linear4bit` makes them (blocksize 64, double-quantized, NF4, from the bf16
values). `Nf4Linear` computes Linear4bit.forward's `bnb.matmul_4bit(x.to(compute_dtype), W, bias,
quant_state).to(x.dtype)`; its packed `weight` is re-pointed at a streamed buffer each pass while the
quant state stays resident. On a CPU with AVX512-BF16, Linear4bit re-lays the weight out for bnb's
fused bf16 CPU kernel; `Nf4Linear` does the same (`cpu_relayout`: nibble moves, nothing re-quantized),
so its outputs equal Linear4bit's on every machine.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

NF4_BLOCKSIZE = 64
NF4_COMPRESS_STATISTICS = True
# The oldest bitsandbytes this module is tested with (pyproject requires it too). Releases before
# it called matmul_4bit with `weight.t()` and took the weight's orientation from B's shape, so the
# packed (n/2, 1) view passed here would be read transposed for square weights; refuse them.
MIN_BNB = (0, 50, 2)


@functools.lru_cache(maxsize=1)
def require_bnb() -> None:
    """OffloadError (one line, with the fix) when bitsandbytes is missing or older than MIN_BNB."""
    from offload.errors import OffloadError

    try:
        import bitsandbytes
    except ImportError:
        raise OffloadError("--dtype nf4 needs bitsandbytes; pip install 'bitsandbytes>=0.50.2'") from None
    pieces = bitsandbytes.__version__.split(".")[:3]  # "0.50.2.dev0" -> (0, 50, 2): each piece's digits
    if tuple(int("".join(filter(str.isdigit, p)) or 0) for p in pieces) < MIN_BNB:
        raise OffloadError(
            f"bitsandbytes {bitsandbytes.__version__} is older than 0.50.2, which specx's NF4 "
            "path needs; pip install -U 'bitsandbytes>=0.50.2'"
        )


def quantize_nf4(weight: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """Quantize a 2-D weight (out, in) to NF4 the way Linear4bit.to(device) does on a `dtype` model
    (the weight is first cast to the compute dtype, as HF does before quantizing)."""
    require_bnb()
    import bitsandbytes.functional as bnbf

    w = weight.to(device=device, dtype=dtype).contiguous()
    return bnbf.quantize_4bit(
        w,
        blocksize=NF4_BLOCKSIZE,
        compress_statistics=NF4_COMPRESS_STATISTICS,
        quant_type="nf4",
        quant_storage=torch.uint8,
    )


class Nf4Linear(nn.Module):
    """Drop-in for nn.Linear whose weight is an NF4-packed uint8 view."""

    def __init__(self, in_features: int, out_features: int, has_bias: bool, compute_dtype: torch.dtype):
        super().__init__()
        require_bnb()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.quant_state = None
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False) if has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
        weight, state = self.weight, self.quant_state
        if x.device.type == "cpu" and needs_cpu_layout(state):
            weight, state = self._cpu_layout(weight)
        return bnb.matmul_4bit(x.to(self.compute_dtype), weight, bias=bias, quant_state=state).to(x.dtype)

    def _cpu_layout(self, weight: torch.Tensor):
        """(weight, state) in bnb's AVX512-BF16 CPU layout, as Linear4bit.forward makes them; the state
        converted once, the bytes per call unless `prelaid` (OffloadedCausalLM re-laid them already)."""
        cached = getattr(self, "_cpu_cache", None)
        if cached is None or cached[0] is not self.quant_state:
            cached = self._cpu_cache = (self.quant_state, cpu_state(self.quant_state))
        if getattr(self, "prelaid", False):
            return weight, cached[1]
        return cpu_relayout(weight.detach(), tuple(self.quant_state.shape)), cached[1]


CPU_PACKING = "bnb-cpu-avx512bf16"  # bytes already in bnb's fused CPU kernel layout (cpu_relayout)


def packing_for(device) -> str:
    """The byte layout the 4-bit cache stores for compute on `device`: CPU_PACKING where Linear4bit computes
    with bnb's fused AVX512-BF16 CPU kernel, else "standard" (bnb's serialized layout)."""
    return CPU_PACKING if torch.device(device).type == "cpu" and _cpu_bf16_kernel() is not None else "standard"


def needs_cpu_layout(state) -> bool:
    """True when Linear4bit would compute this weight with bnb's fused AVX512-BF16 CPU kernel."""
    return _cpu_bf16_kernel() is not None and cpu_layout_fits(state)


def cpu_state(state):
    """A copy of `state` converted like bitsandbytes' _convert_weight_packed_for_cpu converts it:
    double-quantized absmax expanded to fp32, then (K/blocksize, N) bf16; dtype bf16."""
    import bitsandbytes.functional as bnbf

    st = copy.copy(state)
    st.original_dtype, st.original_nested = st.dtype, st.nested
    st.original_qshape = torch.Size([(st.shape[0] * st.shape[1] + 1) // 2, 1])
    if st.nested:
        absmax = bnbf.dequantize_blockwise(st.absmax, st.state2)
        absmax += st.offset
        st.absmax, st.nested = absmax.float(), False
        del st.state2
    n, k = st.shape
    st.absmax = st.absmax.reshape(n, k // st.blocksize).T.to(torch.bfloat16).contiguous()
    st.dtype, st.packing_format_for_cpu = torch.bfloat16, True
    return st


def cpu_relayout(packed: torch.Tensor, shape: tuple[int, int], block_n: int = 32) -> torch.Tensor:
    """Packed NF4 bytes (row-major (N, K) codes, high nibble first) -> bnb's CPU kernel layout (N, K/2).

    bnb groups rows in blocks of 32 and, for each column pair (2kk, 2kk+1), writes 32 bytes:
    byte 2j + c = code(n0 + 16 + j, 2kk + c) << 4 | code(n0 + j, 2kk + c), j < 16, c in {0, 1}.
    With W[n, kk] = code(n, 2kk) << 4 | code(n, 2kk + 1) that is, per byte, nibble moves only:
    c = 0: (W[n0+16+j] & 0xF0) | (W[n0+j] >> 4);  c = 1: (W[n0+16+j] << 4) | (W[n0+j] & 0x0F).
    Byte ops on the packed tensor, equal to bitsandbytes' int32 unpack/repack (tested)."""
    import numpy as np

    n, k = shape
    # (N/32, half, j, kk): the two 16-row halves of each 32-row block. numpy: torch's strided
    # uint8 copies are ~15x slower for the transposes below.
    a = packed.detach().reshape(n // block_n, 2, block_n // 2, k // 2).numpy()
    lo, hi = a[:, 0], a[:, 1]
    out = np.empty((n // block_n, k // 2, block_n // 2, 2), dtype=np.uint8)  # (N/32, kk, j, c)
    out[..., 0] = ((hi & 0xF0) | (lo >> 4)).transpose(0, 2, 1)
    out[..., 1] = ((hi << 4) | (lo & 0x0F)).transpose(0, 2, 1)
    return torch.from_numpy(out.reshape(n, k // 2))


def cpu_layout_fits(state) -> bool:
    """out_features % 32 == 0 and whole absmax blocks per row: what the CPU layout needs (Linear4bit too)."""
    n, k = state.shape
    return n % 32 == 0 and k % state.blocksize == 0


@functools.lru_cache(maxsize=1)
def _cpu_bf16_kernel():
    """bnb's weight converter when Linear4bit would use its fused CPU kernel here, else None."""
    try:
        from bitsandbytes.functional import _convert_weight_packed_for_cpu, has_avx512bf16
    except ImportError:  # older bitsandbytes: Linear4bit has no CPU re-layout either
        return None
    return _convert_weight_packed_for_cpu if has_avx512bf16() else None
