"""Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023): γ draft tokens, one target pass.

Contract: `chain_step` is an engine StepFn. The draft proposes γ = MethodSettings.gamma tokens
autoregressively (its KV cache is reused; each draft forward computes one new token, the first
one also runs the committed tokens the draft has not seen). The target scores root + chain in one
pass with a causal mask. Token i is accepted with probability min(1, p_i(x_i) / q_i(x_i)) — p, q the
processed (temperature/top-k/top-p) target and draft distributions; on the first rejection the
target's token is drawn from norm(max(0, p_i - q_i)); after full acceptance a bonus token is drawn
from p at the last node. At T = 0 p and q are one-hot: the draft chain is greedy and acceptance
is a greedy match. The chain is the static tree ⟨1, 1, ..., 1⟩, so this is `static_step` with a
one-child template, whose multi-step rule with one child is exactly the rule above.
The budget is not used: γ alone sets the verified size.
"""

from __future__ import annotations

from functools import lru_cache

from specexec_cli.core.methods.common import MethodSettings
from specexec_cli.core.methods.static_tree import Template, level_template, static_step


@lru_cache(maxsize=64)
def chain_template(gamma: int) -> Template:
    return level_template((1,) * gamma)


def chain_step(m, st, cfg, gen, limit: int):
    gamma = MethodSettings.of(cfg).gamma
    if gamma < 1:
        raise ValueError(f"--gamma must be >= 1 (got {gamma})")
    return static_step(m, st, cfg, gen, limit, chain_template(min(gamma, cfg.shape.max_depth)))
