"""User-facing errors.

Contract: anything the user can fix raises `SpecxError` with a one-line message that names the
fix; the CLI prints `error: ...` and exits 2, with no traceback unless `SPECX_DEBUG=1`. Also:
`write_output` writes a user-named file completely or not at all (one SpecxError line otherwise);
`oom_error` is the line for a device OOM during a pass (exit 3); `INTERRUPT_EXIT` (130) is Ctrl-C's
exit code; `offload_errors(flag)` turns an `offload.OffloadError` into one SpecxError line.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager, suppress
from pathlib import Path

USAGE_EXIT = 2
OOM_EXIT = 3
INTERRUPT_EXIT = 130


class SpecxError(Exception):
    """An error caused by input the user can fix (bad flag, bad file, bad model dir)."""

    def __init__(self, message: str, exit_code: int = USAGE_EXIT):
        super().__init__(message)
        self.exit_code = exit_code


@contextmanager
def offload_errors(flag: str | None = None):
    from offload import OffloadError

    try:
        yield
    except OffloadError as exc:
        raise SpecxError(f"{flag} {exc}" if flag else str(exc)) from None


def debug_enabled() -> bool:
    return os.environ.get("SPECX_DEBUG", "") not in ("", "0", "false", "no")


def write_output(path: Path, text: str, what: str) -> None:
    """Regular files go through a temp file + rename; devices such as /dev/full are written in place."""
    path = Path(path).expanduser()
    regular = not path.exists() or path.is_file()
    tmp = path.with_name(f".{path.name}.specx-tmp") if regular else path
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            if regular:
                os.fsync(fh.fileno())  # ENOSPC surfaces here at the latest, before the rename
        if regular:
            os.replace(tmp, path)
    except OSError as exc:
        if regular:
            with suppress(OSError):
                os.unlink(tmp)
        fix = "free some disk space or pick another path" if exc.errno == errno.ENOSPC else "pick a writable path"
        raise SpecxError(f"{what}: cannot write {path} ({exc.strerror or exc}); {fix}") from None


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA or another accelerator), without importing torch here."""
    return type(exc).__name__ == "OutOfMemoryError" or (
        "out of memory" in str(exc).lower()[:200] and isinstance(exc, RuntimeError)
    )


def oom_error(plan: str | None, budget, ctx=None) -> SpecxError:
    """The one line for a device OOM during a pass: what was planned, and what to lower."""
    where = f"plan: {plan}; " if plan else ""
    ctx_part = f" or --ctx (now {ctx})" if ctx else " or --ctx"
    return SpecxError(
        f"out of device memory during a pass ({where}budget {budget}); "
        f"lower --budget (now {budget}){ctx_part}, or a lower --max-gpu-memory to stream more layers",
        exit_code=OOM_EXIT,
    )
