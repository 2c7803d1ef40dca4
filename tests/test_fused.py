"""The fused substitute linear (offload/quant/fused.py) against the eager HQQ reference (offload/quant/lowbit.py).

Codes unpacked with shift/mask ops equal HQQ's own unpack bit for bit; the compiled
unpack+scale+matmul equals the eager path (HQQ unpack, 16-bit weight, matmul) within the dtype's
tolerance at 4, 3 and 2 bits for several token counts (one dynamic graph); a compiler failure falls
back to the same math eagerly with nothing on stderr and no warning. `auto` runs it on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hqq")

from offload.quant import fused
from offload.quant.lowbit import PACKING, LowbitLinear, hqq_quantizer, quantize_weight

OUT, IN = 96, 320  # rows = OUT*IN/group: not a multiple of 10 at 3 bits (HQQ pads; the slice must drop them)


def _layer(bits: int, dtype: torch.dtype, bias: bool = True, seed: int = 0) -> LowbitLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(OUT, IN, generator=g) * 0.05
    q = quantize_weight(w, bits)
    b = torch.randn(OUT, generator=g).to(dtype) if bias else None
    return LowbitLinear(q["W_q"], q["scale"].to(dtype), q["zero"].to(dtype), b, (OUT, IN), bits)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_unpack_matches_hqq(bits):
    lin = _layer(bits, torch.float32)
    ours = fused.unpack_codes(lin.W_q, bits, lin.scale.shape[0])
    theirs = hqq_quantizer().unpack[PACKING[bits]](lin.W_q, dtype=torch.int32)[: lin.scale.shape[0]]
    assert torch.equal(ours.to(torch.int32), theirs)
    assert int(ours.max()) <= (1 << bits) - 1 and int(ours.min()) >= 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bits", [4, 3, 2])
def test_fused_equals_eager(bits, dtype, tol, capfd):
    lin = _layer(bits, dtype, bias=bits != 3)
    lin.kernel = "fused"  # auto picks eager on CPU; the fused path is what is tested
    for tokens in (1, 5, 33):  # one compiled graph for every draft batch size
        x = torch.randn(2, tokens, IN, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        got, ref = lin(x), lin.forward_eager(x)
        assert got.dtype == ref.dtype and got.shape == (2, tokens, OUT)
        scale = ref.float().abs().max().item()
        assert (got.float() - ref.float()).abs().max().item() <= tol * max(scale, 1.0), (bits, dtype, tokens)
    assert fused.fused_status() is None, fused.fused_status()  # the compiled path ran, not the fallback
    err = capfd.readouterr().err
    assert err == "", err


def test_compile_failure_falls_back_quietly(monkeypatch, capfd):
    lin = _layer(2, torch.float32)
    lin.kernel = "fused"
    x = torch.randn(1, 3, IN)

    def broken(*a, **k):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(fused, "_STATE", {"fn": broken, "broken": None})
    got = lin(x)
    assert fused.fused_status() is not None and "eagerly" in fused.fused_status()
    assert torch.allclose(got, lin.forward_eager(x), atol=1e-5)
    assert capfd.readouterr().err == ""


def test_kernel_choice_by_device_and_env(monkeypatch):
    monkeypatch.setenv("SPECX_LOWBIT_KERNEL", "auto")
    assert _layer(4, torch.float32).kernel == "eager"  # CPU: eager measured faster
    assert fused.kernel_choice("cuda") == "fused"
    monkeypatch.setenv("SPECX_LOWBIT_KERNEL", "fused")
    assert _layer(4, torch.float32).kernel == "fused"
    monkeypatch.setenv("SPECX_LOWBIT_KERNEL", "eager")
    assert fused.kernel_choice("cuda") == "eager"
