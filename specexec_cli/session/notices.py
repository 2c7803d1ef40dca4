"""Where the session layer's one-line messages go: the front end that runs it decides how they look.

Contract: the session layer (loading, planning, options) and the HTTP front end report progress and
choices through `notice`, errors through `error` and a --dry-run plan through `plan`; none of them
imports a display library. Without a front end configured they print plain text on stderr (plan:
JSON); the terminal front end routes them to its rich display with `configure` at start-up.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable


def _plain_notice(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _plain_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def _plain_plan(plan: dict) -> None:
    print(json.dumps(plan, indent=1))


_SINKS: dict[str, Callable] = {"notice": _plain_notice, "error": _plain_error, "plan": _plain_plan}


def configure(
    notice: Callable[[str], None] | None = None,
    error: Callable[[str], None] | None = None,
    plan: Callable[[dict], None] | None = None,
) -> None:
    """Route the messages to a front end's renderers (any left None keeps its current sink)."""
    for name, fn in (("notice", notice), ("error", error), ("plan", plan)):
        if fn is not None:
            _SINKS[name] = fn


def notice(message: str) -> None:
    _SINKS["notice"](message)


def error(message: str) -> None:
    _SINKS["error"](message)


def plan(plan_json: dict) -> None:
    _SINKS["plan"](plan_json)
