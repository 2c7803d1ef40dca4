"""Errors raised by the offload package.

Contract: every failure the user can fix (bad or truncated shard, missing tensor, unsupported
architecture, budgets that cannot fit) raises `OffloadError` with a one-line message that
names the offending file (or budget) and the fix. Nothing here imports the CLI.
"""

from __future__ import annotations


class OffloadError(Exception):
    """A user-fixable problem with the model files or the memory budgets."""


class OffloadNotice(UserWarning):
    """A one-line notice about a slower fallback (no O_DIRECT, pageable copies); the CLI prints
    these as notices, library users see ordinary warnings."""
