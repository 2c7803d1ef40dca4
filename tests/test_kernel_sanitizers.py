"""The CPU kernels under AddressSanitizer and UBSan, with every warning an error.

tests/c/kernel_driver.c (its contract says what it calls and checks) is built together with the
library's sources (ggml_kernel.sources_of: ggml_gemv.c, decode_stack.c, pool.c) by the system C
compiler with `-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
-Wall -Wextra -Werror` (no-recover: an undefined behaviour stops the run instead of printing and
going on) twice: `native` adds `-march=native -fopenmp -pthread`, the library's first flag set (on an
AVX-512 VBMI/VNNI CPU the table lookups and the int8 path), `portable` only `-pthread` (the
vector-extension code every other CPU runs). A standalone program, because a sanitized shared library
inside Python needs libasan preloaded. What must hold: both builds compile without a warning, and
the driver exits 0 with no sanitizer report: every type's ggml_gemm at T = 1, 3, 17 through every
entry point, and decode_stack_lanes over two Q4_1 / Q8_0 layers and three lanes. Its planted faults
(a weight one block short, a signed overflow) are reported, so the sanitizers are live in the build.
Skipped where the compiler cannot build and run a sanitized program (no libasan, no libubsan).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from offload.cpu import ggml_kernel

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("c") / "kernel_driver.c"
KERNELS = ggml_kernel.SOURCE.parent
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
WARNINGS = ["-Wall", "-Wextra", "-Werror"]
BUILDS = {"native": ["-march=native", "-fopenmp", "-pthread"], "portable": ["-pthread"]}
# leaks reported too; a report ends the run with a non-zero status
ENV = {"ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


def _cc() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600, **kw)


@pytest.fixture(scope="module")
def cc(tmp_path_factory) -> str:
    return sanitizing_cc(tmp_path_factory)


def sanitizing_cc(tmp_path_factory) -> str:
    """The C compiler, once it has built and run a trivial sanitized program; else the module skips."""
    cc = _cc()
    if cc is None:
        pytest.skip("no C compiler")
    root = tmp_path_factory.mktemp("san-probe")
    (root / "p.c").write_text("int main(void) { return 0; }\n")
    built = _run([cc, *SANITIZE, "-o", str(root / "p"), str(root / "p.c")])
    if built.returncode != 0 or _run([str(root / "p")]).returncode != 0:
        pytest.skip(f"{cc} cannot build and run a program under -fsanitize=address,undefined: {built.stderr[-300:]}")
    return cc


@pytest.fixture(scope="module", params=list(BUILDS))
def driver(request, cc, tmp_path_factory) -> Path:
    """The driver and the kernel sources built into one sanitized program (every warning an error)."""
    exe = tmp_path_factory.mktemp(f"san-{request.param}") / "kernel_driver"
    sources = [str(DRIVER), *(str(s) for s in ggml_kernel.sources_of(ggml_kernel.SOURCE))]
    flags = [*SANITIZE, *WARNINGS, *BUILDS[request.param], "-I", str(KERNELS)]
    built = _run([cc, *flags, "-o", str(exe), *sources, "-lm"])
    assert built.returncode == 0, f"the {request.param} build failed or warned:\n{built.stderr}"
    assert "warning" not in built.stderr, built.stderr
    return exe


def test_kernels_run_clean_under_asan_and_ubsan(driver):
    done = _run([str(driver)])
    assert "Sanitizer" not in done.stderr and "runtime error" not in done.stderr, done.stderr[-4000:]
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    gemm, stack, failed = (int(w) for w in done.stdout.split()[1::2])  # "checks: G gemm, S stack, F failed"
    assert failed == 0 and gemm > 1000 and stack >= 7, done.stdout


@pytest.mark.parametrize("plant, report", [("plant-overflow", "heap-buffer-overflow"), ("plant-ub", "runtime error")])
def test_planted_faults_are_reported(driver, plant, report):
    done = _run([str(driver), plant])
    assert done.returncode not in (0, 3), f"{plant} was not stopped: exit {done.returncode}\n{done.stderr[-2000:]}"
    assert report in done.stderr, done.stderr[-2000:]
