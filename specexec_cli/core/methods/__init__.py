"""Every decoding method by name: the registry the CLI, chat and bench resolve `--method` with.

Contract: `METHODS` maps a `--method` name to an `engine.StepFn` (the engine's `ar` and `specexec`,
chain, SpecInfer, Sequoia, staged); `generate` is `engine.generate` with `cfg.method`'s step (engine
never imports this package). Every step keeps engine.py's cache invariants and is lossless: greedy
ids equal the target's, at T > 0 the output follows the target's processed distribution. Method
options travel in `GenerationConfig.extra` (`common.MethodSettings`).
"""

from __future__ import annotations

from specexec_cli.core import engine
from specexec_cli.core.methods.sequoia import sequoia_step
from specexec_cli.core.methods.staged import staged_step
from specexec_cli.core.methods.static_tree import chain_step, specinfer_step
from specexec_cli.errors import SpecxError

METHODS: dict = {
    **engine.STEP_METHODS,
    "chain": chain_step,
    "specinfer": specinfer_step,
    "sequoia": sequoia_step,
    "staged": staged_step,
}


def step_for(method: str):
    """The StepFn for a `--method` name; SpecxError naming the choices if unknown."""
    if method not in METHODS:
        raise SpecxError(f"--method must be one of {', '.join(METHODS)} (got {method!r})")
    return METHODS[method]


def generate(m, st, new_ids, cfg, gen=None):
    """engine.generate with `cfg.method`'s step function (`ar` when the models have no draft:
    `--draft self` on a target with nothing to substitute)."""
    return engine.generate(m, st, new_ids, cfg, gen, step_fn=step_for(cfg.method if m.draft is not None else "ar"))
