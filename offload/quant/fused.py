"""Fused HQQ substitute linears: unpack + scale + matmul as one compiled function.

Contract:
- `unpack_codes(W_q, bits, rows)`: HQQ's bit-packed codes ("4bit_u8", "3bit_32", "2bit_u8": slice k of
  the packed rows at bit offset (per_word - 1 - k) * bits) -> the (rows, group) codes HQQ's unpack gives.
- `dequant_linear(x, W_q, scale, zero, bias, out, in, bits)` = x W^T (+ b), W = (codes - zero) * scale
  reshaped to (out, in), as one `torch.compile` graph; `fused_linear(...)` runs it compiled (dynamic
  shapes), or eagerly once compilation has failed (`fused_status()` says why, never on screen).
- `kernel_choice(device, compute)`: "blocks", "fused" or "eager" (its docstring).
Why no library kernel: the CUDA fused HQQ kernels (gemlite, HQQ's torchao_int4/bitblas/marlin) need
Triton or CUDA builds absent from CPU installs and cover 4/2 bits only; this works on both devices and widths.
"""

from __future__ import annotations

import os
import warnings

import torch

PER_WORD = {4: 2, 3: 10, 2: 4}  # codes per stored element (uint8, int32, uint8)
_STATE: dict = {"fn": None, "broken": None}  # compiled function; first compile failure (one line)


def unpack_codes(W_q: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """(rows, group) integer codes from HQQ's packed (ceil(rows / per_word), group) tensor."""
    k = PER_WORD[bits]
    shifts = torch.arange(k - 1, -1, -1, device=W_q.device, dtype=W_q.dtype) * bits  # (k,) high slice first
    codes = (W_q.unsqueeze(0) >> shifts.view(k, 1, 1)) & ((1 << bits) - 1)  # (k, step, group)
    return codes.reshape(k * W_q.shape[0], W_q.shape[1])[:rows]  # 3-bit pads rows to x10


def dequant_linear(
    x: torch.Tensor,
    W_q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    in_features: int,
    bits: int,
) -> torch.Tensor:
    """x (..., in) -> (..., out): the dequantized weight (out, in) never leaves this graph."""
    codes = unpack_codes(W_q, bits, scale.shape[0]).to(scale.dtype)  # (rows, group), rows = out*in/group
    w = ((codes - zero) * scale).reshape(out_features, in_features).to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


def kernel_choice(device: torch.device | str = "cuda", compute: torch.dtype | None = None) -> str:
    """$SPECX_LOWBIT_KERNEL blocks | fused | eager, or auto: fused on CUDA; on a CPU blocks (quant/lowbit_pack.py)
    where they can run (fp32 `compute`, the GGUF kernel built), else eager (fused is slower on CPU)."""
    from offload.cpu import ggml_kernel

    want = os.environ.get("SPECX_LOWBIT_KERNEL", "auto").strip().lower()
    cpu = torch.device(device).type == "cpu"
    blocks_ok = cpu and compute == torch.float32 and ggml_kernel.enabled()
    if want in ("fused", "eager"):
        return want
    if want == "blocks" or cpu:
        return "blocks" if blocks_ok else "eager"
    return "fused"


def fused_status() -> str | None:
    """None while the compiled path works; else why it fell back to eager (one line)."""
    return _STATE["broken"]


def fused_linear(*args) -> torch.Tensor:
    if _STATE["broken"] is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if _STATE["fn"] is None:
                    _STATE["fn"] = torch.compile(dequant_linear, dynamic=True)
                return _STATE["fn"](*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any compiler/backend failure: the eager graph is the same math
            _STATE["broken"] = f"torch.compile unavailable ({exc.__class__.__name__}); substitutes run eagerly"
    return dequant_linear(*args)
