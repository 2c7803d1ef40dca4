"""GGUF dequantization (offload/formats/gguf_quants.py) against the gguf package's own numpy reference.

Oracle: `gguf.quants.dequantize`. Random blocks of every supported type (finite scales, every other
byte random) must dequantize bitwise equal in float32, and to the reference rounded once in a 16-bit
dtype; the un-permutation of llama.cpp's Q/K rows equals transformers' reverse permutation; every
tensor of a real GGUF file (written by gguf.GGUFWriter; and llama-quantize's K-quants when
tools/llamacpp.sh has built it) equals the reference.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from offload.formats import gguf_quants as gq  # noqa: E402

QUANTIZED = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4]
HALF_AT = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.MXFP4: (),  # an E8M0 scale byte: every value is a finite power of two
}
CACHE = Path(os.environ.get("SPECX_TEST_CACHE", Path.home() / ".cache" / "specx-test")) / "llamacpp"


def random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in HALF_AT[qtype]:
        half = rng.standard_normal(b.shape[:2]).astype(np.float16)
        b[..., off : off + 2] = half.view(np.uint8).reshape(*b.shape[:2], 2)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_random_blocks_bitwise(qtype):
    raw = random_blocks(qtype, 9, 512, seed=int(qtype))
    with np.errstate(over="ignore"):  # MXFP4's largest scales (2^127 x 6) overflow to inf, on both sides
        ref = gguf.quants.dequantize(raw, qtype)
    got = gq.dequantize(torch.from_numpy(raw), int(qtype), ref.shape).numpy()
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    for dtype in (torch.bfloat16, torch.float16):
        half = gq.dequantize(torch.from_numpy(raw), int(qtype), ref.shape, dtype)
        assert half.dtype == dtype and torch.equal(half, torch.from_numpy(ref).to(dtype))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda q: q.name)
def test_plain_types(qtype):
    x = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32)
    raw = (x if qtype == T.F32 else gguf.quants.quantize(x, qtype)).view(np.uint8).reshape(6, -1)
    ref = gguf.quants.dequantize(raw.copy(), qtype).reshape(6, 64)
    got = gq.dequantize(torch.from_numpy(raw.copy()), int(qtype), (6, 64)).numpy()
    assert np.array_equal(got, ref)


def test_chunked_rows_and_byte_counts(monkeypatch):
    """Chunking (a small CHUNK_ELEMS) changes nothing; a byte count that does not match is refused."""
    raw = random_blocks(T.Q4_K, 11, 256, seed=3)
    ref = gq.dequantize(torch.from_numpy(raw), int(T.Q4_K), (11, 256))
    monkeypatch.setattr(gq, "CHUNK_ELEMS", 512)
    assert torch.equal(gq.dequantize(torch.from_numpy(raw), int(T.Q4_K), (11, 256)), ref)
    with pytest.raises(ValueError, match="needs"):
        gq.dequantize(torch.from_numpy(raw[:, :-1].copy()), int(T.Q4_K), (11, 256))
    assert gq.nbytes(int(T.Q4_K), (11, 256)) == raw.nbytes


def test_rows_permutation_matches_transformers():
    """Writing stored rows to `rows_to` undoes llama.cpp's Q/K permutation as transformers does."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from offload.formats.gguf import _rows_to
    from tests.gguf_build import permute

    w = np.random.default_rng(2).standard_normal((8 * 16, 64)).astype(np.float32)  # 8 heads of 16 rows
    stored = permute(w, 8)
    q = gguf.quants.quantize(stored, T.Q8_0)
    ref = LlamaTensorProcessor()._reverse_permute_weights(gguf.quants.dequantize(q, T.Q8_0), 8)
    got = gq.dequantize(torch.from_numpy(q), int(T.Q8_0), (128, 64), rows_to=_rows_to(128, 8, "cpu"))
    assert np.array_equal(got.numpy(), ref)
    assert not np.array_equal(gguf.quants.dequantize(q, T.Q8_0), ref)  # the permutation is not the identity


def _every_tensor_matches(path: Path) -> int:
    reader = gguf.GGUFReader(path)
    checked = 0
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).copy())
        got = gq.dequantize(raw, int(t.tensor_type), shape).numpy()
        assert np.array_equal(got, ref.astype(np.float32)), t.name
        checked += 1
    return checked


def test_real_file(tmp_path):
    from tests.conftest import make_model
    from tests.gguf_build import write_gguf

    hf = make_model(tmp_path / "hf", seed=4, layers=1, hidden=256)
    for q in ("Q8_0", "Q4_0", "Q5_K"):
        assert _every_tensor_matches(write_gguf(hf, tmp_path / f"m-{q}.gguf", q)) == 12


@pytest.mark.skipif(not (CACHE / "OK").is_file(), reason="llama.cpp tools not built (tools/llamacpp.sh)")
def test_llama_quantize_k_quants(tmp_path):
    """llama-quantize's own Q4_K_M (Q4_K + Q6_K) and Q5_K_M files dequantize as the reference does."""
    from tests.conftest import make_model
    from tests.gguf_build import write_gguf

    hf = make_model(tmp_path / "hf", seed=4, layers=2, hidden=256)
    f16 = write_gguf(hf, tmp_path / "m-f16.gguf", "F16")
    seen = set()
    for ftype in ("Q4_K_M", "Q5_K_M"):
        out = tmp_path / f"m-{ftype}.gguf"
        subprocess.run(
            [str(CACHE / "bin" / "llama-quantize"), str(f16), str(out), ftype], check=True, capture_output=True
        )
        assert _every_tensor_matches(out) > 0
        seen |= {t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert {T.Q4_K, T.Q5_K, T.Q6_K} <= seen


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda q: q.name)
def test_compiled_kernel_bitwise(qtype, monkeypatch):
    """The torch.compile'd kernel (auto on CUDA) equals the reference bitwise too, a row permutation
    undone included; it really ran (no fallback to eager)."""
    monkeypatch.setenv(gq.KERNEL_ENV, "compiled")
    raw = random_blocks(qtype, 12, 512, seed=3)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        got = gq.dequantize(torch.from_numpy(raw), int(qtype), ref.shape, dtype)
        assert gq.kernel_status() is None and torch.equal(got, ref.to(dtype))
        moved = gq.dequantize(torch.from_numpy(raw), int(qtype), ref.shape, dtype, rows_to=perm)
        want = torch.empty_like(got)
        want[perm] = ref.to(dtype)
        assert torch.equal(moved, want)
