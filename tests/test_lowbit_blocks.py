"""The self-draft's HQQ substitutes as the CPU kernel's own blocks (offload/quant/lowbit_pack.py, SX3 / SX2).

What must hold: `pack` keeps HQQ's codes and puts d = scale, m = -zero * scale (fp16) in each block, so
`dequantize` is (q - zero) * scale up to those two fp16 roundings; the kernel (ggml_gemv.c, every
thread count and row count, odd output counts, the portable build too) computes `matmul_reference` here (8-bit
activations, sx_q8.h) up to fp32 rounding order, within 2% of dequantize-then-matmul, each row as a
one-row call gives it, and dequantize-then-matmul itself where K is not a multiple of 64; a real HQQ quantization gives a KernelLowbitLinear close to HQQ's own eager
LowbitLinear; and a 3- or 2-bit self-draft of a streamed target loads these blocks, runs its forwards on
the one-call stack (a LeanStack of its own) and stays lossless: greedy ids equal `--method ar`'s.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from offload.cpu import ggml_kernel
from offload.quant import lowbit_pack as lp
from tests.conftest import make_model

pytestmark = pytest.mark.skipif(not ggml_kernel.enabled(), reason="no C compiler: the GGUF kernel is off")
GROUP = {3: 64, 2: 32}


def _random(bits: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = n * k // GROUP[bits]
    q = torch.randint(0, 1 << bits, (rows, GROUP[bits]), generator=g)
    scale = torch.rand(rows, 1, generator=g) * 0.02 + 1e-3
    zero = torch.rand(rows, 1, generator=g) * (1 << bits)
    return q, scale, zero


def matmul_reference(x: torch.Tensor, raw: torch.Tensor, qtype: int, n_rows: int, k: int) -> torch.Tensor:
    """(T, K) fp32 x -> (T, n_rows): what the kernel computes (lowbit_pack's contract), in float64."""
    w = lp.dequantize(raw, qtype, n_rows, k).double()
    x = x.reshape(-1, k)
    if k % 64:
        return (x.double() @ w.T).float()
    values, nbytes = lp.BLOCKS[qtype]
    dm = raw.reshape(-1, nbytes)[:, :4].contiguous().view(torch.float16).float().double()  # (groups, 2)
    d, m = (dm[:, i].reshape(n_rows, -1).repeat_interleave(values, 1) for i in (0, 1))  # (N, K) each
    q = torch.round((w - m) / d)  # the codes (d > 0: HQQ's scales are positive)
    g = x.reshape(x.shape[0], k // 64, 64)
    amax = g.abs().amax(-1, keepdim=True)
    xq = torch.round(g * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    xhat = (xq * (amax / 127.0)).reshape(x.shape[0], k).double()  # the 8-bit image sx * xq
    c = 3.5 if qtype == lp.SX3 else 1.5  # the codes' centre
    return (xhat @ ((q - c) * d).T + x.double() @ (m + c * d).T).float()


@pytest.mark.parametrize("bits", [3, 2])
def test_pack_keeps_codes_and_rounds_scales_once(bits):
    n, k = 12, 4 * GROUP[bits]
    q, scale, zero = _random(bits, n, k)
    raw = lp.pack(q, scale, zero, bits, n)
    assert raw.dtype == torch.uint8 and raw.shape == (n, k // GROUP[bits] * lp.BLOCKS[lp.TYPE_OF_BITS[bits]][1])
    w = lp.dequantize(raw, lp.TYPE_OF_BITS[bits], n, k)
    d = scale.half().float()
    m = (-zero * scale).half().float()
    expect = (q.float() * d + m).reshape(n, k)  # the product, then the sum: two fp32 roundings
    assert torch.equal(w, expect)
    torch.testing.assert_close(w, ((q.float() - zero) * scale).reshape(n, k), rtol=0, atol=2e-4)
    with pytest.raises(ValueError, match="outside"):
        lp.pack(q + (1 << bits), scale, zero, bits, n)


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_kernel_equals_dequantize_then_matmul(bits, threads, rows):
    n, k = 37, 576  # 37: groups of 4 output rows and a remainder
    q, scale, zero = _random(bits, n, k, seed=rows)
    raw = lp.pack(q, scale, zero, bits, n)
    w = lp.dequantize(raw, lp.TYPE_OF_BITS[bits], n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = ggml_kernel.linear(x, raw, lp.TYPE_OF_BITS[bits], n)
    finally:
        torch.set_num_threads(old)
    ref = matmul_reference(x, raw, lp.TYPE_OF_BITS[bits], n, k)
    scale = ref.abs().max()
    torch.testing.assert_close(y / scale, ref / scale, rtol=0, atol=2e-6)
    assert ((y - x @ w.T).abs().max() / scale).item() < 2e-2  # the 8-bit activations' error, no more
    alone = torch.cat([ggml_kernel.linear(x[i : i + 1], raw, lp.TYPE_OF_BITS[bits], n) for i in range(rows)])
    assert torch.equal(alone, y)  # a row's numbers do not depend on the rows beside it


def test_two_bit_rows_not_of_whole_64_groups_stay_fp32():
    n, k = 7, 96  # SX2 blocks of 32, but K not a multiple of the activations' 64-value groups
    q, scale, zero = _random(2, n, k, seed=5)
    raw = lp.pack(q, scale, zero, 2, n)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    y = ggml_kernel.linear(x, raw, lp.SX2, n)
    torch.testing.assert_close(y, x @ lp.dequantize(raw, lp.SX2, n, k).T, rtol=1e-5, atol=1e-5)


def test_portable_build_reads_the_blocks_alike(tmp_path, monkeypatch):
    """The library built without -march=native (no AVX-512 VNNI or table lookups) gives the same numbers."""
    import ctypes

    src = [str(p) for p in ggml_kernel.sources_of(ggml_kernel.SOURCE)]
    out = tmp_path / "portable.so"
    assert ggml_kernel._compile("cc", src, ["-O2", "-pthread"], out)
    lib = ctypes.CDLL(str(out))
    for bits in (3, 2):
        n, k = 9, 256
        q, scale, zero = _random(bits, n, k, seed=bits)
        raw = lp.pack(q, scale, zero, bits, n)
        x = torch.randn(2, k)
        y = torch.empty(2, n)
        rc = lib.ggml_gemm(
            lp.TYPE_OF_BITS[bits],
            ctypes.c_void_p(raw.data_ptr()),
            ctypes.c_void_p(x.data_ptr()),
            ctypes.c_void_p(y.data_ptr()),
            None,
            ctypes.c_int64(n),
            ctypes.c_int64(k),
            ctypes.c_int64(2),
            1,
        )
        assert rc == 0
        ref = matmul_reference(x, raw, lp.TYPE_OF_BITS[bits], n, k)
        torch.testing.assert_close(y / ref.abs().max(), ref / ref.abs().max(), rtol=0, atol=2e-6)


@pytest.mark.parametrize("bits", [3, 2])
def test_blocks_of_a_real_hqq_quantization_match_hqq(bits):
    pytest.importorskip("hqq")
    from offload.quant import lowbit

    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(bits)) * 0.05
    qz = lowbit.quantize_weight(w, bits)
    ref = lowbit.LowbitLinear(qz["W_q"], qz["scale"], qz["zero"], None, tuple(w.shape), bits)
    tensors = {f"x.{k}": v for k, v in qz.items()}
    sub = lp.KernelLowbitLinear(lowbit._blocks(tensors, "x", bits, tuple(w.shape)), lp.TYPE_OF_BITS[bits], 96, 256)
    x = torch.randn(5, 256)
    mine, hqq = lp.dequantize(sub.packed, sub.ggml_type, 96, 256), ref.weight_now()
    # only the fp16 rounding of (d, m) apart: far below the quantization's own error (~0.1-0.3 of |w|)
    assert ((mine - hqq).norm() / hqq.norm()).item() < 2e-3
    # and the kernel's 8-bit activations: well below it too
    assert ((sub(x) - ref.forward_eager(x)).norm() / ref.forward_eager(x).norm()).item() < 1e-2
    # not fp32 on the CPU: the reference dequantization, the same weight (without the 8-bit activations)
    assert ((sub(x.double()).float() - sub(x)).norm() / sub(x).norm()).item() < 1e-2


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("blocks") / "t", seed=29, layers=4, hidden=128)


@pytest.mark.parametrize("bits", [3, 2])
def test_self_draft_of_blocks_runs_on_its_stack_and_is_lossless(target, tmp_path, monkeypatch, bits):
    pytest.importorskip("hqq")
    from offload import OffloadedCausalLM
    from offload.selfdraft.build import build_self_draft
    from specexec_cli.terminal.app import app

    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    t = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", max_host_memory=0)
    d = build_self_draft(t, bits=bits)
    try:
        assert d.lean is not None and t.lean is None  # the target streams: only the draft has a stack
        assert all(type(m).__name__ == "KernelLowbitLinear" for m in d.layers[0].modules() if hasattr(m, "ggml_type"))
    finally:
        d.close()
        t.close()
    runner, got = CliRunner(), {}
    for name, extra in (("ar", ["--method", "ar"]), ("self", ["--draft", "self", "--draft-bits", str(bits)])):
        stats = tmp_path / f"{name}.json"
        res = runner.invoke(
            app,
            [
                "run",
                "-p",
                "def add(a, b):",
                "--target",
                str(target),
                "--device",
                "cpu",
                "--no-live",
                "--no-chat-template",
                "--temperature",
                "0",
                "-n",
                "24",
                "--budget",
                "8",
                "--offload",
                "disk",
                "--max-ram",
                "0",
                "--stats-json",
                str(stats),
                *extra,
            ],
        )
        assert res.exit_code == 0, res.output
        got[name] = json.loads(stats.read_text())
    assert got["self"]["token_ids"] == got["ar"]["token_ids"]


def test_sibling_blocks_are_one_buffer_and_one_stack_call(target, tmp_path, monkeypatch):
    """q|k|v and gate|up of a 3-bit substitute lie back to back in one buffer (lowbit._place_blocks), so the
    stack multiplies each set in one call; every logit equals the stack's with each linear a call of its own."""
    pytest.importorskip("hqq")
    from offload import OffloadedCausalLM
    from offload.cpu.leanstack import LeanStack
    from offload.selfdraft.build import build_self_draft
    from specexec_cli.core import kvcache
    from tests.probes import unfuse

    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    t = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", max_host_memory=0)
    d = build_self_draft(t, bits=3)
    try:
        at = d.layers[0].self_attn
        assert at.q_proj.group is not None and at.q_proj.group is at.v_proj.group
        assert at.k_proj.packed.data_ptr() == at.q_proj.packed.data_ptr() + at.q_proj.packed.numel()
        s = d.lean.structs[0]
        assert s.qkv[0].rows == sum(m.out_features for m in (at.q_proj, at.k_proj, at.v_proj)) and s.qkv[1].rows == 0
        assert s.gu[1].rows == 0
        ids = torch.tensor([[5, 9, 2, 7, 1]])

        def logits():
            cache = kvcache.new_cache()
            kvcache.reserve(cache, d, 16)
            with torch.inference_mode():
                return d(input_ids=ids, past_key_values=cache, use_cache=True).logits

        fused = logits()
        for layer in d.layers:
            unfuse(layer)
        d.lean = LeanStack.build(d)
        assert d.lean.structs[0].qkv[1].rows > 0  # three calls now
        assert torch.equal(logits(), fused)
    finally:
        d.close()
        t.close()
