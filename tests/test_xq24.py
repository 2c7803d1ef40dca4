"""The 24-bit integer path of Q5_0, Q4_K and Q6_K rows (offload/cpu/kernels/xq24.h) against float64.

Oracle: dequantize-then-matmul (gguf_quants.dequantize, bitwise the `gguf` package's reference) in
float64. The kernel's one-row schedule of these types multiplies the weights' integer codes into a
block-scaled 24-bit integer image of the activations (exact int32 dot products; xq24.h's contract);
the same build's fp32 schedule (ggml_gemv.c's dequantize-in-registers path, `ggml_xq(0)`) is the
yardstick: on the same inputs the integer path's error relative to sum |x| |w| must stay within a
small factor of the fp32 path's (3x at the worst output, 3x on average; measured: at most 1.9x and
2.9x, on activations with outliers spanning 2^10) and below fp32 accuracy's bound (2e-6). Inputs:
plain Gaussian activations, activations with outliers (log-normal magnitudes, as a transformer's hidden
states have), blocks of zeros and one block a million times larger than the rest; row counts on both
sides of the 4-row groups, K from one block to 2048 (Gemma-3 270M's widths: 640, 1024, 2048). Then
the wiring: a one-row call, several activation rows computed row-wise (ggml_gemm_pool_rows), threads
and the pool agree bit for bit, and the image kept for the next call on the same x is not reused for a
different x of the same shape.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

pytest.importorskip("gguf")

from offload.cpu import ggml_kernel as gk
from offload.formats import gguf_quants as gq
from tests.conftest import load_script

if not gk.enabled():
    pytest.skip(f"no GGUF kernel on this machine: {gk.kernel_status()}", allow_module_level=True)

TYPES = (gq.Q5_0, gq.Q4_K, gq.Q6_K)


def _lib():
    lib = gk._library()
    lib.ggml_xq.restype = ctypes.c_int
    lib.ggml_xq.argtypes = [ctypes.c_int]
    return lib


@pytest.fixture(scope="module")
def xq():
    lib = _lib()
    if not lib.ggml_xq(1):
        pytest.skip("this CPU has no AVX-512 VNNI + VBMI: these types keep the fp32 schedule")
    yield lib
    lib.ggml_xq(1)


def _blocks(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    bench = load_script("bench/gguf_kernel.py")
    return bench.random_blocks(qtype, n, k, seed, scale=0.02 / (32 if gq.BLOCK[qtype][0] == 256 else 1))


def _activations(kind: str, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g)
    if kind == "outliers":
        x = x * torch.exp(2.5 * torch.randn(1, k, generator=g))
    elif kind == "zeros":
        x[0, :32] = 0
        x[0, 64::5] = 0
    elif kind == "one-loud-block":
        x[0, 32:64] *= 1e6
    return x


def _errors(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    ref = x.double() @ w.T
    scale = (x.double().abs() @ w.abs().T).clamp_min(1e-30)
    err = (y.double() - ref).abs() / scale
    return err.max().item(), err.mean().item()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(37, 256), (5, 640), (64, 1024), (9, 2048), (1, 64), (16, 512)])
@pytest.mark.parametrize("kind", ["gaussian", "outliers", "zeros", "one-loud-block"])
def test_error_within_a_small_factor_of_fp32(xq, qtype, n, k, kind):
    if k % gq.BLOCK[qtype][0]:
        pytest.skip("K-quant rows are whole 256-value blocks")
    fp32s, ints = [], []
    for seed in range(4):
        raw = _blocks(qtype, n, k, seed=seed + 7 * n)
        w = gq.dequantize(raw, qtype, (n, k), torch.float64)
        x = _activations(kind, k, seed)
        xq.ggml_xq(0)
        fp32s.append(_errors(gk.linear(x, raw, qtype, n), x, w))
        xq.ggml_xq(1)
        ints.append(_errors(gk.linear(x, raw, qtype, n), x, w))
    fmax, fmean = max(e[0] for e in fp32s), sum(e[1] for e in fp32s) / len(fp32s)
    imax, imean = max(e[0] for e in ints), sum(e[1] for e in ints) / len(ints)
    assert imax < 2e-6, imax
    # the fp32 path's own error can be tiny by luck on few terms: the yardstick is at least 2^-24
    assert imax <= 3 * max(fmax, 2**-24), (imax, fmax)
    assert imean <= 3 * max(fmean, 2**-26), (imean, fmean)


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_threads_and_pool_agree_bit_for_bit(xq, qtype):
    n, k, t = 61, 1024, 5
    raw = _blocks(qtype, n, k, seed=3)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(5))
    lib = gk._library()
    alone = torch.stack([gk.linear(x[i : i + 1], raw, qtype, n)[0] for i in range(t)])
    for threads in (1, 2, 3):
        y = torch.empty(t, n)
        assert lib.ggml_gemm_pool_rows(qtype, raw.data_ptr(), x.data_ptr(), y.data_ptr(), None, n, k, t, threads) == 0
        assert torch.equal(y, alone)
        one = torch.empty(1, n)
        assert lib.ggml_gemm(qtype, raw.data_ptr(), x.data_ptr(), one.data_ptr(), None, n, k, 1, threads) == 0
        assert torch.equal(one[0], alone[0])


def test_a_new_x_of_the_same_shape_is_quantized_again(xq):
    n, k = 40, 640
    raw = _blocks(gq.Q5_0, n, k, seed=1)
    w = gq.dequantize(raw, gq.Q5_0, (n, k), torch.float64)
    x = torch.randn(1, k)
    first = gk.linear(x, raw, gq.Q5_0, n)
    x[0, 100] += 1.0  # the same buffer, one value changed: the kept image must not serve it
    second = gk.linear(x, raw, gq.Q5_0, n)
    assert _errors(second, x, w)[0] < 2e-6
    assert not torch.equal(first, second)
    assert torch.equal(gk.linear(x, raw, gq.Q5_0, n), second)
