"""What a run needs of the optional packages, found before anything loads.

Contract: `require_for_run(opts)` raises SpecxError (exit 2) naming the first package a run with
these LoadOptions needs and lacks: bitsandbytes for `--dtype nf4` or a pre-quantized bitsandbytes
target or draft, gguf for a GGUF target or draft, hqq for an explicit `--draft-bits 3|2`; and
`--draft-bits 4` on an nf4 target (the substitutes would be the target itself), with the fixes that
work on this install. The packages, their checks and install lines are session/deps.py's; this
module reads the models' session/modelref.ModelRef (format, path) to know which apply.
"""

from __future__ import annotations

from specexec_cli.errors import SpecxError
from specexec_cli.session import deps
from specexec_cli.session.modelref import ModelRef
from specexec_cli.session.planning import prequantized


def require_for_run(opts) -> None:
    """Refuse, before loading, a run whose flags need a package that is missing (module docstring)."""
    if opts.dtype == "nf4" and not deps.installed("bitsandbytes"):
        raise deps.missing_error("bitsandbytes", "--dtype nf4")
    for ref in (r for r in (opts.target, opts.draft) if isinstance(r, ModelRef)):  # not self, auto or None
        gguf = ref.format == "gguf"
        if not deps.installed("gguf") and gguf:
            raise deps.missing_error("gguf", f"{ref.flag} {ref.name}: a GGUF checkpoint")
        if not deps.installed("bitsandbytes") and not gguf and prequantized(ref.path):
            raise deps.missing_error("bitsandbytes", f"{ref.flag} {ref.name}: a pre-quantized bitsandbytes checkpoint")
    bits = getattr(opts, "draft_bits", None)
    if opts.draft in ("self", "auto") and bits == 4 and opts.dtype == "nf4":
        hqq = "" if deps.installed("hqq") else f" (they need hqq: {deps.install_hint('hqq')})"
        raise SpecxError(
            "--draft-bits 4: the target is already 4-bit (--dtype nf4), so its 4-bit substitutes would "
            f"be the target itself; fix: --draft-bits 3 or 2{hqq}, the target in 16 bits (--dtype bf16, "
            "or fp32 on a CPU) with --draft-bits 4, or a small --draft DIR"
        )
    if opts.draft in ("self", "auto") and bits is not None and not deps.installed(deps.BITS_NEED[bits]):
        raise deps.missing_error(deps.BITS_NEED[bits], f"--draft-bits {bits}")
