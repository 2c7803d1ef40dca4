"""Calibrated node scores: the probability that the target accepts a tree node, learned online.

Contract: `Calibration` maps a candidate child's *feature* to an estimate of P(the target's token at
the parent == this child), since draft probabilities are not acceptance rates. Features: a draft
child's bin of draft log-probability (`LP_EDGES`; at T > 0 and in greedy gap mode the bin of its
score's gap, `COUPLED_EDGES`) crossed with the n-gram flag g (0 = not proposed, 1..3 = proposed with
a g-token suffix match); an n-gram chain child's g × position j (2..CHAIN_LEN). Each feature holds
`hits` and `tests` over a prior (mean `m0`, weight `w0`): estimate = (hits + w0·m0) / (tests + w0),
in (0, 1). A node's score sums log estimates along its path, so the top-`budget` set stays a tree.
`observe_pass` counts every child (kept or not) of an accepted-path node as tested against the
target's token there: an unbiased sample at any temperature. Calibrations live per (target, draft,
sampling, constrained) in the process (`for_pair`); the prior is a profile's `node_calibration`
entry or `builtin_prior`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

LP_EDGES = torch.tensor([-0.02, -0.1, -0.25, -0.5, -0.8, -1.2, -1.7, -2.3, -3.0, -4.0, -5.5, -8.0])
LP_CENTERS = [-0.01, -0.06, -0.17, -0.37, -0.65, -1.0, -1.45, -2.0, -2.65, -3.5, -4.75, -6.75, -9.0]
N_BINS = len(LP_CENTERS)  # bins of the draft log-probability (bin 0 = most likely)
COUPLED_EDGES = torch.tensor([4.0, 2.5, 1.6, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -2.0, -3.0, -5.0])
COUPLED_PRIOR = [0.97, 0.93, 0.88, 0.82, 0.72, 0.62, 0.5, 0.3, 0.18, 0.1, 0.05, 0.02, 0.005]
N_FLAGS = 4  # n-gram flag g: 0 = not proposed, 1..3 = proposed with a g-token suffix match
CHAIN_LEN = 8  # longest n-gram chain grown beyond an expanded node (positions 1..CHAIN_LEN)
N_DRAFT = N_BINS * N_FLAGS  # draft-child feature ids [0, N_DRAFT)
N_FEATURES = N_DRAFT + (N_FLAGS - 1) * CHAIN_LEN  # then chain features (g, j) for g >= 1
PROFILE_KEY = "node_calibration"
PRIOR_WEIGHT = 8.0  # pseudo-tests behind each prior mean


def draft_feature(logp: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """Feature ids of draft children: (…) draft log-probs and n-gram flags (0..3) → (…) long."""
    bins = torch.bucketize(-logp.float(), -LP_EDGES)  # -edges ascend; bin 0 = lp > -0.02
    return flag.long() * N_BINS + bins.clamp(max=N_BINS - 1)


def coupled_feature(gap: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """Feature ids of draft children ranked under coupled-draw noise: (…) perturbed-score gaps
    (top child: lead over the runner-up, >= 0; others: distance below the top, <= 0) and flags."""
    bins = torch.bucketize(-gap.float(), -COUPLED_EDGES)  # bin 0 = a lead above 4 nats
    return flag.long() * N_BINS + bins.clamp(max=N_BINS - 1)


def chain_feature(flag: int, pos: int) -> int:
    """Feature id of the n-gram chain node at position `pos` (2..CHAIN_LEN) for match length `flag`."""
    return N_DRAFT + (flag - 1) * CHAIN_LEN + (min(pos, CHAIN_LEN) - 1)


def gap_features(sampling_key: str) -> bool:
    """A calibration whose draft children are featured by gaps (`coupled_feature`): ",race" or ",gap"."""
    return sampling_key.endswith((",race", ",gap"))


def builtin_prior(coupled: bool = False) -> torch.Tensor:
    """Prior means when nothing was measured: the draft's own probability (coupled: a guess per
    gap bin), raised for n-gram hits."""
    m0 = torch.empty(N_FEATURES)
    p = torch.tensor(COUPLED_PRIOR) if coupled else torch.tensor(LP_CENTERS).exp()
    for g in range(N_FLAGS):
        m0[g * N_BINS : (g + 1) * N_BINS] = p if g == 0 else torch.clamp(p + 0.15 * g, max=0.95)
        if g:
            pos = torch.arange(1, CHAIN_LEN + 1, dtype=torch.float)
            m0[N_DRAFT + (g - 1) * CHAIN_LEN : N_DRAFT + g * CHAIN_LEN] = 0.25 * g * 0.9 ** (pos - 1)
    return m0


@dataclass
class Calibration:
    """Per-feature acceptance counts on top of a prior; see the module docstring."""

    m0: torch.Tensor = field(default_factory=builtin_prior)  # (N_FEATURES,) prior means
    w0: float = PRIOR_WEIGHT  # prior weight in pseudo-tests
    hits: torch.Tensor = field(default_factory=lambda: torch.zeros(N_FEATURES))  # accepted tests
    tests: torch.Tensor = field(default_factory=lambda: torch.zeros(N_FEATURES))  # tested candidates

    def log_accept(self) -> torch.Tensor:
        """(N_FEATURES,) log of the estimated acceptance probability per feature."""
        est = (self.hits + self.w0 * self.m0) / (self.tests + self.w0)
        return est.clamp(1e-6, 1 - 1e-6).log()

    def observe(self, feats: torch.Tensor, hit: torch.Tensor) -> None:
        """Add tested candidates: feature ids (n,) and whether each was the target's token (n,)."""
        ok = feats >= 0
        self.tests += torch.bincount(feats[ok], minlength=N_FEATURES).float()
        self.hits += torch.bincount(feats[ok], weights=hit[ok].float(), minlength=N_FEATURES).float()

    def rates(self) -> list[float]:
        return [round(float(x), 4) for x in self.log_accept().exp()]


def observe_pass(cal: Calibration, tree, path_nodes: list[int], tokens: list[int]) -> None:
    """Update `cal` from one pass: tokens[i] (emitted) is the target's token at the i-th node of [root] +
    `path_nodes` (draft-tree ids), so that node's children were tested against it."""
    parents = ([0] + list(path_nodes))[: len(tokens)]
    target_tok = torch.full((tree.size,), -1, dtype=torch.long)
    target_tok[torch.tensor(parents, dtype=torch.long)] = torch.tensor(tokens[: len(parents)], dtype=torch.long)
    par = tree.parents.clamp(min=0)
    tested = (tree.parents >= 0) & (target_tok[par] >= 0)
    hit = tree.tokens[tested] == target_tok[par][tested]
    cal.observe(tree.feat[tested], hit)


_PAIRS: dict[tuple, Calibration] = {}  # (id(target), id(draft), sampling key, constrained) → calibration


def for_pair(
    target, draft, sampling_key: str, profile: str | None = None, stored: dict | None = None, constrained: bool = False
) -> Calibration:
    """The process-wide calibration of this pair and sampling (`constrained`: under a grammar, kept
    apart); its prior from `profile_prior`."""
    key = (id(target), id(draft), sampling_key, constrained)
    if key not in _PAIRS:
        _PAIRS[key] = Calibration(m0=profile_prior(profile, sampling_key, stored))
    return _PAIRS[key]


def fresh(target, draft, sampling_key: str) -> Calibration:
    """Start this pair's calibration over from the built-in prior (what `specx profile` measures)."""
    _PAIRS.pop((id(target), id(draft), sampling_key, False), None)
    return for_pair(target, draft, sampling_key)


def profile_prior(profile: str | None, sampling_key: str, stored: dict | None = None) -> torch.Tensor:
    """Prior means from `stored[sampling_key]` or a profile JSON's `node_calibration`, else `builtin_prior`."""
    rates = (stored or {}).get(sampling_key)
    path = Path(profile) if profile else None
    if not rates and path is not None and path.is_file():
        try:
            rates = (json.loads(path.read_text() or "{}").get(PROFILE_KEY) or {}).get(sampling_key)
        except (OSError, ValueError, AttributeError):
            rates = None
    if isinstance(rates, list) and len(rates) == N_FEATURES:
        return torch.tensor(rates, dtype=torch.float).clamp(1e-4, 1 - 1e-4)
    return builtin_prior(coupled=gap_features(sampling_key))
