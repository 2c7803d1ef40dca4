"""Lossless sampling, with statistical power: every method's emitted tokens follow the target's law.

Setup: the fake table LMs of tests/fakes.py (vocab 8, microseconds per forward, every mask and
position checked), a low-noise draft (passes accept 0..3 tokens, so acceptance, rejection, the
residual draw and the bonus token all happen), T = 0.7 with top-k = 3 and top-p = 0.9 (temperature,
top-k and nucleus all change the distribution; a draft processed one way for sampling and another
for acceptance would show). The reference is computed here, independently of specexec_cli.core.sampling
(`ref_probs`), from the fake target's table.

What is tested: the joint law of the emitted tokens, through the chain rule. Each emitted token,
given everything emitted before it, must be an exact sample of the target's processed
distribution at that history — whether it is the 1st, 2nd or 3rd token of its pass (the joint of
the first 2-3 tokens of a pass, factorised), or the bonus token after a fully accepted chain. Long
generations give thousands of such tokens cheaply (~2.5 per target pass). Statistics, each split
by the token's position in its pass and pooled over all tokens:
  - support: no token the processed target gives probability 0 (top-k / top-p cut) is ever emitted;
  - z-test of the top-1 indicator: Z = Σ(1[t_i = argmax p_i] − c_i) / sqrt(Σ c_i(1 − c_i)) ~ N(0, 1)
    (a martingale CLT; c_i = max p_i);
  - Pearson chi-square of the rank of each token under p_i against E_k = Σ_i p_i(rank k)
    (valid and conservative for heterogeneous multinomials);
  - Kolmogorov-Smirnov of the randomised PIT u_i = F_i(t_i−) + U·p_i(t_i), which is exactly
    iid Uniform(0, 1) under the null (Rosenblatt), tokens ordered by rank.

Power calculation (asserted in `assert_powerful`): the z-test at two-sided α = 1e-3 (z = 3.29)
detects a 10% relative change of the top token's probability c with power 0.9 (z = 1.28) once
n >= ((3.29 + 1.28) / 0.1)² (1 − c) / c; here the mean top probability is c̄ ≈ 0.735, so
n >= ~760. Each method emits N_TOKENS = 2400 tokens (8 runs of 300 from different prompts): the
pooled test has power > 0.999 for a 10% change, and each pass-position split (positions 1, 2, 3+:
~650-900 tokens each) has power ~0.85-0.95. Wrong residuals or a mismatched draft distribution move
the whole rank profile and are caught far more easily. ~10 s per method on one loaded core.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from scipy.stats import chi2, kstest, norm

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.core.methods.common import with_settings
from specexec_cli.core.sampling import SamplingParams
from tests.fakes import fake_models, next_logits, noisy, random_table

V = 8
PARAMS = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)  # top-k binds in 22 of 64 contexts, top-p in 43
ALPHA, POWER, DELTA = 1e-3, 0.9, 0.10
RUNS, RUN_TOKENS = 8, 300
N_TOKENS = RUNS * RUN_TOKENS
TABLE = random_table(V, seed=0, scale=2.0)
DRAFT = noisy(TABLE, 0.7, seed=11)


def ref_probs(logits: torch.Tensor, params: SamplingParams) -> dict[int, float]:
    """Independent reference of the processed distribution: /T, top-k, softmax, smallest nucleus >= p."""
    z = [float(x) / params.temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if params.top_k > 0:
        order = order[: params.top_k]
    top = max(z[i] for i in order)
    w = {i: math.exp(z[i] - top) for i in order}
    total = sum(w.values())
    kept, mass = {}, 0.0
    for i in order:  # descending probability
        if mass >= params.top_p:
            break
        kept[i] = w[i] / total
        mass += kept[i]
    s = sum(kept.values())
    return {i: v / s for i, v in kept.items()}


def samples_needed(c: float, delta=DELTA, alpha=ALPHA, power=POWER) -> int:
    """n for a two-sided z-test at `alpha` to catch c → c(1 ± delta) with `power`."""
    z = norm.isf(alpha / 2) + norm.isf(1 - power)
    return math.ceil((z / delta) ** 2 * (1 - c) / c)


def emitted(m, cfg, params, seed: int) -> list[tuple[list[float], int, int]]:
    """Generate; per emitted token: (target's processed probs by rank, rank of the token, position in pass)."""
    prompt = [seed % V, (3 * seed + 1) % V, 2, (seed + 5) % V]
    out = []
    history = list(prompt)
    for ev in generate(m, DecodeState(), prompt, cfg, torch.Generator().manual_seed(seed)):
        for j, tok in enumerate(ev.tokens):
            p = ref_probs(next_logits(TABLE, history), params)
            ranked = sorted(p, key=lambda t: (-p[t], t))
            probs = [p[t] for t in ranked]
            rank = ranked.index(tok) if tok in p else -1  # -1: outside the processed support
            out.append((probs, rank, 0 if ev.pass_index == 0 else j + 1))
            history.append(tok)
    return out


def collect(method_cfg, params=PARAMS, draft=DRAFT, runs=RUNS, run_tokens=RUN_TOKENS):
    m = fake_models(TABLE, draft)
    cfg = method_cfg(params, run_tokens)
    return [rec for seed in range(runs) for rec in emitted(m, cfg, params, seed)]


def check(records, label: str) -> dict[str, float]:
    """The three statistics of the module docstring; returns their p-values (asserting support)."""
    bad = [r for r in records if r[1] < 0]
    assert not bad, f"{label}: {len(bad)} tokens outside the processed target's support"
    c = [r[0][0] for r in records]
    hits = sum(r[1] == 0 for r in records)
    var = sum(x * (1 - x) for x in c)
    z = (hits - sum(c)) / math.sqrt(var) if var > 0 else 0.0
    n_ranks = max(len(r[0]) for r in records)
    exp = [sum(r[0][k] for r in records if k < len(r[0])) for k in range(n_ranks)]
    obs = [sum(r[1] == k for r in records) for k in range(n_ranks)]
    cells, acc_o, acc_e = [], 0, 0.0  # pool the tail ranks until each cell expects >= 5
    for o, e in zip(obs, exp):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            cells.append((acc_o, acc_e))
            acc_o, acc_e = 0, 0.0
    if acc_e > 0 and cells:
        cells[-1] = (cells[-1][0] + acc_o, cells[-1][1] + acc_e)
    stat = sum((o - e) ** 2 / e for o, e in cells)
    p_rank = float(chi2.sf(stat, len(cells) - 1)) if len(cells) > 1 else 1.0
    g = torch.Generator().manual_seed(0)
    u = [sum(r[0][: r[1]]) + float(torch.rand(1, generator=g)) * r[0][r[1]] for r in records]
    p_ks = float(kstest(u, "uniform").pvalue)
    p_z = float(2 * norm.sf(abs(z)))
    pv = {"top1_z": p_z, "rank_chi2": p_rank, "pit_ks": p_ks}
    assert min(pv.values()) > ALPHA, f"{label}: n={len(records)} p-values {pv}"
    return pv


def assert_powerful(records) -> None:
    c = sum(r[0][0] for r in records) / len(records)
    assert len(records) >= samples_needed(c), (len(records), samples_needed(c), c)


def check_by_position(records, label: str, positions=(1, 2, 3)) -> None:
    groups = defaultdict(list)
    for r in records:
        if r[2] > 0:
            groups[min(r[2], positions[-1])].append(r)
    for pos in positions:
        assert len(groups[pos]) >= 150, f"{label}: only {len(groups[pos])} tokens at pass position {pos}"
        check(groups[pos], f"{label}, pass position {pos}{'+' if pos == positions[-1] else ''}")
    check(records, f"{label}, all tokens")


METHOD_CFG = {  # depth-3 trees (chain γ = 3), each with more than one node per level where it can
    "specexec": dict(shape=TreeShape(8, 3, max_beams=4, max_branch=3)),
    "chain": dict(shape=TreeShape(8, 3), gamma=3),
    "specinfer": dict(shape=TreeShape(10, 3), branching=(2, 2, 1)),
    "sequoia": dict(shape=TreeShape(8, 3)),
    "staged": dict(shape=TreeShape(8, 3, max_beams=4, max_branch=3)),
}


def method_config(method: str):
    opts = dict(METHOD_CFG[method])
    shape = opts.pop("shape")

    def make(params, n):
        return with_settings(GenerationConfig(method=method, shape=shape, sampling=params, max_new_tokens=n), **opts)

    return make


@pytest.mark.parametrize("method", sorted(METHOD_CFG))
def test_every_emitted_token_follows_the_target(method):
    """Tokens 1, 2 and 3+ of each pass (the pass's joint law, factorised) and all tokens together."""
    records = collect(method_config(method))
    assert_powerful(records)
    check_by_position(records, method)


def test_bonus_token_after_fully_accepted_chain():
    """Chain γ = 3 with a closer draft: position-4 tokens are bonus tokens after full acceptance."""
    records = collect(method_config("chain"), draft=noisy(TABLE, 0.3, seed=12), runs=6)
    bonus = [r for r in records if r[2] == 4]
    assert len(bonus) >= 300, len(bonus)
    check(bonus, "bonus token")


@pytest.mark.parametrize("params", [SamplingParams(1.3, top_p=0.8), SamplingParams(0.5, top_k=3)])
@pytest.mark.parametrize("method", ["specexec", "specinfer"])
def test_other_processing_settings(params, method):
    """Only top-p, only top-k: fewer tokens (the support and rank tests still bite on any mismatch)."""
    records = collect(method_config(method), params=params, runs=4, run_tokens=250)
    check_by_position(records, f"{method} {params}", positions=(1, 2))
