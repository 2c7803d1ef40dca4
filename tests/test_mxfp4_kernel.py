"""MXFP4 expert matrices rebuilt transposed by the C kernel (offload/cpu/mxfp4_kernel.py, kernels/mxfp4_dequant.c).

Oracle: the torch path formats/mxfp4.py had before the kernel, `dequantize(blocks, scales, dtype).t().contiguous()`
(transformers' values: tests/test_gpt_oss_mxfp4.py). `dequantize_t` must give its bits, compared as integers
(NaN positions compared as positions: the E8M0 exponent 255 times a zero code is 0 x inf), for random blocks with
random and extreme scales (0: subnormal products, 1, 127, 254: overflow, 255: inf and NaN), shapes whose column
count is or is not a multiple of the kernel's tile, bf16 / fp16 (underflow and overflow in the cast) / fp32, from
a non-contiguous expert slice too; the kernel must really serve those calls, and the torch path must serve them
where it is turned off or the library is not built.
"""

from __future__ import annotations

import pytest
import torch

from offload.cpu import ggml_kernel as gk
from offload.cpu import mxfp4_kernel
from offload.formats import mxfp4

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((768, 512), (512, 384), (33, 64), (1, 32), (17, 96))  # (N, K): K a multiple of 32
EXTREMES = (0, 1, 127, 254, 255)


def random_matrix(n: int, k: int, seed: int, extreme: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks (n, k/32, 16), scales (n, k/32): random codes; scales random over 0..255, or drawn from EXTREMES."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
    if extreme:
        pick = torch.randint(0, len(EXTREMES), (n, k // 32), generator=g)
        scales = torch.tensor(EXTREMES, dtype=torch.uint8)[pick]
    else:
        scales = torch.randint(0, 256, (n, k // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def reference(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return mxfp4.dequantize(blocks, scales, dtype).t().contiguous()


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    ints = {4: torch.int32, 2: torch.int16}[want.element_size()]
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(ints)[~nan], want.view(ints)[~nan])


def kernel_built() -> bool:
    return gk.enabled()


needs_kernel = pytest.mark.skipif(not kernel_built(), reason=f"no C kernel library: {gk.kernel_status()}")


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("extreme", [False, True])
def test_kernel_gives_the_torch_paths_bits(dtype, shape, extreme):
    n, k = shape
    blocks, scales = random_matrix(n, k, seed=n * 7 + k, extreme=extreme)
    got = mxfp4_kernel.dequantize_t(blocks, scales, mxfp4._values(dtype), dtype)
    assert got is not None  # the kernel served it
    want = reference(blocks, scales, dtype)
    assert_same_bits(got, want)
    assert_same_bits(mxfp4.dequantize_t(blocks, scales, dtype), want)
    if extreme and n * k >= 2048:  # the extremes really occur: subnormal, overflowed and NaN values, and finite ones
        assert want.isnan().any() and want.isinf().any() and (want.isfinite() & (want != 0)).any()


@needs_kernel
def test_every_scale_and_code_through_the_kernel():
    """Each of the 256 x 16 (scale, code) pairs once per dtype, in the layout a group stores them."""
    codes = torch.tensor([lo | (lo + 1) << 4 for lo in range(0, 16, 2)] * 2, dtype=torch.uint8)
    blocks = codes.expand(256, 1, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1)
    for dtype in DTYPES:
        assert_same_bits(mxfp4.dequantize_t(blocks, scales, dtype), reference(blocks, scales, dtype))


@needs_kernel
def test_an_expert_slice_of_a_fused_tensor():
    """Mxfp4Experts.weights gets expert e's row of the (E, N, G, 16) tensor; a transposed (non-contiguous) view
    too."""
    blocks, scales = random_matrix(4 * 96, 128, seed=3, extreme=False)
    blocks, scales = blocks.view(4, 96, 4, 16), scales.view(4, 96, 4)
    for e in range(4):
        assert_same_bits(
            mxfp4.dequantize_t(blocks[e], scales[e], torch.bfloat16), reference(blocks[e], scales[e], torch.bfloat16)
        )
    # expert 1 of a tensor laid out (N, E, ...): a strided view
    odd_b, odd_s = blocks.transpose(0, 1).contiguous()[:, 1], scales.transpose(0, 1).contiguous()[:, 1]
    assert not odd_b.is_contiguous()
    assert_same_bits(mxfp4.dequantize_t(odd_b, odd_s, torch.float32), reference(odd_b, odd_s, torch.float32))


def test_turned_off_the_torch_path_serves(monkeypatch):
    monkeypatch.setenv(gk.ENV, "off")
    blocks, scales = random_matrix(40, 64, seed=1, extreme=True)
    assert mxfp4_kernel.dequantize_t(blocks, scales, mxfp4._values(torch.bfloat16), torch.bfloat16) is None
    assert_same_bits(mxfp4.dequantize_t(blocks, scales, torch.bfloat16), reference(blocks, scales, torch.bfloat16))


def test_no_library_the_torch_path_serves(monkeypatch, tmp_path):
    monkeypatch.setattr(gk, "_STATE", {"lib": None, "fn": None, "broken": None, "tried": False, "held": None})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    blocks, scales = random_matrix(24, 96, seed=2, extreme=False)
    assert mxfp4_kernel.dequantize_t(blocks, scales, mxfp4._values(torch.float16), torch.float16) is None
    assert_same_bits(mxfp4.dequantize_t(blocks, scales, torch.float16), reference(blocks, scales, torch.float16))


def test_mismatched_scales_are_refused():
    if not kernel_built():
        pytest.skip(f"no C kernel library: {gk.kernel_status()}")
    blocks, scales = random_matrix(8, 64, seed=4, extreme=False)
    with pytest.raises(ValueError):
        mxfp4_kernel.dequantize_t(blocks, scales[:4], mxfp4._values(torch.float32), torch.float32)


def test_the_profiles_probe_times_the_call_the_experts_make(monkeypatch):
    """`specx profile`'s "mxfp4" rate (kernelprobes.dequantizers) is timed on formats/mxfp4.dequantize_t, the call
    Mxfp4Experts.weights makes (the kernel where it is built), not on the torch path alone."""
    from specexec_cli.tools import kernelprobes

    calls = []
    real = mxfp4_kernel.dequantize_t
    monkeypatch.setattr(mxfp4_kernel, "dequantize_t", lambda *a: calls.append(a[0].shape) or real(*a))
    w = kernelprobes.dequantizers("cpu", torch.float32)["mxfp4"]()
    rows, cols = kernelprobes.DEQUANT_SHAPE
    assert w.shape == (cols, rows) and w.dtype == torch.float32 and w.is_contiguous()
    assert calls == [(rows, cols // 32, 16)]
