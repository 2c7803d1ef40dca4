"""Extra decoding methods (chain, SpecInfer, Sequoia, staged), each one engine step function.

Contract: `METHODS` maps a `--method` name to a `engine.StepFn`. Every step keeps the engine's
cache invariants (see engine.py) and is lossless: greedy ids equal the target's, and at T > 0 the
output distribution is the target's processed distribution.
"""

from __future__ import annotations

METHODS: dict = {}
