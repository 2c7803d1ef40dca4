"""SpecInfer (arXiv 2305.09781): a token tree expanded level by level, multi-step speculative sampling.

Contract: `specinfer_step` is an engine StepFn. The tree is SpecInfer's expansion ⟨k1, k2, ...⟩:
every node at depth d gets k_{d+1} children (`--branching 4,2,2,1` → 4 + 8 + 16 + 16 = 44 nodes).
At T > 0 the children of a node are SAMPLED from the draft's processed distribution q without
replacement (renormalising q after each draw) — the condition under which the residual rule
(`common.choose_child`: accept x with prob min(1, p/q); on rejection p ← norm(max(0, p − q)) and
q ← norm(q with x zeroed); all rejected → sample the residual p) is exactly lossless. At T = 0 the
children are the draft's top-k and the target's argmax picks the path.

Without --branching the widths come from the budget (`branching_for_budget`): first level
min(4, W), doubling down to a width W = the largest power of two with W² <= budget, then chains of
width-W until the node count would exceed the budget or the depth reaches max_depth.
"""

from __future__ import annotations

from functools import lru_cache

from specexec_cli.core.methods.common import MethodSettings
from specexec_cli.core.methods.static_tree import Template, level_template, static_step


def branching_for_budget(budget: int, max_depth: int) -> tuple[int, ...]:
    """Level widths with about sqrt(budget) leaves and depth, at most `budget` nodes (see module doc)."""
    w = 1
    while (2 * w) ** 2 <= budget:
        w *= 2
    widths: list[int] = []
    width, total = 1, 0
    while len(widths) < max_depth:
        k = min(4, w) if not widths else (2 if width < w else 1)
        k = min(k, max(1, w // width))
        if total + width * k > budget:
            break
        widths.append(k)
        width *= k
        total += width
    return tuple(widths) or (1,)


@lru_cache(maxsize=64)
def specinfer_template(widths: tuple[int, ...]) -> Template:
    return level_template(widths)


def specinfer_step(m, st, cfg, gen, limit: int):
    widths = MethodSettings.of(cfg).branching or branching_for_budget(cfg.shape.budget, cfg.shape.max_depth)
    return static_step(m, st, cfg, gen, limit, specinfer_template(widths))
