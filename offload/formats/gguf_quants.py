"""GGUF (ggml) block formats turned back into float weights with torch ops, on the tensor's device.

Contract: `dequantize(raw, qtype, shape, dtype)` takes a tensor's stored bytes (uint8, whole rows of
`row_bytes(qtype, shape[-1])` bytes) and returns the float tensor of torch-order `shape` in `dtype` on
`raw.device`. It follows the `gguf` package's `gguf.quants.dequantize` (numpy) step for step in
float32, so the float32 result is bitwise equal to it for every type in SUPPORTED (Q4_K, Q5_K, Q6_K,
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, 16/32-bit, and gpt-oss's MXFP4); a 16-bit `dtype` is it rounded once.
Two kernels run the same arithmetic (`kernel_choice`, $SPECX_DEQUANT_KERNEL = auto | compiled | eager):
- compiled (auto on CUDA): each type's block function and the cast torch.compile'd, so each weight is
  written once from the packed bytes (bench/dequant.py counts them); a Q/K row permutation gathers the
  packed rows first. A failed compile falls back to eager for the process (`kernel_status` says why).
- eager (auto on CPU, where each type compiles for ~20 s): rows in chunks of at most `CHUNK_ELEMS`
  values, so the float32 temporaries stay bounded (planning/membytes.linear_dequant_bytes).
"""

from __future__ import annotations

import math
import os
import warnings

import torch

QK_K = 256  # super-block size of the K-quants
CHUNK_ELEMS = 1 << 24  # float32 values per dequantization chunk (64 MiB of temporaries)
KERNEL_ENV = "SPECX_DEQUANT_KERNEL"  # auto | compiled | eager, for GGUF and formats/packed.py alike
_SHIFT4 = torch.tensor([0, 4], dtype=torch.uint8)  # low nibble, high nibble
_COMPILED: dict = {}  # ggml type -> its torch.compile'd fused block function
_STATE = {"broken": None}  # why the compiled kernel fell back to eager (one line), or None

# GGMLQuantizationType values (gguf.constants; kept numeric so this module imports without gguf)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16, MXFP4 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30, 39
# type -> (its name, values per block, bytes per block), as gguf.GGML_QUANT_SIZES states them
_TYPES = {
    F32: ("F32", 1, 4),
    F16: ("F16", 1, 2),
    BF16: ("BF16", 1, 2),
    Q8_0: ("Q8_0", 32, 34),
    Q4_0: ("Q4_0", 32, 18),
    Q4_1: ("Q4_1", 32, 20),
    Q5_0: ("Q5_0", 32, 22),
    Q5_1: ("Q5_1", 32, 24),
    Q4_K: ("Q4_K", QK_K, 144),
    Q5_K: ("Q5_K", QK_K, 176),
    Q6_K: ("Q6_K", QK_K, 210),
    MXFP4: ("MXFP4", 32, 17),
}
BLOCK = {t: (per, size) for t, (_, per, size) in _TYPES.items()}
NAMES = {t: name for t, (name, _, _) in _TYPES.items()}
SUPPORTED = tuple(BLOCK)
PLAIN = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}  # types stored as plain arrays


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes one row of `cols` values takes; ValueError when cols is not a whole number of blocks."""
    per, size = BLOCK[qtype]
    if cols % per:
        raise ValueError(f"row of {cols} values is not a multiple of the {NAMES[qtype]} block ({per})")
    return cols // per * size


def nbytes(qtype: int, shape) -> int:
    """Bytes a tensor of logical torch `shape` takes in a GGUF file."""
    return math.prod(shape[:-1]) * row_bytes(qtype, shape[-1])


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 -> (n, 1) float32 (little-endian half)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])  # (n, 1)
    x = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)  # (n, 32)
    return d * x


def halves(qs: torch.Tensor, dim: int) -> torch.Tensor:
    """Both nibbles of every byte along a new axis `dim` of size 2 (low nibble first), by a
    broadcast shift: one elementwise expression (a compiled kernel keeps it in registers, where a
    stack or cat of the two halves would write a buffer of codes)."""
    shape = [1] * (qs.dim() + 1)
    shape[dim] = 2
    return (qs.unsqueeze(dim) >> _SHIFT4.to(qs.device).view(shape)) & 0x0F


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return d * (_nibbles32(b[:, 2:]).to(torch.int8) - 8).to(torch.float32)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32) values: low nibbles are values 0..15, high nibbles 16..31."""
    return halves(qs, 1).reshape(qs.shape[0], 32)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) of its bits, bit i at column i."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.reshape(-1, 4, 1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles32(b[:, 4:]).to(torch.float32) + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles32(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles32(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)
    return d * q.to(torch.float32) + m


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes per block -> 8 six-bit scales and 8 six-bit mins (Q4_K/Q5_K), uint8 (n, 8)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # (n, 4) each
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k4_affine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K block header -> per-32-value scale and offset, float32 (n, 8, 1)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    return (d * sc.to(torch.float32)).reshape(n, -1, 1), (dmin * mn.to(torch.float32)).reshape(n, -1, 1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, off = _k4_affine(b)
    q = halves(b[:, 16:].reshape(n, 4, 32), 2).reshape(n, 8, 32).to(torch.float32)  # 4 groups of 32 bytes -> 64 values
    return (scale * q - off).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, off = _k4_affine(b)
    qh = b[:, 16:48].reshape(n, 1, 32)  # bit j of byte i: value 32*j + i
    ql = halves(b[:, 48:].reshape(n, 4, 32), 2).reshape(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    hi = (qh >> shifts) & 1  # (n, 8, 32)
    q = (ql | (hi << 4)).to(torch.float32)
    return (scale * q - off).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)  # (n, 16)
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    lo = halves(ql.reshape(n, 2, 64), 2).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    hi = ((qh.reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (d * q).reshape(n, QK_K)


# e2m1 (FP4) codes -> their values doubled (gguf-py's MXFP4.kvalues): sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
_E2M1_X2 = torch.tensor((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), dtype=torch.float32)
# E8M0 exponent e -> 2^(e - 128) in float32 (exact, 2^-128 a subnormal): half the block scale 2^(e - 127),
# matching the doubled values (ggml_e8m0_to_fp32_half)
_E8M0_HALF = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 128).float()


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """(n, 17) blocks -> (n, 32): byte 0 the E8M0 exponent, bytes 1..16 the e2m1 codes, value i in the low
    nibble of byte 1 + i and value 16 + i in its high nibble (llama.cpp's MXFP4, not the safetensors order)."""
    d = _E8M0_HALF.to(b.device)[b[:, 0].long()].unsqueeze(1)  # (n, 1)
    q = _E2M1_X2.to(b.device)[_nibbles32(b[:, 1:]).long()]  # (n, 32), exact small integers
    return d * q


_BLOCK_FN = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}
_BLOCK_FN[MXFP4] = _mxfp4


@torch.no_grad()
def dequantize(
    raw: torch.Tensor, qtype: int, shape, dtype: torch.dtype = torch.float32, rows_to: torch.Tensor | None = None
) -> torch.Tensor:
    """`rows_to`: (rows,) int64 on raw's device, the output row of each stored row (a row permutation
    undone while writing, e.g. llama.cpp's Q/K order); None keeps the order."""
    if qtype not in BLOCK:
        raise ValueError(f"GGUF type {qtype} is not supported")
    shape = tuple(int(d) for d in shape)
    cols, rows, need = shape[-1], math.prod(shape[:-1]), nbytes(qtype, shape)
    if raw.dtype != torch.uint8 or raw.numel() != need:
        raise ValueError(
            f"{NAMES[qtype]} tensor of shape {list(shape)} needs {need} bytes, got {raw.numel()} ({raw.dtype})"
        )
    if qtype in PLAIN:
        w = raw.contiguous().view(-1).view(PLAIN[qtype]).view(rows, cols)
        # F16 goes through float32 as the reference does (exact), then one rounding to dtype
        w = w.to(torch.float32).to(dtype) if qtype == F16 and dtype != torch.float16 else w.to(dtype)
        if rows_to is None:
            return w.reshape(shape)
        dst = torch.empty(rows, cols, dtype=dtype, device=raw.device)
        _put(dst, 0, rows, w, rows_to)
        return dst.reshape(shape)
    per, size = BLOCK[qtype]
    blocks = raw.reshape(rows, cols // per, size)
    if kernel_choice(raw.device) == "compiled" and _STATE["broken"] is None:
        w = _compiled_rows(blocks, qtype, dtype, rows_to)
        if w is not None:
            return w.reshape(shape)
    dst = torch.empty(rows, cols, dtype=dtype, device=raw.device)
    step = max(1, CHUNK_ELEMS // cols)
    fn = _BLOCK_FN[qtype]
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        vals = fn(blocks[r0:r1].reshape(-1, size))  # (chunk blocks, per) float32
        _put(dst, r0, r1, vals.reshape(r1 - r0, cols), rows_to)
    return dst.reshape(shape)


def kernel_choice(device: torch.device | str = "cuda") -> str:
    want = os.environ.get(KERNEL_ENV, "auto").strip().lower()
    if want in ("compiled", "eager"):
        return want
    return "compiled" if torch.device(device).type == "cuda" else "eager"


def kernel_status() -> str | None:
    """None while the compiled kernel works; else why this process fell back to eager."""
    return _STATE["broken"]


def run_compiled(key, fn, *args):
    """fn(*args) through torch.compile (compiled once per `key`, dynamic shapes), or None once
    compiling failed in this process (the caller then runs eager; kernel_status says why)."""
    try:
        compiled = _COMPILED.get(key)
        if compiled is None:
            compiled = _COMPILED[key] = torch.compile(fn, dynamic=True)
        with warnings.catch_warnings():  # Inductor's codegen notes are not the user's business
            warnings.simplefilter("ignore")
            return compiled(*args)
    except Exception as exc:  # noqa: BLE001 - no compiler, unsupported backend: eager computes the same
        _STATE["broken"] = f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        return None


def _fused(qtype: int):
    block = _BLOCK_FN[qtype]

    def run(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return block(blocks).to(dtype)  # (n, size) bytes -> (n, per) values, rounded once to dtype

    return run


def _compiled_rows(
    blocks: torch.Tensor, qtype: int, dtype: torch.dtype, rows_to: torch.Tensor | None
) -> torch.Tensor | None:
    """(rows, blocks per row, size) bytes -> (rows, cols) in dtype by the compiled kernel, or None once
    compiling failed. rows_to: stored row r goes to row rows_to[r], so output row j is stored row inv[j]."""
    if rows_to is not None:
        inv = torch.empty_like(rows_to)
        inv[rows_to] = torch.arange(rows_to.numel(), device=rows_to.device)
        blocks = blocks.index_select(0, inv)
    rows, size = blocks.shape[0], blocks.shape[-1]
    w = run_compiled(qtype, _fused(qtype), blocks.reshape(-1, size), dtype)
    return None if w is None else w.reshape(rows, -1)


def _put(dst: torch.Tensor, r0: int, r1: int, vals: torch.Tensor, rows_to: torch.Tensor | None) -> None:
    """Stored rows [r0, r1) into dst, at their own rows or at rows_to[r0:r1]."""
    if rows_to is None:
        dst[r0:r1].copy_(vals)
    else:
        dst.index_copy_(0, rows_to[r0:r1], vals.to(dst.dtype))
