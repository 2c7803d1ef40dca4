"""Optional packages (hqq, gguf, bitsandbytes, matplotlib): their extras, checks and install lines.

Contract: `OPTIONAL[module]` is each optional package's pyproject.toml extra (None: a core dependency
a broken install can still lack), tested version range (a test holds them to pyproject.toml) and what
needs it. `installed(module)` checks without importing; `install_hint(module)` is the one fix, from
the clone (the index's `specx` is someone else's package). `usable_draft(opts, plan, replan)` keeps a
plan-chosen self-draft width to those whose package is installed: the best usable candidate is
replanned, else `--draft auto` runs without a draft (one notice) and `--draft self` is refused.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

from specexec_cli.errors import SpecxError

# module -> (pyproject extra or None for a core dependency, tested version range, what needs it)
OPTIONAL = {
    "hqq": ("lowbit", ">=0.2.8,<0.3", "the 3- and 2-bit self-draft (--draft self --draft-bits 3|2)"),
    "gguf": ("gguf", ">=0.17,<0.20", "GGUF checkpoints"),
    "bitsandbytes": (None, ">=0.50.2,<0.51", "--dtype nf4 and the 4-bit self-draft"),
    "matplotlib": ("plot", ">=3.7", "specx bench's plots"),
}
BITS_NEED = {4: "bitsandbytes", 3: "hqq", 2: "hqq"}  # self-draft substitute width -> the package it quantizes with


def installed(module: str) -> bool:
    """`module` is found and not hidden as `sys.modules[name] = None`; imports nothing (hqq takes ~2 s)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent hidden or broken, or a __spec__ of None
        return False


def install_hint(module: str) -> str:
    extra, spec, _ = OPTIONAL[module]
    pkg = f"pip install '{module}{spec}'"
    return pkg if extra is None else f"pip install -e '.[{extra}]' in your specx clone (or {pkg})"


def missing_error(module: str, what: str | None = None) -> SpecxError:
    return SpecxError(
        f"{what or OPTIONAL[module][2]} needs {module}, which is not installed; fix: {install_hint(module)}"
    )


def usable_bits(bits) -> bool:
    """A width whose quantizer is installed (the layer-skip draft, bits 0, needs none)."""
    return bits not in BITS_NEED or installed(BITS_NEED[bits])


def skipped_clause(plan) -> str:
    """'; skipped 3-bit and 2-bit: hqq is not installed, fix: ...' for the candidates whose package is missing."""
    bits = {c.get("bits") for c in getattr(plan, "candidates", None) or []}
    gone = sorted((b for b in bits if b in BITS_NEED and not usable_bits(b)), reverse=True)
    if not gone:
        return ""
    need = sorted({BITS_NEED[b] for b in gone})
    widths = " and ".join(f"{b}-bit" for b in gone)
    return f"; skipped {widths}: " + "; ".join(f"{m} is not installed, fix: {install_hint(m)}" for m in need)


def usable_draft(opts, plan, replan):
    """(opts, plan, skipped): `skipped` is the clause for --draft auto's notice ("" when none)."""
    from specexec_cli.session import notices

    choosing = opts.draft in ("self", "auto") and getattr(opts, "draft_bits", None) is None
    if not choosing or plan is None:
        return opts, plan, ""
    skipped = skipped_clause(plan)
    chosen = getattr(plan, "substitute_bits", None)
    if chosen is None or usable_bits(chosen):
        if skipped and opts.draft == "self":
            notices.notice(f"--draft self: {chosen}-bit substitutes{skipped}")
        return opts, plan, skipped
    usable = [c for c in plan.candidates if c.get("fits") and c.get("bits") in BITS_NEED and usable_bits(c["bits"])]
    if usable:
        best = max(usable, key=lambda c: c.get("tokens_per_second", 0.0))
        opts = replace(opts, draft_bits=best["bits"])
        if opts.draft == "self":
            notices.notice(f"--draft self: {best['bits']}-bit substitutes{skipped}")
        return opts, replan(opts), skipped
    if opts.draft == "self":
        err = missing_error(BITS_NEED[chosen], f"--draft self on this target ({chosen}-bit substitutes)")
        raise SpecxError(f"{err}, or pass a small --draft DIR")
    notices.notice(
        f"--draft auto: no self-draft width is usable{skipped}, so decoding runs without a draft "
        "(pass --draft DIR for a small one)"
    )
    opts = replace(opts, draft=None, draft_bits=None)
    return opts, replan(opts), ""
