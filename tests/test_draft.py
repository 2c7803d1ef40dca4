"""Tree growth: calibrated scores, n-gram branches, ancestor-closed kept sets, no engine→methods import."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import torch

from specexec_cli.core import draftstep, kvcache
from specexec_cli.core.calibrate import N_BINS, Calibration, chain_feature, draft_feature, observe_pass
from specexec_cli.core.draft import DraftContext, Scoring, TreeShape, grow_tree
from specexec_cli.core.ngram import NgramIndex
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.core.tree import Tree, top_budget
from tests.test_transfers import tiny_llama

ROOT = Path(__file__).resolve().parents[1]


def test_engine_does_not_import_methods():
    """The dependency points one way: methods/ imports engine, never the reverse (no cycle)."""
    tree = ast.parse((ROOT / "specexec_cli" / "core" / "engine.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert not [x for x in names if "methods" in x]


def test_draft_feature_bins_and_flags():
    lp = torch.tensor([-0.001, -0.3, -20.0])
    assert draft_feature(lp, torch.zeros(3, dtype=torch.long)).tolist() == [
        0,
        3,
        N_BINS - 1,
    ]  # -0.3 lies in (-0.5, -0.25]
    assert draft_feature(lp[:1], torch.tensor([2])).tolist() == [2 * N_BINS]


def test_observe_pass_counts_children_of_the_accepted_path():
    """Children of the root and of accepted nodes are tested against the target's token there."""
    tree = Tree.new(5)
    a, b = tree.add(torch.tensor([0, 0]), torch.tensor([7, 8]), torch.tensor([-0.1, -2.0]), torch.tensor([0, 1]))
    tree.add(
        torch.tensor([int(a), int(a), int(b)]), torch.tensor([9, 3, 4]), torch.full((3,), -1.0), torch.tensor([2, 3, 4])
    )
    cal = Calibration()
    observe_pass(cal, tree, path_nodes=[int(a)], tokens=[7, 3])  # root → 7 accepted, then the target said 3
    assert cal.tests[:5].tolist() == [1, 1, 1, 1, 0]  # node b's child (feature 4) was never reached
    assert cal.hits[:5].tolist() == [1, 0, 0, 1, 0]


def test_calibration_moves_towards_observed_rate():
    cal = Calibration()
    before = float(cal.log_accept()[0].exp())
    cal.observe(torch.zeros(200, dtype=torch.long), torch.zeros(200, dtype=torch.bool))
    assert float(cal.log_accept()[0].exp()) < min(before, 0.05)


def grow(scoring, shape, ctx_ids):
    draft = tiny_llama(64, 3)
    cache = kvcache.new_cache()
    ctx = DraftContext(n_cached=0, pending=ctx_ids, root_pos=len(ctx_ids) - 1)
    return grow_tree(draft, cache, ctx, shape, SamplingParams(), scoring), cache


def test_ngram_chain_enters_the_tree_beside_the_drafts_children():
    """max_branch=1: without n-grams each node has one child; the lookup adds the repeated continuation."""
    ids = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 11, 12, 13]  # ...11 12 13 → 14 15 16 ... before
    shape = TreeShape(budget=24, max_depth=8, max_beams=4, max_branch=1)
    scoring = Scoring(cal=Calibration(), ngram=NgramIndex(ids), committed=ids)
    tree, cache = grow(scoring, shape, ids)
    kept = set(top_budget(tree.logp, shape.budget).tolist())
    node, path = 0, []
    for tok in [14, 15, 16, 17]:
        hit = ((tree.parents == node) & (tree.tokens == tok)).nonzero()
        assert hit.numel() == 1
        node = int(hit[0, 0])
        path.append(node)
    assert set(path) <= kept
    assert int(tree.feat[path[0]]) // N_BINS == 3 or int(tree.feat[path[0]]) == chain_feature(3, 1)
    # the cache holds prefix + every run node, in slot order
    assert kvcache.cache_len(cache) == len(ids) - 1 + tree.n_slots


def test_kept_set_is_a_tree_with_calibrated_ngram_scores():
    ids = [3, 4, 5, 6, 3, 4, 5, 7, 3, 4]
    for budget in (5, 17, 60):
        shape = TreeShape(budget=budget, max_depth=12, max_beams=6, max_branch=4)
        tree, _ = grow(Scoring(cal=Calibration(), ngram=NgramIndex(ids), committed=ids), shape, ids)
        kept = top_budget(tree.logp, budget)
        assert kept.numel() == min(budget, tree.size - 1)
        ok = set(kept.tolist()) | {0}
        assert all(int(tree.parents[n]) in ok for n in kept.tolist())
        assert bool((tree.logp[kept] <= tree.logp[tree.parents[kept]]).all())


def test_nodes_no_child_of_which_could_be_kept_are_not_run(monkeypatch):
    """step_batch leaves unrun the nodes whose best possible child cannot beat the budget-th score: the
    tree grown is the one every top node's expansion grows (same nodes, same kept set and scores), in
    fewer draft rows."""
    import specexec_cli.core.draft as draft_mod

    ids = [3, 4, 5, 6, 3, 4, 5, 7, 3, 4]
    every = draft_mod.step_batch
    rows: list[int] = []
    forward = draftstep.run  # every draft forward of grow_tree

    def counted(model, cache, tokens, *args, **kwargs):
        rows.append(int(tokens.numel()))
        return forward(model, cache, tokens, *args, **kwargs)

    monkeypatch.setattr(draftstep, "run", counted)
    saved = 0
    for budget, calibrated in ((4, False), (4, True), (8, True), (17, False)):
        shape = TreeShape(budget=budget, max_depth=10, max_beams=8, max_branch=4)
        grown = {}
        for mode in ("all", "useful"):
            step = (lambda tree, shape, gain=0.0: every(tree, shape, float("inf"))) if mode == "all" else every
            monkeypatch.setattr(draft_mod, "step_batch", step)
            scoring = Scoring(cal=Calibration(), ngram=NgramIndex(ids), committed=ids) if calibrated else None
            rows.clear()
            tree, _ = grow(scoring, shape, ids)
            grown[mode] = (tree, sum(rows))
        (a, rows_all), (b, rows_useful) = grown["all"], grown["useful"]
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        kept = top_budget(a.logp, budget)
        assert torch.equal(kept, top_budget(b.logp, budget)) and torch.equal(a.logp[kept], b.logp[kept])
        assert rows_useful <= rows_all
        saved += rows_all - rows_useful
    assert saved > 0


def test_min_prob_stops_expanding_the_nodes_the_draft_is_unsure_of():
    """With min_prob, no node scoring below log(min_prob) is expanded (its children are not grown): every
    node whose children are in the tree scores at least that; the same tree without it expands more."""
    ids = [3, 4, 5, 6, 7, 8]
    for p in (0.001, 0.008):  # a random 64-token draft: children near 1/64, grandchildren near 1/4096
        full, _ = grow(None, TreeShape(budget=40, max_depth=12, max_beams=4, max_branch=4), ids)
        cut, _ = grow(None, TreeShape(budget=40, max_depth=12, max_beams=4, max_branch=4, min_prob=p), ids)
        parents = {int(x) for x in cut.parents[1 : cut.size].tolist()} - {0}  # expanded nodes (the root always is)
        assert parents and all(float(cut.logp[n]) > math.log(p) for n in parents)
        assert cut.size < full.size
