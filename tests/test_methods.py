"""Losslessness of the extra methods (chain, specinfer, sequoia, staged) on tiny CPU models.

- Greedy: ids equal HF `generate(do_sample=False)` of the target, at two budgets.
- Sampled distributions through the whole engine, with power: test_distribution.py.
- Pure functions with many samples: the multi-step residual rule (several siblings) reproduces p,
  on the host (Sequoia's measurement) and batched on the device with hash-noise children, and the
  tree walk's second token given the first follows the target's row for that first token.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.core.methods.common import choose_child, sample_children, with_settings
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.session.loading import LoadOptions, load_models

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
METHODS = ["chain", "specinfer", "sequoia", "staged"]
PROMPT = "def add(a, b):\n    return a"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the box is shared; tiny models gain nothing from threads
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_models(LoadOptions(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu"))


def config(method, budget, temperature=0.0, max_new=40, depth=16, **opts):
    cfg = GenerationConfig(
        method=method,
        shape=TreeShape(budget, depth),
        max_new_tokens=max_new,
        sampling=SamplingParams(temperature=temperature),
    )
    return with_settings(cfg, **opts)


def pooled_chisquare(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of observed counts vs probs; bins with expected < min_expected pooled into one."""
    n = counts.sum()
    exp = probs.double() * n
    small = exp < min_expected
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    if exp[-1] < min_expected:  # fold a still-small pool into the smallest kept bin
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        j = int(exp.argmin())
        obs[j] += counts[small].sum()
        exp[j] += probs[small].double().sum() * n
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [4, 24])
def test_greedy_equals_hf_generate(pair, method, budget):
    ids = list(pair.tokenizer(PROMPT)["input_ids"])
    ref = pair.target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=30, pad_token_id=0)
    ref = ref[0, len(ids) :].tolist()
    cfg = config(method, budget, max_new=30, gamma=3, branching=(3, 2, 1))
    out = [t for ev in generate(pair, DecodeState(), ids, cfg) for t in ev.tokens]
    assert out == ref


def synthetic_tree(g, v=6, k=3):
    """Root with k children sampled from q0, each with k children from its own q: (vt, logits, qrows)."""
    from specexec_cli.core.tree import VerifyTree

    q = {i: torch.softmax(2 * torch.randn(v, generator=g), 0) for i in range(k + 1)}
    tokens, parents = [0], [-1]
    for x in sample_children(q[0], k, g):
        tokens.append(x)
        parents.append(0)
    for c in range(1, k + 1):
        for x in sample_children(q[c], k, g):
            tokens.append(x)
            parents.append(c)
    depth = [0] + [1] * k + [2] * (len(tokens) - k - 1)
    vt = VerifyTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth), torch.arange(len(tokens)))
    return vt, q


def test_device_rule_second_token_exact():
    """The batched device rule + walk on synthetic trees: token 2 | token 1 = x follows the target's
    row for x (each trial has its own noise key, as each generate call does)."""
    from specexec_cli.core.methods.common import accept_static, child_table
    from specexec_cli.core.sampling import PositionNoise

    g = torch.Generator().manual_seed(3)
    v, params = 6, SamplingParams(temperature=1.0)
    root_logits = 2 * torch.randn(v, generator=g)
    next_logits = 2 * torch.randn(v, v, generator=g)  # row x: the target after token x
    counts = torch.zeros(v, v, dtype=torch.long)
    for trial in range(4000):
        vt, q = synthetic_tree(g, v)
        rows = torch.stack([root_logits] + [next_logits[int(t)] for t in vt.tokens[1:]])  # depth-2 rows unused
        inner, kids = child_table(vt)
        qs = torch.stack([q[int(i)] for i in inner])
        acc = accept_static(vt, rows, params, PositionNoise(trial), 10, (vt.depth, inner, kids), qs, frozenset(), 2)
        if len(acc.tokens) == 2:
            counts[acc.tokens[0], acc.tokens[1]] += 1
    x = int(counts.sum(1).argmax())
    assert counts[x].sum() > 300
    assert pooled_chisquare(counts[x], torch.softmax(next_logits[x], 0)) > 1e-3


@pytest.mark.parametrize("k", [1, 2, 4])
def test_device_rule_with_hashed_children_is_exact(k):
    """Gumbel-top-k children (CHILDREN stream) + the batched residual rule (ACCEPT, RESIDUAL streams),
    one node per position over 20000 positions: the emitted token follows p (chi-square)."""
    from specexec_cli.core.methods.common import static_choices
    from specexec_cli.core.sampling import CHILDREN, PositionNoise, process_logits

    g = torch.Generator().manual_seed(10 + k)
    v, n, params = 6, 20000, SamplingParams(temperature=1.0)
    p_logits = 2 * torch.randn(v, generator=g)
    q = process_logits(2 * torch.randn(v, generator=g), params)
    noise = PositionNoise(k)
    kids = torch.topk(q / noise.block(0, n, v, stream=CHILDREN), k, dim=-1).indices  # (n, k) w/o replacement
    pos = torch.arange(n)  # node r at "depth" r: every node has positions (noise) of its own
    tokens = static_choices(p_logits.expand(n, v), params, noise, 0, pos, n - 1, pos, kids, q.expand(n, v))
    counts = torch.bincount(tokens, minlength=v)
    assert pooled_chisquare(counts, process_logits(p_logits, params)) > 1e-3
    first = torch.bincount(kids[:, 0], minlength=v)  # the first child is a draw of q
    assert pooled_chisquare(first, q) > 1e-3


@pytest.mark.parametrize("k", [1, 2, 4])
def test_multi_step_rule_is_exact(k):
    g = torch.Generator().manual_seed(k)
    p = torch.softmax(2 * torch.randn(6, generator=g), 0)
    q = torch.softmax(2 * torch.randn(6, generator=g), 0)
    counts = torch.zeros(6, dtype=torch.long)
    for _ in range(20000):
        kids = sample_children(q, k, g)
        pick, resid = choose_child(p, q, kids, g)
        tok = kids[pick] if pick >= 0 else int(torch.multinomial(resid, 1, generator=g))
        counts[tok] += 1
    assert pooled_chisquare(counts, p) > 1e-3


def test_sample_children_without_replacement_respects_support():
    q = torch.tensor([0.5, 0.0, 0.5, 0.0])
    kids = sample_children(q, 4, torch.Generator().manual_seed(0))
    assert sorted(kids) == [0, 2]


def test_ngram_index_proposes_latest_continuation():
    from specexec_cli.core.ngram import NgramIndex

    idx = NgramIndex([1, 2, 3, 9, 1, 2, 4, 1, 2])
    assert idx.propose([7, 1, 2], 2) == [4, 1]  # latest earlier match of (1, 2) wins
    assert idx.propose([5, 9], 3) == [1, 2, 4]  # falls back to the 1-gram (9,)
    assert idx.propose([8], 3) == []


def test_staged_saves_draft_forwards_and_stays_exact(shared_pair):
    """On real code the n-gram stage lets the draft skip forwards; the output is unchanged."""
    import json

    m = load_models(LoadOptions(str(shared_pair[0]), str(shared_pair[1]), device="cpu"))
    prompt = json.loads((shared_pair[0].parents[1] / "bench" / "prompts.jsonl").read_text().splitlines()[2])["prompt"]
    ids = list(m.tokenizer(prompt)["input_ids"])
    calls = []
    hook = m.draft.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        outs, forwards = {}, {}
        for method in ("specexec", "staged"):
            calls.clear()
            outs[method] = [
                t for ev in generate(m, DecodeState(), ids, config(method, 16, max_new=32)) for t in ev.tokens
            ]
            forwards[method] = len(calls)
    finally:
        hook.remove()
    assert outs["staged"] == outs["specexec"]
    assert forwards["staged"] < forwards["specexec"]
