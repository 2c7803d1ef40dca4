"""Measured tokens per target pass of each kind of draft: the acceptance priors of the draft cost model.

Contract: `tokens_per_pass(kind, temperature, budget, weights)` -> the expected tokens per target pass of a
draft of `kind` ("small", a self-draft width 4 / 3 / 2, or "skip") at `budget`, greedy or sampled by the
temperature: log-linear between the measured budgets of its row, flat beyond the largest; below the smallest
b0 (tokens t0), 1 + (t0 - 1) log(1 + b) / log(1 + b0) (plain decoding's 1 token at budget 0); never above
budget + 1. A self-draft width of a target of at most SMALL_TARGET `weights` reads TOKENS_PER_PASS_SMALL.
"""

from __future__ import annotations

import itertools
import math

TOKENS_PER_PASS = {
    "small": {
        "greedy": {16: 4.388, 64: 5.436, 256: 6.695, 1024: 7.848},
        "sampled": {16: 2.721, 64: 3.308, 256: 4.018, 1024: 4.653},
    },
    4: {
        "greedy": {16: 12.548, 64: 24.225, 256: 33.262, 1024: 39.914},
        "sampled": {16: 11.7, 64: 19.522, 256: 28.508, 1024: 30.966},
    },
    3: {
        "greedy": {16: 10.802, 64: 18.065, 256: 23.812, 1024: 28.128},
        "sampled": {16: 9.234, 64: 14.254, 256: 19.956, 1024: 22.734},
    },
    2: {
        "greedy": {16: 8.433, 64: 13.39, 256: 17.176, 1024: 20.444},
        "sampled": {16: 6.664, 64: 9.63, 256: 12.604, 1024: 14.426},
    },
    "skip": {"greedy": {16: 2.824}, "sampled": {16: 2.824}},
}
"""Tokens per target pass by draft and budget, measured on the shared pair (bench/selfdraft.py, 40 prompts,
128 new tokens, shared KV): "small" = the 2.9M shared draft, 4 = nf4 substitutes of every layer, 3 / 2 = HQQ;
greedy at T = 0 (bench/results/selfdraft_t0_gap*.json), sampled at T = 0.7 (selfdraft_t07_gap*.json); a prior
for other pairs. "skip" = the layer-skip self-draft of a resident target, measured on SmolLM2-135M-Instruct
Q4_1 at budget 16, greedy (bench/results/selfdraft_resident.json); its sampled row is the greedy figure."""


SMALL_TARGET = 1e9
"""Targets of at most this many weights take TOKENS_PER_PASS_SMALL's rows for the self-draft widths."""
TOKENS_PER_PASS_SMALL = {
    3: {
        "greedy": {4: 2.60, 8: 3.44, 16: 3.73, 32: 4.45, 64: 4.60},
        "sampled": {4: 2.60, 8: 3.44, 16: 3.73, 32: 4.45, 64: 4.60},
    },
    2: {"greedy": {4: 1.36, 8: 1.45, 16: 1.53}, "sampled": {4: 1.36, 8: 1.45, 16: 1.53}},
}
"""The self-draft's HQQ 3- / 2-bit substitutes measured on SmolLM2-135M-Instruct Q4_1 streamed from disk,
greedy (bench/spec_pass.py): a small real model accepts far less than the shared pair (3.7 and 1.5 where the
pair took 10.8 and 8.4 at budget 16). The sampled rows are the greedy figures standing in."""


def tokens_per_pass(kind, temperature: float, budget: int, weights: float | None = None) -> float:
    small = weights is not None and weights <= SMALL_TARGET and kind in TOKENS_PER_PASS_SMALL
    table = TOKENS_PER_PASS_SMALL if small else TOKENS_PER_PASS
    row = table[kind]["sampled" if temperature > 0 else "greedy"]
    pts = sorted(row.items())
    budget = max(1, budget)
    (b0, t0), b = pts[0], min(pts[-1][0], budget)
    if b < b0:  # between plain decoding (budget 0: 1 token) and the smallest measured tree
        got = 1 + (t0 - 1) * math.log1p(b) / math.log1p(b0)
    else:
        got = pts[-1][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            if b <= x1:
                got = y0 + (y1 - y0) * (math.log(b) - math.log(x0)) / (math.log(x1) - math.log(x0))
                break
    return min(got, budget + 1.0)
