"""Byte-size parsing and formatting.

Contract: `parse_size` turns "0", "1024", "512MB", "24GB", "1.5GiB" (case-insensitive, optional
space, optional trailing "B") into an int number of bytes; decimal units (KB, MB, GB, TB) are
powers of 1000, binary units (KiB, MiB, GiB, TiB) powers of 1024. Anything else raises
ValueError with a message showing accepted forms. `format_bytes` is the inverse for display.
"""

from __future__ import annotations

import re

_PREFIXES = "kmgt"  # kilo, mega, giga, tera: the n-th is 1000^n (k, kb, ...) or 1024^n (kib, ...)
_UNITS = {"": 1, "b": 1}
_UNITS |= {p + unit: 1000**n for n, p in enumerate(_PREFIXES, 1) for unit in ("", "b")}
_UNITS |= {p + "ib": 1024**n for n, p in enumerate(_PREFIXES, 1)}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"invalid size {text!r}: sizes cannot be negative")
        return text
    match = _PATTERN.match(str(text))  # a bool ("True") never matches
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: expected e.g. 0, 1024, 512MB, 24GB, 1.5GiB")
    return round(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int | float) -> str:
    """Render bytes with decimal units, e.g. 41.9 MB."""
    n = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
