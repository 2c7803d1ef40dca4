"""`specx quantize`: write a self-contained pre-quantized 4-bit checkpoint from a 16-bit one.

Contract: `quantize_checkpoint(target, out, progress)` resolves TARGET like --target (safetensors
only), refuses an OUT that exists and is not empty, and writes there, with the tokenizer, the
bitsandbytes NF4 checkpoint of offload's `write_quantized` (the `--dtype nf4` cache's format), which
transformers and specx both load. Returns a `QuantizeResult`; errors are SpecxError.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from specexec_cli.errors import SpecxError, offload_errors


@dataclass(frozen=True)
class QuantizeResult:
    out: Path  # the written checkpoint directory
    source_bytes: int  # bytes of the source's safetensors files
    out_bytes: int  # bytes of the written safetensors files
    seconds: float  # wall time of the conversion


def _st_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def quantize_checkpoint(target: str, out: Path, progress=None) -> QuantizeResult:
    from offload import write_quantized
    from specexec_cli.session.modelref import ModelRef

    ref = ModelRef("--target", target)
    src, ckpt = ref.path, ref.checkpoint if ref.safe else None  # the weights check refuses pickle-only sources
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecxError(f"--out {out}: already exists and is not empty; pick a new directory")
    if out.resolve() == src.resolve():
        raise SpecxError("--out must differ from --target")
    t0 = time.perf_counter()
    with offload_errors():
        write_quantized(ckpt, out, progress, tokenizer=True)
    return QuantizeResult(out, _st_bytes(src), _st_bytes(out), time.perf_counter() - t0)
