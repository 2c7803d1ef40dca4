"""Engine correctness: greedy equality, self-draft depth, distribution, cache invariants."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specexec_cli.draft import TreeShape
from specexec_cli.engine import DecodeState, GenerationConfig, generate
from specexec_cli.loading import LoadOptions, load_models
from specexec_cli.sampling import SamplingParams, process_logits

PROMPTS = ["def f(x):\n  return", "class a:\n  def b(self", "x = (1, 2"]


@pytest.fixture(scope="module")
def models(tiny_pair):
    target, draft = tiny_pair
    return load_models(LoadOptions(str(target), str(draft), dtype="fp32", device="cpu"))


@pytest.fixture(scope="module")
def self_models(tiny_pair):
    target, _ = tiny_pair
    return load_models(LoadOptions(str(target), str(target), dtype="fp32", device="cpu"))


def run(m, ids, **kw):
    shape = TreeShape(kw.pop("budget", 64), kw.pop("max_depth", 32), kw.pop("max_beams", 32), kw.pop("max_branch", 32))
    cfg = GenerationConfig(shape=shape, **kw)
    state = DecodeState()
    events = list(generate(m, state, ids, cfg))
    return [t for ev in events for t in ev.tokens], events, state


def hf_greedy(m, ids, n):
    out = m.target.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("budget", [1, 4, 64, 512])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_target_generate(models, budget, prompt):
    ids = models.tokenizer(prompt)["input_ids"]
    ref = hf_greedy(models, ids, 48)
    got, events, _ = run(models, ids, budget=budget, max_new_tokens=48)
    assert got == ref
    assert all(ev.tree_size <= budget for ev in events)


def test_greedy_with_unrelated_draft(tiny_pair, random_draft):
    m = load_models(LoadOptions(str(tiny_pair[0]), str(random_draft), dtype="fp32", device="cpu"))
    ids = m.tokenizer(PROMPTS[0])["input_ids"]
    got, _, _ = run(m, ids, budget=16, max_new_tokens=40)
    assert got == hf_greedy(m, ids, 40)


def test_self_draft_chain_accepts_every_token(self_models):
    """draft == target and a chain-shaped tree: each pass emits the whole chain plus the bonus.

    Plain draft scores: n-gram branches would add children beside the draft's max_branch=1 child."""
    ids = self_models.tokenizer(PROMPTS[1])["input_ids"]
    got, events, _ = run(self_models, ids, budget=6, max_depth=6, max_branch=1, max_new_tokens=43,
                         extra={"scores": "draft"})
    passes = [ev for ev in events if ev.pass_index > 0]
    assert all(len(ev.tokens) == 7 for ev in passes[:-1] if ev.finish is None)
    assert got == hf_greedy(self_models, ids, 43)[: len(got)]


def test_self_draft_tree_accepts_greedy_path_as_deep_as_tree_holds_it(self_models, monkeypatch):
    """Each pass emits exactly (depth of the target's greedy path inside the tree) + 1 tokens."""
    import specexec_cli.engine as engine

    trees = []
    real = engine.accept_tree
    monkeypatch.setattr(engine, "accept_tree", lambda vt, *a, **k: trees.append(vt) or real(vt, *a, **k))
    ids = self_models.tokenizer(PROMPTS[0])["input_ids"]
    got, events, _ = run(self_models, ids, budget=64, max_depth=16, max_new_tokens=60)
    ref = hf_greedy(self_models, ids, 60)
    assert got == ref[: len(got)]
    pos = 1  # the prefill emitted ref[0]
    for vt, ev in zip(trees, [ev for ev in events if ev.pass_index > 0]):
        node, depth = 0, 0
        while pos + depth < len(ref):
            hit = ((vt.parents == node) & (vt.tokens == ref[pos + depth])).nonzero()
            if hit.numel() == 0:
                break
            node, depth = int(hit[0, 0]), depth + 1
        assert len(ev.tokens) == min(depth + 1, len(ref) - pos)
        pos += len(ev.tokens)
    assert sum(len(ev.tokens) for ev in events[1:]) / len(trees) >= 2.5


def test_cache_invariants_after_each_step(models):
    ids = models.tokenizer(PROMPTS[2])["input_ids"]
    cfg = GenerationConfig(shape=TreeShape(32, 16), max_new_tokens=30)
    state = DecodeState()
    for _ in generate(models, state, ids, cfg):
        assert state.target_cache.get_seq_length() == state.target_len == len(state.ids) - 1
        assert state.draft_cache.get_seq_length() == state.draft_len < len(state.ids)


def test_multi_turn_prefills_only_new_tokens(models):
    ids = models.tokenizer(PROMPTS[0])["input_ids"]
    cfg = GenerationConfig(shape=TreeShape(16, 8), max_new_tokens=10)
    state = DecodeState()
    list(generate(models, state, ids, cfg))
    more = models.tokenizer(" ok")["input_ids"]
    events = list(generate(models, state, more, cfg))
    assert events[0].prompt_tokens == len(more) + 1  # the new turn plus the pending last token
    full = list(state.ids)
    ref = hf_greedy(models, full[: len(ids) + 10 + len(more)], 10)
    assert full[len(ids) + 10 + len(more) :] == ref


def target_marginal_second_token(m, ids, params):
    """Exact P(t2 | t1 != EOS) = sum_{t1 != EOS} p(t1) p(t2 | t1) / (1 - p(EOS)), processed dists.

    Generation stops after an EOS first token, so those runs have no second token.
    """
    with torch.no_grad():
        p1 = process_logits(m.target(torch.tensor([ids])).logits[0, -1], params)
        v = p1.numel()
        batch = torch.cat([torch.tensor([ids] * v), torch.arange(v)[:, None]], dim=1)
        p2 = process_logits(m.target(batch).logits[:, -1], params)
    p1[sorted(m.eos_ids)] = 0.0
    return (p1[:, None] * p2).sum(0) / p1.sum()


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=8, top_p=0.9)])
def test_sampled_distribution_matches_target(models, params):
    """Second emitted token (the first from a speculative pass): chi-square vs the exact marginal."""
    ids = models.tokenizer(PROMPTS[0])["input_ids"]
    expected = target_marginal_second_token(models, ids, params)
    n = 600
    counts = Counter()
    for seed in range(n):
        got, _, _ = run(models, ids, budget=16, max_depth=4, max_new_tokens=2, seed=seed,
                        sampling=params)
        if len(got) == 2:
            counts[got[1]] += 1
    obs = torch.tensor([counts.get(i, 0) for i in range(expected.numel())], dtype=torch.float64)
    exp = expected.double() * obs.sum()
    big = exp >= 5
    obs_b = torch.cat([obs[big], obs[~big].sum()[None]])
    exp_b = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp_b > 0
    assert obs[exp == 0].sum() == 0, "sampled a token the target gives zero probability"
    stat = chisquare(obs_b[keep].numpy(), exp_b[keep].numpy() * obs_b[keep].sum().item() / exp_b[keep].sum().item())
    assert stat.pvalue > 1e-3, stat


def test_max_new_tokens_and_eos_stop(models):
    ids = models.tokenizer(PROMPTS[1])["input_ids"]
    got, events, _ = run(models, ids, budget=64, max_new_tokens=7)
    assert len(got) <= 7
    assert events[-1].finish in ("length", "eos")
