"""Deep acceptance in every method, and "each draft forward computes only new nodes".

Fake table LMs (tests/fakes.py) make the draft's agreement with the target a dial: a self-draft
(draft table = target table) agrees everywhere, so at T = 0 every pass of a chain-shaped tree must
emit exactly depth + 1 tokens; a low-noise draft agrees mostly. The fakes also check every mask
and position, so a pass that emits a long, correct run proves the tree mask, positions and cache
compaction right at depth. γ and the SpecInfer branching are varied (not only the budget) and the
tokens per pass must follow them. The draft's forwards are counted token by token.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import specexec_cli.core.engine as engine
import specexec_cli.core.methods.staged as staged
import specexec_cli.core.methods.static_tree as static_tree
from specexec_cli.core.calibrate import N_DRAFT
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig, prefill_pass, run_alone
from specexec_cli.core.methods import METHODS, generate
from specexec_cli.core.methods.common import with_settings
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.core.state import add_prompt
from tests.fakes import fake_models, greedy_reference, noisy, random_table


def prefill(m, st, new_ids, cfg, gen) -> None:
    """Prefill `new_ids` on top of `st` as generate's first pass does (the first token committed)."""
    add_prompt(m, st, new_ids)
    run_alone(m.target, prefill_pass(m, st, cfg, gen))


V = 8
TABLE = random_table(V, seed=3, scale=2.0)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
N_NEW = 40


def run(m, method, shape, **opts):
    cfg = with_settings(GenerationConfig(method=method, shape=shape, max_new_tokens=N_NEW), **opts)
    events = list(generate(m, DecodeState(), PROMPT, cfg))
    return [t for ev in events for t in ev.tokens], [len(ev.tokens) for ev in events[1:]]


@pytest.mark.parametrize("gamma", [2, 4, 6])
def test_self_draft_chain_emits_gamma_plus_one_per_pass(gamma):
    got, per_pass = run(fake_models(TABLE, TABLE), "chain", TreeShape(4, 32), gamma=gamma)
    assert got == greedy_reference(TABLE, PROMPT, N_NEW)
    assert per_pass[:-1] == [gamma + 1] * (len(per_pass) - 1)  # the last pass is cut by max_new_tokens
    assert sum(per_pass) == N_NEW - 1 and 1 <= per_pass[-1] <= gamma + 1


@pytest.mark.parametrize("branching", [(3, 1, 1), (2, 2, 2, 1), (1, 1, 1, 1, 1, 1)])
def test_self_draft_specinfer_accepts_full_depth(branching):
    got, per_pass = run(fake_models(TABLE, TABLE), "specinfer", TreeShape(4, 32), branching=branching)
    assert got == greedy_reference(TABLE, PROMPT, N_NEW)
    assert per_pass[:-1] == [len(branching) + 1] * (len(per_pass) - 1)


@pytest.mark.parametrize("depth", [3, 7])
def test_self_draft_specexec_and_staged_chain_trees(depth):
    """max_branch = 1 makes the SpecExec tree a chain of `depth` nodes: every pass emits depth + 1.

    Plain draft scores: specexec's n-gram branches would add children beside the draft's one."""
    for method in ("specexec", "staged"):
        got, per_pass = run(fake_models(TABLE, TABLE), method, TreeShape(depth, depth, max_branch=1), scores="draft")
        assert got == greedy_reference(TABLE, PROMPT, N_NEW), method
        assert per_pass[:-1] == [depth + 1] * (len(per_pass) - 1), (method, per_pass)


def test_self_draft_sequoia_tree_is_deep():
    got, per_pass = run(fake_models(TABLE, TABLE), "sequoia", TreeShape(12, 6))
    assert got == greedy_reference(TABLE, PROMPT, N_NEW)
    assert min(per_pass[:-1]) >= 3 and max(per_pass) == 7, per_pass


@pytest.mark.parametrize(
    "method,shape,opts",
    [
        ("specexec", TreeShape(32, 8), {}),
        ("staged", TreeShape(32, 8), {}),
        ("chain", TreeShape(4, 8), dict(gamma=5)),
        ("specinfer", TreeShape(32, 8), dict(branching=(2, 2, 1, 1, 1))),
        ("sequoia", TreeShape(32, 8), {}),
    ],
)
def test_low_noise_draft_accepts_several_tokens_per_pass(method, shape, opts):
    m = fake_models(TABLE, noisy(TABLE, 0.4, seed=1))
    got, per_pass = run(m, method, shape, **opts)
    assert got == greedy_reference(TABLE, PROMPT, N_NEW)
    assert max(per_pass) >= 4 and sum(per_pass) / len(per_pass) >= 2.5, per_pass


def test_budget_gamma_and_branching_change_the_run():
    """Different γ / branching / budget give different pass structures (not the same run relabelled)."""
    m = fake_models(TABLE, noisy(TABLE, 0.4, seed=1))
    chain = {g: run(m, "chain", TreeShape(4, 16), gamma=g)[1] for g in (1, 3)}
    spec = {b: run(m, "specinfer", TreeShape(16, 16), branching=b)[1] for b in ((1,), (2, 2, 2))}
    budget = {b: run(m, "specexec", TreeShape(b, 16))[1] for b in (2, 24)}
    for runs in (chain, spec, budget):
        a, b = runs.values()
        assert len(a) > len(b), runs  # the bigger tree needs fewer passes


# ---------------------------------------------------------------- draft tokens computed per step


def capture_trees(monkeypatch):
    """Record the Tree every growth function returns (the methods call them by module-global name)."""
    trees = []

    def wrap(fn, first_only=False):
        def inner(*a, **k):
            out = fn(*a, **k)
            trees.append(out[0] if first_only else out)
            return out

        return inner

    monkeypatch.setattr(engine, "grow_tree", wrap(engine.grow_tree))
    monkeypatch.setattr(static_tree, "grow_static", wrap(static_tree.grow_static, first_only=True))
    monkeypatch.setattr(staged, "grow_staged", wrap(staged.grow_staged))
    return trees


@pytest.mark.parametrize(
    "method,shape,opts,temperature",
    [
        ("specexec", TreeShape(24, 8, max_beams=4), {}, 0.0),
        ("specexec", TreeShape(24, 8, max_beams=4), {}, 0.8),
        ("chain", TreeShape(4, 8), dict(gamma=4), 0.8),
        ("specinfer", TreeShape(16, 8), dict(branching=(2, 2, 1)), 0.0),
        ("sequoia", TreeShape(16, 8), {}, 0.8),
    ],
)
def test_draft_computes_each_node_once(monkeypatch, method, shape, opts, temperature):
    """Per step: draft tokens computed == committed tokens not yet cached + tree nodes run (no re-runs).

    Committed tokens the draft has not cached are at most 2 (an unrun accepted leaf + the bonus), so
    a step never recomputes the prefix; each tree node is run at most once (distinct slots)."""
    trees = capture_trees(monkeypatch)
    m = fake_models(TABLE, noisy(TABLE, 0.4, seed=1))
    cfg = with_settings(
        GenerationConfig(method=method, shape=shape, max_new_tokens=N_NEW, sampling=SamplingParams(temperature)), **opts
    )
    st, gen = DecodeState(), torch.Generator().manual_seed(0)
    prefill(m, st, PROMPT, cfg, gen)
    if method == "sequoia":  # its one-time calibration forward over the context is not a tree step
        from specexec_cli.core.methods.sequoia import acceptance_vector

        acceptance_vector(m, st.ids, cfg.sampling, None)
    step = METHODS[method]
    pending_sizes = []
    while len(st.ids) < len(PROMPT) + N_NEW:
        pending = len(st.ids) - st.draft_len
        before, n_trees = m.draft.tokens_run, len(trees)
        step(m, st, cfg, gen, len(PROMPT) + N_NEW - len(st.ids))
        if len(trees) == n_trees:  # limit 1: a plain target step, the draft must not run at all
            assert m.draft.tokens_run == before
            continue
        tree = trees[-1]
        ran = tree.slot[tree.slot >= 0]
        assert ran.numel() == tree.n_slots and torch.equal(ran.sort().values, torch.arange(tree.n_slots))
        has_kids = torch.zeros(tree.size, dtype=torch.bool)
        has_kids[tree.parents[1:]] = True
        # only n-gram chain nodes (specexec's prompt-lookup branches) may hang below a node not yet run
        below_unrun = (tree.parents >= 0) & (tree.slot[tree.parents.clamp(min=0)] < 0)
        assert bool((tree.feat[below_unrun] >= N_DRAFT).all()), "a node was expanded without being run"
        now = m.draft.tokens_run - before
        assert now == pending + tree.n_slots - 1, (now, pending, tree.n_slots)  # root counted in pending
        pending_sizes.append(pending)
    assert max(pending_sizes) <= 2, Counter(pending_sizes)
    assert sum(p == 2 for p in pending_sizes) > 0 or method == "specexec"  # accepted leaves do occur


def test_staged_never_reruns_committed_tokens(monkeypatch):
    """Staged: the n-gram proposals ride along, so count only that no committed token is re-run."""
    trees = capture_trees(monkeypatch)
    m = fake_models(TABLE, noisy(TABLE, 0.4, seed=1))
    cfg = GenerationConfig(method="staged", shape=TreeShape(24, 8), max_new_tokens=N_NEW)
    st, gen = DecodeState(), torch.Generator().manual_seed(0)
    prefill(m, st, PROMPT, cfg, gen)
    while len(st.ids) < len(PROMPT) + N_NEW:
        pending = len(st.ids) - st.draft_len
        assert pending <= 2
        before = m.draft.tokens_run
        METHODS["staged"](m, st, cfg, gen, len(PROMPT) + N_NEW - len(st.ids))
        tree = trees[-1]
        ran = tree.slot[tree.slot >= 0]
        assert torch.equal(ran.sort().values, torch.arange(tree.n_slots))
        assert m.draft.tokens_run - before >= pending + tree.n_slots - 1
