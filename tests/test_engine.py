"""Engine correctness: greedy equality, self-draft depth, cache invariants, exact stop conditions.

Sampled distributions are tested with power in test_distribution.py."""

from __future__ import annotations

import pytest
import torch

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.session.loading import LoadOptions, load_models

PROMPTS = ["def f(x):\n  return", "def add(a, b):\n    return a", "for i in range(10):\n"]  # >= 48 tokens, no EOS
EOS_PROMPT = "class a:\n  def b(self"  # the target's greedy continuation ends with EOS as its 16th token


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
    assert len(ref) == 48  # the whole length is compared (no early EOS)
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
    got, events, _ = run(
        self_models, ids, budget=6, max_depth=6, max_branch=1, max_new_tokens=43, extra={"scores": "draft"}
    )
    passes = [ev for ev in events if ev.pass_index > 0]
    assert all(len(ev.tokens) == 7 for ev in passes[:-1] if ev.finish is None)
    assert got == hf_greedy(self_models, ids, 43)[: len(got)]


def test_self_draft_tree_accepts_greedy_path_as_deep_as_tree_holds_it(self_models, monkeypatch):
    """Each pass emits exactly (depth of the target's greedy path inside the tree) + 1 tokens."""
    import specexec_cli.core.engine as engine

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


def fresh_keys(model, ids):
    """Per-layer K of a fresh causal pass over `ids`: what a correctly compacted cache must hold."""
    from specexec_cli.core import kvcache
    from specexec_cli.core.tree import causal_mask

    cache = kvcache.new_cache()
    kvcache.forward(model, cache, torch.tensor(ids), torch.arange(len(ids)), causal_mask(0, len(ids), torch.float32))
    return valid_keys(cache)


def valid_keys(cache):
    """Per-layer K rows [0, length) (slab caches keep spare rows past the length)."""
    return [layer.keys[:, :, : layer.get_seq_length()] for layer in cache.layers]


@pytest.mark.parametrize("pair", ["models", "self_models"])
def test_cache_invariants_after_each_step(request, pair):
    """After every pass: lengths as documented AND the kept K rows equal a fresh pass over the kept ids
    (so compaction kept the right rows in the right order); passes really discard rejected nodes."""
    models = request.getfixturevalue(pair)
    ids = models.tokenizer(PROMPTS[1])["input_ids"]
    cfg = GenerationConfig(shape=TreeShape(32, 8), max_new_tokens=40)
    state = DecodeState()
    trimmed = multi = 0
    for ev in generate(models, state, ids, cfg):
        assert state.target_cache.get_seq_length() == state.target_len == len(state.ids) - 1
        assert state.draft_cache.get_seq_length() == state.draft_len < len(state.ids)
        for model, cache, n in (
            (models.target, state.target_cache, state.target_len),
            (models.draft, state.draft_cache, state.draft_len),
        ):
            for got, want in zip(valid_keys(cache), fresh_keys(model, state.ids[:n]), strict=True):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        trimmed += ev.tree_size > ev.accepted
        multi += ev.accepted >= 2
    assert len(state.ids) == len(ids) + 40 and trimmed >= 5 and multi >= (5 if pair == "self_models" else 0), (
        trimmed,
        multi,
    )


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


ALL_METHODS = ["ar", "specexec", "chain", "specinfer", "sequoia", "staged"]


@pytest.mark.parametrize("method", ALL_METHODS)
def test_max_new_tokens_and_eos_stop(self_models, method):
    """Exactly max_new_tokens when no EOS comes (even when a pass could emit more), and generation
    stops exactly at the first EOS, inside an accepted run of a self-draft (finish reasons exact)."""
    from specexec_cli.core.methods.common import with_settings

    def gen(prompt, n):
        ids = self_models.tokenizer(prompt)["input_ids"]
        cfg = with_settings(GenerationConfig(method=method, shape=TreeShape(16, 6), max_new_tokens=n), gamma=5)
        events = list(generate(self_models, DecodeState(), ids, cfg))
        return [t for ev in events for t in ev.tokens], events, hf_greedy(self_models, ids, n)

    for n in (1, 2, 9):
        got, events, ref = gen(PROMPTS[1], n)
        assert got == ref and len(got) == n, (n, got)
        assert events[-1].finish == "length" and all(ev.finish is None for ev in events[:-1])
        assert events[-1].new_tokens == n
    got, events, ref = gen(EOS_PROMPT, 40)
    eos = sorted(self_models.eos_ids)
    assert ref[-1] in eos and len(ref) == 16  # HF stops at the EOS too
    assert got == ref, (got, ref)
    assert events[-1].finish == "eos" and events[-1].tokens[-1] in eos
    if method != "ar":
        assert events[-1].accepted >= 1  # the EOS was a draft node the walk accepted (its subtree dropped)
    # a chat goes on after an EOS: the caches must hold exactly the committed tokens but the last
    st = DecodeState()
    cfg = with_settings(GenerationConfig(method=method, shape=TreeShape(16, 6), max_new_tokens=40), gamma=5)
    list(generate(self_models, st, self_models.tokenizer(EOS_PROMPT)["input_ids"], cfg))
    assert st.target_len == st.target_cache.get_seq_length() == len(st.ids) - 1
    assert st.draft_cache.get_seq_length() == st.draft_len < len(st.ids)


@pytest.mark.parametrize(
    "sampling", [SamplingParams(0.8), SamplingParams(0.7, top_k=20, top_p=0.9)], ids=["T0.8", "T0.7-topk-topp"]
)
def test_sampled_text_does_not_depend_on_draft_or_budget(models, sampling):
    """At T > 0 `ar` and `specexec` draw each token by the exponential race with position-keyed
    noise, so a seed gives the same ids whatever the tree: every budget, scoring and draft equals
    the target alone; a different seed gives different text."""
    ids = models.tokenizer(PROMPTS[1])["input_ids"]
    ref, _, _ = run(models, ids, method="ar", sampling=sampling, seed=5, max_new_tokens=40)
    accepted = 0
    for budget, scores in [(4, None), (32, None), (32, "draft"), (200, "calibrated")]:
        extra = {"scores": scores} if scores else {}
        got, events, _ = run(models, ids, budget=budget, sampling=sampling, seed=5, max_new_tokens=40, extra=extra)
        assert got == ref, (budget, scores)
        accepted += sum(ev.accepted for ev in events)
    assert accepted >= 10  # the trees really carried tokens
    other, _, _ = run(models, ids, method="ar", sampling=sampling, seed=6, max_new_tokens=40)
    assert other != ref


def _shared_prompt(shared_pair, line: int = 2) -> str:
    import json

    return json.loads((shared_pair[0].parents[1] / "bench" / "prompts.jsonl").read_text().splitlines()[line])["prompt"]


def test_shared_pair_sampled_specexec_equals_ar_and_moves_no_logits_row(shared_pair, tmp_path, monkeypatch):
    """T = 0.7 on the trained pair: specexec's ids equal `ar`'s for the seed at every budget and with
    the self-draft (the race noise is a function of the position, computed where each model runs),
    and a sampled pass copies less than one fp32 vocabulary row more than a greedy one."""
    from specexec_cli.core.stats import RunStats

    m = load_models(LoadOptions(str(shared_pair[0]), str(shared_pair[1]), dtype="fp32", device="cpu"))
    ids = m.tokenizer(_shared_prompt(shared_pair))["input_ids"][-200:]
    hot = SamplingParams(0.7)
    ref, _, _ = run(m, ids, method="ar", sampling=hot, seed=11, max_new_tokens=40)
    accepted = 0
    for budget in (4, 32, 128):
        got, events, _ = run(m, ids, budget=budget, max_depth=16, sampling=hot, seed=11, max_new_tokens=40)
        assert got == ref, budget
        accepted += sum(ev.accepted for ev in events)
    assert accepted >= 10
    per_pass = {}
    for t in (0.0, 0.7):
        stats = RunStats()
        for ev in run(m, ids, budget=32, max_depth=16, sampling=SamplingParams(t), seed=11, max_new_tokens=40)[1]:
            stats.add(ev)
        per_pass[t] = stats.to_json()["host_transfer_bytes_per_pass"]
    vocab = m.target.config.vocab_size
    assert per_pass[0.7] - per_pass[0.0] < vocab * 4, per_pass
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))
    sd = load_models(LoadOptions(str(shared_pair[0]), "self", dtype="fp32", device="cpu", offload="disk", max_ram=0))
    sd_ref, _, _ = run(sd, ids, method="ar", sampling=hot, seed=11, max_new_tokens=40)
    got, events, _ = run(sd, ids, budget=32, max_depth=16, sampling=hot, seed=11, max_new_tokens=40)
    assert got == sd_ref and sum(ev.accepted for ev in events) >= 5
