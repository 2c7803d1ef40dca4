"""The self-draft's head: a Q8_0 output layer read over 8-bit activations (Q8A, kernels/sx_q8.h).

What must hold: the kernel's Q8A numbers are x's 8-bit image (per 64 values, as SX3/SX2 take it)
times the dequantized Q8_0 weight, up to fp32 rounding order, at every thread and row count and in
the portable build; within 2% of the exact Q8_0 path; each row as a one-row call gives it; with K not
a multiple of 64 Q8A is Q8_0 exactly. The 3-bit self-draft of a streamed GGUF target reads the
target's own head bytes as Q8A while the target keeps Q8_0, and decoding stays lossless: greedy and
seeded T = 0.7 ids equal `--method ar`'s.
"""

from __future__ import annotations

import ctypes
import json

import pytest
import torch
from typer.testing import CliRunner

from offload.cpu import ggml_kernel as gk
from offload.formats.gguf_quants import dequantize
from tests.conftest import make_model
from tests.gguf_build import write_gguf

pytestmark = pytest.mark.skipif(not gk.enabled(), reason="no C compiler: the GGUF kernel is off")
Q8_0 = 8


def _blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Q8_0 bytes of an (n, k) weight: random int8 codes, fp16 scales in (0, 0.01]."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, k // 32, 34), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).to(torch.float16)
    b[..., :2] = d.view(torch.uint8).reshape(n, k // 32, 2)
    return b.reshape(-1)


def _reference(x: torch.Tensor, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """x's 8-bit image (sx * xq per 64 values, ties to even) times the dequantized weight, in float64."""
    w = dequantize(raw, Q8_0, (n, k)).double()
    g = x.reshape(x.shape[0], k // 64, 64)
    amax = g.abs().amax(-1, keepdim=True)
    xq = torch.round(g * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return (xq * (amax / 127.0)).reshape(x.shape[0], k).double() @ w.T


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 17])
def test_q8a_is_the_8bit_image_times_the_weight(threads, rows):
    n, k = 37, 576  # 37 output rows: the threads' shares and a remainder
    raw = _blocks(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = gk.linear(x, raw, gk.Q8A, n)
        exact = gk.linear(x, raw, Q8_0, n)
    finally:
        torch.set_num_threads(old)
    ref = _reference(x, raw, n, k)
    scale = ref.abs().max()
    torch.testing.assert_close(y.double() / scale, ref / scale, rtol=0, atol=2e-6)
    assert ((y - exact).abs().max() / scale).item() < 2e-2  # the 8-bit activations' error, no more
    assert ((y - exact).abs().max() / scale).item() > 0  # and it is not the exact path under another name
    alone = torch.cat([gk.linear(x[i : i + 1], raw, gk.Q8A, n) for i in range(rows)])
    assert torch.equal(alone, y)  # a row's numbers do not depend on the rows beside it


def test_q8a_rows_not_of_whole_64_groups_are_q8_0():
    n, k = 9, 96  # Q8_0 blocks of 32, but K not a multiple of the activations' 64-value groups
    raw = _blocks(n, k, seed=3)
    x = torch.randn(4, k)
    assert torch.equal(gk.linear(x, raw, gk.Q8A, n), gk.linear(x, raw, Q8_0, n))


def test_portable_build_computes_q8a_alike(tmp_path):
    """The library built without -march=native (no AVX-512 VNNI) gives the same numbers."""
    src = [str(p) for p in gk.sources_of(gk.SOURCE)]
    out = tmp_path / "portable.so"
    assert gk._compile("cc", src, ["-O2", "-pthread"], out)
    lib = ctypes.CDLL(str(out))
    n, k, t = 11, 256, 3
    raw = _blocks(n, k, seed=7)
    x = torch.randn(t, k)
    y = torch.empty(t, n)
    ptr = ctypes.c_void_p
    rc = lib.ggml_gemm(gk.Q8A, ptr(raw.data_ptr()), ptr(x.data_ptr()), ptr(y.data_ptr()), None,
                       ctypes.c_int64(n), ctypes.c_int64(k), ctypes.c_int64(t), 1)  # fmt: skip
    assert rc == 0
    ref = _reference(x, raw, n, k)
    torch.testing.assert_close(y.double() / ref.abs().max(), ref / ref.abs().max(), rtol=0, atol=2e-6)


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("q8a")
    hf = make_model(root / "hf", seed=31, layers=3, hidden=128)
    return write_gguf(hf, root / "t-Q8_0.gguf", "Q8_0")


def test_self_draft_reads_the_target_head_as_q8a(gguf_target, tmp_path, monkeypatch):
    pytest.importorskip("hqq")
    from offload import OffloadedCausalLM
    from offload.selfdraft.build import build_self_draft
    from tests.test_selfdraft import shares_with

    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    t = OffloadedCausalLM.from_pretrained(gguf_target, dtype=torch.float32, offload="disk", max_host_memory=0)
    d = build_self_draft(t, bits=3)
    try:
        assert isinstance(t.lm_head, gk.PackedHead) and t.lm_head.qtype == Q8_0  # the target stays exact
        assert d.lm_head.qtype == gk.Q8A and d.lm_head.packed is t.lm_head.packed  # the same bytes, no copy
        assert shares_with(d, t)
        h = torch.randn(1, 2, t.lm_head.in_features)
        assert not torch.equal(d.lm_head(h), t.lm_head(h))
    finally:
        d.close()
        t.close()


@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_self_draft_with_a_q8a_head_is_lossless(gguf_target, tmp_path, monkeypatch, temperature):
    pytest.importorskip("hqq")
    from specexec_cli.terminal.app import app

    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    got = {}
    for name, extra in (("ar", ["--method", "ar"]), ("self", ["--draft", "self", "--draft-bits", "3"])):
        stats = tmp_path / f"{name}.json"
        args = ["run", "-p", "def add(a, b):", "--target", str(gguf_target), "--device", "cpu", "--no-live"]
        args += ["--no-chat-template", "--temperature", temperature, "--seed", "5", "-n", "24", "--budget", "6"]
        args += ["--offload", "disk", "--max-ram", "0", "--stats-json", str(stats), *extra]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        got[name] = json.loads(stats.read_text())
    assert got["self"]["token_ids"] == got["ar"]["token_ids"]
    assert got["self"]["method"] == "specexec" and got["self"]["target_passes"] < got["ar"]["target_passes"]
