"""Where the automatic budget's seconds come from (core/budget.py's tuner reads them).

Contract: `TimingModel` gives t_target(n), the seconds of a target pass of n tokens, and
t_draft(budget, beams), a tree's draft seconds (log-log interpolation between points, else
`draft_steps` x one step), from `from_profile` (measured), `from_plan` (the memory plan's model) or
`prior()` (t(n) = 1 + n / FALLBACK_KNEE), in core/budget.py's order of preference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from offload.planning import interpolate  # log-log between measured points, one home

FALLBACK_KNEE = 32  # without a profile or a plan (pickle weights): tree tokens where t(n) starts to grow


def draft_steps(budget: int, beams: int) -> float:
    """Draft forwards of a tree of `budget` nodes: the root run, one per beam batch, ~log2 levels."""
    return 1 + math.ceil(budget / max(beams, 1)) + math.log2(1 + budget)


@dataclass
class TimingModel:
    """Seconds per pass as a function of the budget; see the module docstring."""

    target_points: dict[int, float]  # n tree tokens (root included) → seconds per target pass
    draft_step_seconds: float  # one draft forward over max_beams nodes
    draft_points: dict[int, float] = field(default_factory=dict)  # budget → grow_tree seconds
    source: str = "prior"  # "profile" or "prior"

    @classmethod
    def prior(cls) -> TimingModel:
        """Used only without a profile and without a memory plan (module docstring)."""
        points = {n: 1.0 + n / FALLBACK_KNEE for n in (1 << k for k in range(13))}
        return cls(points, draft_step_seconds=0.05, source="prior")  # draft step ≈ 1/20 target pass

    @classmethod
    def from_plan(cls, plan: dict | None) -> TimingModel | None:
        """The plan's modelled pass and draft seconds per budget: `by_budget` of the candidate the run uses
        (`used`: an explicit small draft's own row) or else of its chosen one."""
        rows = ((plan or {}).get("used") or (plan or {}).get("choice") or {}).get("by_budget") or []
        if not rows:
            return None
        # what a run measures: the draft's whole grow time, and a verify pass whose streamed reads partly
        # ran while the draft grew (the hidden seconds leave the verify pass, not the draft)
        target = {int(r["budget"]) + 1: max(r["pass_seconds"] - r.get("hidden_seconds", 0.0), 1e-6) for r in rows}
        plain = next((c for c in plan.get("candidates") or [] if c.get("draft") == "none"), None)
        if plain:
            target[1] = plain["pass_seconds"]
        draft = {int(r["budget"]): max(r["draft_seconds"], 1e-6) for r in rows}
        step = min(draft.values()) / 2
        return cls(target, step, draft, source="plan")

    @classmethod
    def from_profile(
        cls, profile: dict, draft: str | None = None, planned: TimingModel | None = None
    ) -> TimingModel | None:
        """The profile's measured passes and its timings of `draft` ("self-N" | "small:PATH"; None: the
        first it timed); an untimed draft is priced by `planned`, else there is no model (None)."""
        m = (profile or {}).get("models") or {}
        pts = {int(k): float(v) for k, v in (m.get("target_seconds") or {}).items()}
        timed = _draft_timing(m, draft)
        if not pts or (timed is None and planned is None):
            return None
        step, grow = timed or (planned.draft_step_seconds, planned.draft_points)
        return cls(pts, step, grow, source="profile")

    def t_target(self, n: int) -> float:
        return interpolate(self.target_points, n)

    def t_draft(self, budget: int, beams: int = 32) -> float:
        if self.draft_points:
            return interpolate(self.draft_points, budget)
        return draft_steps(budget, beams) * self.draft_step_seconds


def _draft_timing(m: dict, draft: str | None) -> tuple[float, dict[int, float]] | None:
    """(step seconds, grow seconds by budget) the profile's models part measured for `draft`, or None."""
    if draft is None:
        step, grow = m.get("draft_step_seconds"), m.get("draft_grow_seconds")
    else:
        key, _, path = draft.partition(":")
        t = (m.get("draft_timings") or {}).get(key) or {}
        if path and str(Path(m.get("draft") or "").expanduser().resolve()) != path:
            t = {}  # the profile timed another small draft
        step, grow = t.get("step_seconds"), t.get("grow_seconds")
    return (float(step), {int(k): float(v) for k, v in (grow or {}).items()}) if step else None
