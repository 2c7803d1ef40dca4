"""Output-path checks done before any model loads, and the user's state directory.

Contract: `check_output_file` / `check_output_dir` raise `SpecxError` (one line naming the fix) when a
later write is certain to fail; they create nothing. `state_dir()` is $XDG_STATE_HOME/specx (default
~/.local/state/specx), created by the callers that write there.
"""

from __future__ import annotations

import os
from pathlib import Path

from specexec_cli.errors import SpecxError


def check_output_file(path: Path | str | None, flag: str) -> None:
    """A file that will be written (or appended to) later: its directory must exist and be writable."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise SpecxError(f"{flag} {p} is a directory; pass a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise SpecxError(f"{flag} {p}: directory {parent} does not exist; create it or pick another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise SpecxError(f"{flag} {p} is not writable; pick a writable path")


def check_output_dir(path: Path | str, flag: str) -> None:
    """A directory that will be created (with parents) and written into later."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise SpecxError(f"{flag} {p} exists and is not a directory; pass a directory path")
    probe = p
    while not probe.exists() and probe.parent != probe:  # the nearest existing ancestor is where mkdir will write
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise SpecxError(f"{flag} {p}: {probe} is a file, so the directory cannot be created; pick another path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SpecxError(f"{flag} {p}: {probe} is not writable; pick a writable path")


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "specx"
