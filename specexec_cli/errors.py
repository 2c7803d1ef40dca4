"""User-facing errors.

Contract: anything the user can fix raises `SpecxError` with a one-line message that names the
fix. The CLI turns it into `error: ...` on stderr and exit code 2 (usage), with no traceback
unless `SPECX_DEBUG=1`.
"""

from __future__ import annotations

import os

USAGE_EXIT = 2


class SpecxError(Exception):
    """An error caused by input the user can fix (bad flag, bad file, bad model dir)."""

    def __init__(self, message: str, exit_code: int = USAGE_EXIT):
        super().__init__(message)
        self.exit_code = exit_code


def debug_enabled() -> bool:
    """True when SPECX_DEBUG asks for full tracebacks instead of one-line errors."""
    return os.environ.get("SPECX_DEBUG", "") not in ("", "0", "false", "no")
