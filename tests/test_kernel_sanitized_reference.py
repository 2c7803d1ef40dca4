"""The GGUF kernel's numbers under AddressSanitizer and UBSan, against a float64 reference.

tests/c/gemm_reference.c (its contract says what it reads and writes) is built with the library's
sources as tests/test_kernel_sanitizers.py builds its driver: the same sanitizer and warning flags
(`-fsanitize=address,undefined -fno-sanitize-recover=all -Wall -Wextra -Werror`), `native` and
`portable`. That test holds the kernels' paths to one another (threads, pool, row-wise, slices bit
for bit) and the sanitizers live; this one holds their numbers to the format: every GGUF type the
kernel reads (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K; specx's own SX blocks are
tests/test_lowbit_blocks.py's), random blocks with finite fp16 scales (bench/gguf_kernel.py's), N =
37 rows, K = 512 (and 96 for the 32-value types), T = 1, 3 and 17, two cases with a row map, 3
threads, through ggml_gemm, ggml_gemm_pool and ggml_gemm_pool_rows. Each output must equal
gguf_quants.dequantize (bitwise the `gguf` package's reference) then a float64 matmul, to fp32
accuracy relative to sum |x| |w| (2e-6; measured: 5e-8 at most), with no sanitizer report and no
warning in the build. tests/test_ggml_kernel.py checks the optimised builds' numbers (its portable
build too) with no sanitizer watching and one entry point; here every read, write and integer
operation behind each compared number is checked as well. A corrupted output is shown caught.
Skipped where the compiler cannot build and run a sanitized program.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from offload.cpu import ggml_kernel
from offload.formats import gguf_quants as gq
from tests.conftest import load_script
from tests.test_kernel_sanitizers import BUILDS, KERNELS, SANITIZE, WARNINGS, _run, sanitizing_cc

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("c") / "gemm_reference.c"
GGUF_TYPES = tuple(q for q in ggml_kernel.QTYPES if q in gq.BLOCK)
ENTRIES = ("ggml_gemm", "ggml_gemm_pool", "ggml_gemm_pool_rows")
N, THREADS, TOL = 37, 3, 2e-6


def _cases() -> list[tuple[int, int, int, bool]]:
    """(qtype, K, T, row map) for every case the driver runs."""
    cases = [(q, 512, t, False) for q in GGUF_TYPES for t in (1, 3, 17)]
    cases += [(q, 96, 3, False) for q in GGUF_TYPES if gq.BLOCK[q][0] == 32]
    return cases + [(2, 512, 3, True), (12, 512, 1, True)]


def _write_case(bench, path: Path, qtype: int, k: int, t: int, mapped: bool, seed: int) -> tuple:
    """The case file, and (W, x, rowmap) for the reference."""
    scale = 0.02 / (32 if gq.BLOCK[qtype][0] == 256 else 1)  # K-quant sub-scales multiply theirs
    w = bench.random_blocks(qtype, N, k, seed, scale=scale)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed))
    rowmap = torch.randperm(N, generator=torch.Generator().manual_seed(seed)).to(torch.int32) if mapped else None
    head = struct.pack("<7q", qtype, N, k, t, THREADS, w.numel(), int(mapped))
    body = w.numpy().tobytes() + (rowmap.numpy().tobytes() if mapped else b"") + x.numpy().tobytes()
    path.write_bytes(head + body)
    return gq.dequantize(w, qtype, (N, k), torch.float64), x.double(), rowmap


def _error(y: torch.Tensor, w: torch.Tensor, x: torch.Tensor, rowmap) -> float:
    """max |y - x W^T| / (|x| |W|^T), y's columns in the row map's order."""
    ref, scale = x @ w.T, x.abs() @ w.abs().T
    if rowmap is not None:
        moved = torch.empty_like(ref)
        moved[:, rowmap.long()] = ref
        ref, scale = moved, scale[:, torch.argsort(rowmap.long())]
    return ((y.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()


@pytest.fixture(scope="module")
def cc(tmp_path_factory) -> str:
    return sanitizing_cc(tmp_path_factory)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[tuple[Path, tuple]]:
    root, bench = tmp_path_factory.mktemp("san-ref-cases"), load_script("bench/gguf_kernel.py")
    return [
        (root / f"case{i}.bin", (*_write_case(bench, root / f"case{i}.bin", q, k, t, m, seed=i), (q, k, t, m)))
        for i, (q, k, t, m) in enumerate(_cases())
    ]


@pytest.fixture(scope="module", params=list(BUILDS))
def outputs(request, cc, cases, tmp_path_factory) -> list[np.ndarray]:
    """Every case's three outputs, (3, T, N), from the driver built with the kernel sources."""
    exe = tmp_path_factory.mktemp(f"san-ref-{request.param}") / "gemm_reference"
    sources = [str(DRIVER), *(str(s) for s in ggml_kernel.sources_of(ggml_kernel.SOURCE))]
    flags = [*SANITIZE, *WARNINGS, *BUILDS[request.param], "-I", str(KERNELS)]
    built = _run([cc, *flags, "-o", str(exe), *sources, "-lm"])
    assert built.returncode == 0 and "warning" not in built.stderr, f"{request.param} build:\n{built.stderr}"
    for path, _ in cases:
        path.with_name(path.name + ".out").unlink(missing_ok=True)
    done = _run([str(exe), *(str(p) for p, _ in cases)])
    assert "Sanitizer" not in done.stderr and "runtime error" not in done.stderr, done.stderr[-4000:]
    assert done.returncode == 0 and f"cases: {len(cases)} run, all ran" in done.stdout, done.stderr[-4000:]
    got = []
    for path, (*_, (_, _, t, _)) in cases:
        got.append(np.fromfile(path.with_name(path.name + ".out"), dtype="<f4").reshape(len(ENTRIES), t, N))
    return got


def test_every_type_and_entry_point_equals_the_float64_reference(cases, outputs):
    worst = {}
    for (_, (w, x, rowmap, (q, k, t, m))), y in zip(cases, outputs):
        for name, ye in zip(ENTRIES, y):
            err = _error(torch.from_numpy(ye.copy()), w, x, rowmap)
            worst[(gq.NAMES[q], k, t, m, name)] = err
    bad = {case: err for case, err in worst.items() if not err < TOL}
    assert bad == {}, f"{len(bad)} of {len(worst)} outputs off the reference: {sorted(bad.items())[:8]}"
    assert len(worst) == 3 * len(_cases()) and {c[0] for c in worst} == {gq.NAMES[q] for q in GGUF_TYPES}


def test_a_corrupted_output_is_caught(cases, outputs):
    (_, (w, x, rowmap, _)), y = cases[0], torch.from_numpy(outputs[0][0].copy())
    assert _error(y, w, x, rowmap) < TOL
    y[0, 5] += 1e-3 * (x[0].abs() @ w[5].abs()).item()  # one output off by 1e-3 of its scale
    assert _error(y, w, x, rowmap) > TOL
