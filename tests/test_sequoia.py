"""Sequoia's DP: known-optimal trees for small hand-worked acceptance vectors, and the profile cache.

Trees are parent tuples (root -1; children in rank order). Expected tokens per pass F(T) counts the
root's token as 1 and node v as the product of a_rank along its path.
"""

from __future__ import annotations

import itertools
import json

import pytest

from specexec_cli.core.methods.sequoia import PROFILE_KEY, acceptance_vector, optimal_tree, sampling_key
from specexec_cli.core.methods.static_tree import Template
from specexec_cli.core.sampling import SamplingParams


def expected_tokens(tpl: Template, a: tuple[float, ...]) -> float:
    """F(T) of a template under the positional model: the DP's objective, computed directly."""
    f = [1.0] * len(tpl.parents)
    total = 1.0
    for par, kids in enumerate(tpl.children()):
        for rank, child in enumerate(kids):
            f[child] = f[par] * (a[rank] if rank < len(a) else 0.0)
            total += f[child]
    return total


@pytest.mark.parametrize(
    "a,budget,depth,parents,value",
    [
        ((0.8, 0.1), 2, 2, (-1, 0, 1), 1 + 0.8 + 0.64),  # a strong rank 1: a chain
        ((0.5, 0.4), 2, 2, (-1, 0, 0), 1 + 0.5 + 0.4),  # a strong rank 2: a star
        ((0.6, 0.3), 3, 3, (-1, 0, 1, 0), 1 + 0.6 + 0.36 + 0.3),  # mixed: beats chain 2.176, star+leaf 2.14
        ((0.9,), 3, 5, (-1, 0, 1, 2), 1 + 0.9 + 0.81 + 0.729),  # one rank only: chain of the budget
        ((0.6, 0.3, 0.1), 3, 1, (-1, 0, 0, 0), 2.0),  # depth 1: every rank
        ((0.9,), 5, 2, (-1, 0, 1), 1 + 0.9 + 0.81),  # depth and rank limits leave budget unused
    ],
)
def test_hand_worked_optimal_trees(a, budget, depth, parents, value):
    tpl, v = optimal_tree(a, budget, depth)
    assert tpl.parents == parents
    assert v == pytest.approx(value)
    assert expected_tokens(tpl, a) == pytest.approx(value)


def all_trees(n: int):
    """Every tree shape with n non-root nodes, as parent tuples in DFS order (brute force)."""
    for parents in itertools.product(*[range(i) for i in range(1, n + 1)]):
        yield Template((-1,) + parents)


@pytest.mark.parametrize("a", [(0.7, 0.2, 0.05), (0.4, 0.3, 0.2), (0.55, 0.25, 0.1)])
def test_dp_matches_brute_force(a):
    for budget in range(1, 6):
        for depth in (1, 2, 3, 5):
            best = max(expected_tokens(t, a) for t in all_trees(budget) if t.depth() <= depth)
            tpl, v = optimal_tree(a, budget, depth)
            assert v == pytest.approx(best)
            assert tpl.size <= budget and tpl.depth() <= depth


def test_profile_json_caches_the_vector(tmp_path):
    profile = tmp_path / "profile.json"
    params = SamplingParams(temperature=0.7)
    profile.write_text(json.dumps({"other": 1, PROFILE_KEY: {sampling_key(params): [0.5, 0.2]}}))

    class Fake:  # never run: the vector comes from the profile
        target = draft = None

    assert acceptance_vector(Fake(), [1, 2, 3], params, str(profile)) == (0.5, 0.2)
    assert json.loads(profile.read_text())["other"] == 1
