"""Extra decoding methods (chain, SpecInfer, Sequoia, staged), each one engine step function.

Contract: `METHODS` maps a `--method` name to a `engine.StepFn`. Every step keeps the engine's
cache invariants (see engine.py) and is lossless: greedy ids equal the target's, and at T > 0 the
output distribution is the target's processed distribution. Method options (γ, branching, the
Sequoia profile path) travel in `GenerationConfig.extra`; see `common.MethodSettings`.
"""

from __future__ import annotations

from specexec_cli.methods.chain import chain_step
from specexec_cli.methods.sequoia import sequoia_step
from specexec_cli.methods.specinfer import specinfer_step
from specexec_cli.methods.staged import staged_step

METHODS: dict = {"chain": chain_step, "specinfer": specinfer_step, "sequoia": sequoia_step,
           "staged": staged_step}
