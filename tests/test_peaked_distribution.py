"""Lossless sampling on PEAKED distributions, for every method, with a planted bug that must be caught.

Why: real instruct models put ~0.9 on one token most of the time. A sampler that rounds such
tokens to certainty (emits the top token always once p >= 0.9) keeps the argmax and the support,
so greedy tests, support checks and tests on flat tables pass it. Here the fake target's table
gives every context a top token with processed probability in [0.84, 0.96] (about half of them
>= 0.9) and spreads the rest over the other tokens; temperature 1 with no top-k/top-p, so the
processed distribution is exactly the table's (a top-p of 0.9 would legitimately cut the tail).

Statistics: those of tests/test_distribution.py (top-1 z, rank chi-square, randomised PIT KS,
all at alpha = 1e-3), on all emitted tokens of a method and, separately, on the peaked stratum
(tokens whose top probability c_i >= 0.9; a valid test under the null like any split).

Power against the plant (asserted by `assert_catches_the_plant` on the records themselves): the
planted bug raises the top-1 hit count of the peaked stratum by S = sum over its tokens of
(1 - c_i), while that stratum's z statistic has standard deviation sqrt(sum c_i (1 - c_i)); with
S >= (3.29 + 1.28) sd the two-sided z test at alpha = 1e-3 detects it with power >= 0.9 (S is
~5-6 sd here). Pooled over all tokens the same shift is only ~2.5 sd (the other tokens add
variance, not signal), so the pooled test alone would miss the plant about half the time.
`test_the_planted_bug_is_caught` runs the plant (in the one function every method uses to turn
logits into probabilities) and asserts the check fails, so this file cannot pass vacuously.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from scipy.stats import norm

from specexec_cli.core import sampling
from specexec_cli.core.engine import DecodeState
from specexec_cli.core.methods import generate
from specexec_cli.core.sampling import SamplingParams
from tests.fakes import fake_models, next_logits, noisy
from tests.test_distribution import ALPHA, METHOD_CFG, check, method_config

V = 8
PARAMS = SamplingParams(temperature=1.0)  # processed distribution = the table's softmax
RUNS, RUN_TOKENS = 6, 250
METHODS = ["ar", *sorted(METHOD_CFG)]


def peaked_table(v: int, seed: int) -> torch.Tensor:
    """(v, v, v) logits: per context a random top token with p in [0.84, 0.96], the rest spread."""
    g = torch.Generator().manual_seed(seed)
    top = 0.84 + 0.12 * torch.rand(v, v, generator=g)  # (v, v) top probability
    rest = torch.rand(v, v, v, generator=g) + 0.2  # (v, v, v) tail weights
    winner = torch.randint(0, v, (v, v), generator=g)
    rest.scatter_(2, winner[..., None], 0.0)
    probs = rest / rest.sum(-1, keepdim=True) * (1 - top)[..., None]
    probs.scatter_(2, winner[..., None], top[..., None])
    return probs.log()


TABLE = peaked_table(V, seed=3)
DRAFT = noisy(TABLE, 0.5, seed=4)


def emitted(method: str, seed: int) -> list[tuple[list[float], int, int]]:
    """Per emitted token: (target probs by rank, the token's rank, 0) as test_distribution.check wants."""
    m = fake_models(TABLE, DRAFT)
    cfg = method_config(method)(PARAMS, RUN_TOKENS) if method != "ar" else _ar_config()
    prompt = [seed % V, (3 * seed + 1) % V]
    history, out = list(prompt), []
    for ev in generate(m, DecodeState(), prompt, cfg, torch.Generator().manual_seed(seed)):
        for tok in ev.tokens:
            p = torch.softmax(next_logits(TABLE, history) / PARAMS.temperature, -1).tolist()
            order = sorted(range(V), key=lambda t: (-p[t], t))
            out.append(([p[t] for t in order], order.index(tok), 0))
            history.append(tok)
    return out


def _ar_config():
    from specexec_cli.core.engine import GenerationConfig

    return GenerationConfig(method="ar", sampling=PARAMS, max_new_tokens=RUN_TOKENS)


def collect(method: str) -> list:
    return [rec for seed in range(RUNS) for rec in emitted(method, seed)]


def peaked(records) -> list:
    """The stratum the plant acts on: tokens whose top processed probability is >= 0.9."""
    return [r for r in records if r[0][0] >= 0.9]


def assert_catches_the_plant(records) -> None:
    c = [r[0][0] for r in peaked(records)]
    shift = sum(1 - x for x in c)
    sd = math.sqrt(sum(x * (1 - x) for x in c))
    need = norm.isf(ALPHA / 2) + norm.isf(1 - 0.9)  # two-sided alpha, power 0.9
    assert shift >= need * sd, (shift, sd, len(records))
    assert len(c) >= 0.25 * len(records)  # the table really is peaked around 0.9


def check_peaked(records, label: str) -> None:
    check(records, f"{label}, all tokens")
    check(peaked(records), f"{label}, tokens with p >= 0.9")


@pytest.mark.parametrize("method", METHODS)
def test_peaked_distributions_are_sampled_exactly(method):
    records = collect(method)
    assert_catches_the_plant(records)
    check_peaked(records, f"{method} (peaked)")


def _planted(original):
    def process_logits(logits, params):
        """The planted bug: a token with probability >= 0.9 becomes certain."""
        probs = original(logits, params)
        top = probs.max(-1, keepdim=True)
        certain = torch.zeros_like(probs).scatter_(-1, top.indices, 1.0)
        return torch.where(top.values >= 0.9, certain, probs)

    return process_logits


@pytest.mark.parametrize("method", METHODS)
def test_the_planted_bug_is_caught(method, monkeypatch):
    original = sampling.process_logits
    fake = _planted(original)
    for mod in list(sys.modules.values()):  # every module that bound the function by name
        if getattr(mod, "__name__", "").startswith("specexec_cli") and getattr(mod, "process_logits", None) is original:
            monkeypatch.setattr(mod, "process_logits", fake)
    with pytest.raises(AssertionError, match="p-values"):
        check_peaked(collect(method), f"{method} (planted)")
