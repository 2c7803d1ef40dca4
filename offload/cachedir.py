"""specx's cache directory: the one rule every cached artefact (kernels, tokenizers, quantized layers,
layer influence) is placed by.

Contract: `cache_root()` is $SPECX_CACHE (with ~ expanded) when set, else ~/.cache/specx; nothing is
created here.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("SPECX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specx"
