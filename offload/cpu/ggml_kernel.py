"""Packed GGUF linears on CPU: x W^T read straight from the GGUF block bytes, in fp32.

Contract:
- `linear(x, raw, qtype, out_features, rowmap=None)` -> (..., out) fp32: x (..., in) fp32 on CPU,
  `raw` the weight's GGUF bytes (uint8, rows of in/32 blocks), `rowmap` an optional int32 (out,)
  CPU tensor giving the output column of each stored row (llama.cpp's Q/K row order undone).
  kernels/ggml_gemv.c dequantizes in fp32 registers exactly as gguf_quants.dequantize defines it and
  accumulates in fp32: dequantize-then-matmul up to rounding order, the packed bytes read once.
  Activations stay fp32 except in the self-draft's own SX3 / SX2 / Q8A (8-bit,
  quant/lowbit_pack.py) and, on a CPU with AVX-512 VNNI + VBMI, Q5_0 / Q4_K / Q6_K one row at a time
  (kernels/xq24.h): x_j = s X_j + e_j, a 24-bit integer image (s = max|x| of x_j's 4-value lane /
  8355000, |e_j| <= 2^-24 that max + 2^-23 |x_j|), meets the codes in exact int32 dot products: an
  error of fp32 rounding's order (tests/test_xq24.py), not the fp32 schedule's bits. `QTYPES`: Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and specx's SX3 / SX2 / Q8A; `BLOCKS[type]` = (values, bytes).
- `usable(x, qtype, max_rows=MAX_ROWS)`: whether `linear` serves the call: CPU fp32 input, a type in
  `QTYPES`, at most `max_rows` rows (above MAX_ROWS a GEMM over a weight dequantized once is faster),
  $SPECX_GGUF_KERNEL not "off", the library built: the first use compiles `sources_of(SOURCE)` once
  per machine into $SPECX_CACHE/kernels, keyed by a hash of the sources, flags, compiler and CPU.
- `kernel_status()`: None while the kernel is usable or untried, else why not (one line, never printed).
- `PackedHead(weight, raw, qtype)`: the output layer, an nn.Linear over fp32 `weight` (`raw` dequantized) for
  large batches, up to MAX_ROWS rows from `raw`, its GGUF bytes. `COST`: seconds per packed byte relative to Q4_1's.
Threads: `threads()` at call time, torch's count unless a `host_ops_on_one_thread()` block holds it:
inside, torch's small ops run on one thread while the kernels keep the earlier count on kernels/pool.c's
workers; `torch_threads_back()` gives one large torch op the threads back.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from offload.cachedir import cache_root

ENV = "SPECX_GGUF_KERNEL"  # auto (default) | off
SX3, SX2 = 130, 131  # specx's own 3- and 2-bit blocks (the self-draft's, quant/lowbit_pack.py)
Q8A = 136  # a Q8_0 output layer as the self-draft reads it: 8-bit activations (kernels/sx_q8.h), never the target's
# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (gguf_quants numbering), then specx's own
QTYPES = (2, 3, 6, 7, 8, 12, 13, 14, SX3, SX2, Q8A)
# type -> (values, bytes) of one stored block: ggml's (formats/gguf_quants.BLOCK states the same; a test compares)
BLOCKS = {
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
}
BLOCKS |= {SX3: (64, 28), SX2: (32, 12), Q8A: BLOCKS[8]}  # specx's own, and Q8A the Q8_0 bytes
# seconds per packed byte relative to Q4_1's, for the speed model: bench/gguf_kernel.py at T = 1 on one
# thread, the same shape in Q4_1 and in the type (Q4_0 and Q8_0 left at Q4_1's rate; Q5_0, Q4_K and Q6_K
# on a CPU with AVX-512 VNNI + VBMI, kernels/xq24.h); SX3, SX2, Q8A: bench/sx_kernel.py (gate/up
# 1536 x 576, bench/results/sx_kernel.json)
COST = {2: 1.0, 3: 1.0, 6: 1.2, 7: 1.33, 8: 1.0, 12: 1.11, 13: 2.52, 14: 0.91, 130: 0.63, 131: 0.70, 136: 0.21}
MAX_ROWS = 32  # activation rows up to which the kernel beats a dense GEMM (SmolLM2 resident, whole passes: T = 16 42 vs 61 ms, T = 32 even)
SOURCE = Path(__file__).with_name("kernels") / "ggml_gemv.c"
# built into the same library: the decoder stack, the threads, MXFP4 experts' dequantization (cpu/mxfp4_kernel.py)
COMPANIONS = ("decode_stack.c", "pool.c", "mxfp4_dequant.c")
# included by the sources: part of the build's hash
HEADERS = ("ggml_blocks.h", "ggml_fast.h", "sx_q8.h", "xq24.h", "decode_stack.h")
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-pthread"],
    ["-O3", "-march=native", "-pthread"],
    ["-O3", "-fopenmp", "-pthread"],
    ["-O3", "-pthread"],
)
_STATE: dict = {"lib": None, "fn": None, "broken": None, "tried": False, "held": None}


def turned_off(env: str = ENV) -> bool:
    """$env is "off" (or 0, no, false): read on every call (tests and the CLI set it at run time)."""
    v = os.environ.get(env)
    return v is not None and v.strip().lower() in ("off", "0", "no", "false")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _compile(cc: str, srcs: list[str], flags: list[str], out: Path) -> bool:
    """Build `out` atomically (a temp file renamed), so concurrent processes never load a half file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-shared", "-fPIC", "-o", tmp, *srcs, "-lm"], capture_output=True, timeout=120
        )
        if done.returncode != 0:
            return False
        os.replace(tmp, out)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compile_texts(cc: str, texts: dict[str, str], mains: list[str], flags: list[str], out: Path) -> bool:
    """`_compile` from exactly the texts the build's name was hashed from, written to a temporary
    folder: a source edited while the compiler runs can never land under this name."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in texts.items():
            Path(tmp, name).write_text(text)
        return _compile(cc, [str(Path(tmp, n)) for n in mains], flags, out)


def sources_of(main: Path) -> list[Path]:
    """The C files the library is built from: the kernel `main` and its COMPANIONS beside it."""
    return [main, *(main.with_name(n) for n in COMPANIONS)]


def _load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None with `_STATE['broken']` saying why."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        _STATE["broken"] = "no C compiler (cc) found; GGUF linears dequantize instead"
        return None
    try:
        sources = sources_of(SOURCE)
        texts = {f.name: f.read_text() for f in [*sources, *(SOURCE.with_name(h) for h in HEADERS)]}
        src = "".join(texts.values())
    except OSError:
        _STATE["broken"] = f"{SOURCE.name} is missing from the installation; GGUF linears dequantize instead"
        return None
    base = hashlib.sha256((src + cc + _cpu_flags()).encode()).hexdigest()[:16]
    for flags in FLAG_SETS:
        key = hashlib.sha256((base + " ".join(flags)).encode()).hexdigest()[:16]
        out = cache_root() / "kernels" / f"ggml_gemv-{key}.so"
        try:
            if out.exists() or _compile_texts(cc, texts, [f.name for f in sources], flags, out):
                lib = ctypes.CDLL(str(out))
                for fn in (lib.ggml_gemm, lib.ggml_gemm_pool, lib.ggml_gemm_pool_rows):
                    fn.restype = ctypes.c_int
                    fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
                return lib
        except (OSError, subprocess.SubprocessError) as exc:
            _STATE["broken"] = f"GGUF kernel build failed ({exc.__class__.__name__}); GGUF linears dequantize instead"
    _STATE["broken"] = _STATE["broken"] or f"{cc} could not compile {SOURCE.name}; GGUF linears dequantize instead"
    return None


def _library() -> ctypes.CDLL | None:
    if not _STATE["tried"]:
        _STATE["tried"] = True
        _STATE["lib"] = _load()
        _STATE["fn"] = None if _STATE["lib"] is None else _STATE["lib"].ggml_gemm
    return _STATE["lib"]


def function(name: str, argtypes: list):
    """The built library's C function `name`, returning int, its argument types declared; None without one."""
    lib = _library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn


def enabled() -> bool:
    return not turned_off() and _library() is not None


def threads() -> int:
    return _STATE["held"] or torch.get_num_threads()


@contextlib.contextmanager
def host_ops_on_one_thread(on: bool = True):
    """torch's ops on one thread inside the block, the kernels on the threads torch had before it; `on`
    False: nothing changes. Not re-entrant across threads: one decoding thread."""
    n = torch.get_num_threads()
    if not on or n == 1 or _STATE["held"] is not None:
        yield
        return
    _STATE["held"] = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _STATE["held"] = None


@contextlib.contextmanager
def torch_threads_back():
    """Inside a `host_ops_on_one_thread` block, torch's threads as they were before it for one large op
    (a dense head's GEMM); elsewhere nothing changes."""
    held = _STATE["held"]
    if held is None:
        yield
        return
    torch.set_num_threads(held)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def kernel_status() -> str | None:
    if turned_off():
        return f"${ENV}=off: GGUF linears dequantize"
    return _STATE["broken"]


def usable(x: torch.Tensor, qtype: int | None, max_rows: int | None = MAX_ROWS) -> bool:
    """Whether `linear` serves x (see the contract); max_rows None: any number of rows."""
    if qtype not in QTYPES or x.dtype != torch.float32 or not x.is_cpu or not x.dim():
        return False
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    return (
        rows > 0
        and (max_rows is None or rows <= max_rows)
        and k % BLOCKS[qtype][0] == 0
        and (_STATE.get("fn") is not None if _STATE["tried"] else enabled())
        and not turned_off()
    )


def linear(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: int,
    out_features: int,
    rowmap: torch.Tensor | None = None,
    pool: bool = False,
    rowwise: bool = False,
) -> torch.Tensor:
    """x (..., in) fp32 CPU -> (..., out) fp32 = x W^T (see contract); about 211 calls per decoding step,
    so the Python side is checks and one allocation. `pool`: on the decoder stack's worker threads (the
    same numbers); `rowwise` (with `pool`): every row computed as a one-row call computes it."""
    if not _STATE["tried"]:
        _library()  # builds it on first call; fn None when there is none
    fn = _STATE["fn"]
    if pool:
        fn = _STATE["lib"].ggml_gemm_pool_rows if rowwise else _STATE["lib"].ggml_gemm_pool
    k = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    if not raw.is_contiguous():
        raw = raw.contiguous()
    per, size = BLOCKS[qtype]
    if raw.dtype != torch.uint8 or k % per or raw.numel() != out_features * (k // per) * size:
        raise ValueError(
            f"packed weight of {raw.numel()} bytes does not hold a ({out_features}, {k}) type-{qtype} matrix"
        )
    t = x.numel() // k
    lead = x.dim()  # torch.empty from ints: ~1 us, from a torch.Size: ~2-3 us
    f32 = torch.float32
    y = (
        torch.empty(x.shape[0], x.shape[1], out_features, dtype=f32)
        if lead == 3
        else torch.empty(t, out_features, dtype=f32)
        if lead == 2
        else torch.empty(x.shape[:-1] + (out_features,), dtype=f32)
    )
    rmap = None if rowmap is None else rowmap.data_ptr()
    rc = fn(qtype, raw.data_ptr(), x.data_ptr(), y.data_ptr(), rmap, out_features, k, t, threads())
    if rc != 0:
        raise RuntimeError(f"ggml_gemm failed ({rc})")
    return y


class PackedHead(nn.Linear):
    def __init__(self, weight: nn.Parameter, raw: torch.Tensor, qtype: int):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias, self.qtype = weight, None, qtype
        self.register_buffer("packed", raw, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if usable(x, self.qtype) and self.packed.device.type == "cpu":
            return linear(x, self.packed, self.qtype, self.out_features)
        with torch_threads_back():  # a large GEMM: torch's own threads, even inside a pass's one-thread block
            return F.linear(x, self.weight)

    def for_draft(self) -> PackedHead:
        """This head as the self-draft reads it: a Q8_0 head's bytes as Q8A (8-bit activations, kernels/sx_q8.h:
        about twice as fast a row, ~0.5% per logit); a head of any other type as it is."""
        return PackedHead(self.weight, self.packed, Q8A) if self.qtype == 8 else self


def head_logits(lm_head, h: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
    """lm_head(h) after a one-call stack pass: a PackedHead on the stack's worker threads (`rowwise` as in
    `linear`), any other head as it is, on torch's own threads."""
    packed = getattr(lm_head, "packed", None)
    if isinstance(lm_head, PackedHead) and packed.is_cpu and usable(h, lm_head.qtype):
        return linear(h, packed, lm_head.qtype, lm_head.out_features, pool=True, rowwise=rowwise)
    with torch_threads_back():  # a dense head: torch's own threads
        return lm_head(h)
