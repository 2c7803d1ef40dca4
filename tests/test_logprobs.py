"""logprobs: each emitted token's log-probability and top-k, from the pass that accepted it, equal
torch.log_softmax of transformers' own logits for the same context (raw logits: before temperature,
top-k, top-p and the grammar mask), for `ar` and specexec, greedy and sampled, with and without a
grammar. The reference runs the target's plain forward over prompt + emitted[:i] for every i.
"""

from __future__ import annotations

import pytest
import torch

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.grammar import GrammarError
from specexec_cli.core.methods import generate
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.session.loading import LoadOptions, load_models
from tests.test_grammar import SPEC, json_pair  # noqa: F401  (the fixture)

TOL = 1e-4  # float32 logits of a tree pass against a causal pass


@pytest.fixture(scope="module")
def models(tiny_pair):
    target, draft = tiny_pair
    return load_models(LoadOptions(str(target), str(draft), dtype="fp32", device="cpu"))


def reference(m, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(n, V) log_softmax of transformers' logits before each emitted token (one causal forward)."""
    with torch.no_grad():
        logits = m.target(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], -1)


def check(m, prompt, k: int, **kw):
    cfg = GenerationConfig(shape=TreeShape(32, 16), max_new_tokens=40, logprobs=k, **kw)
    events = list(generate(m, DecodeState(), list(prompt), cfg))
    tokens = [t for ev in events for t in ev.tokens]
    lps = [lp for ev in events for lp in ev.logprobs]
    assert [lp.token for lp in lps] == tokens
    assert all(len(ev.logprobs) == len(ev.tokens) for ev in events)
    ref = reference(m, list(prompt), tokens)
    for i, lp in enumerate(lps):
        assert abs(lp.logprob - float(ref[i, lp.token])) < TOL
        top = torch.topk(ref[i], k)
        assert len(lp.top) == k
        assert [t for t, _ in lp.top][:1] == top.indices.tolist()[:1]  # ties below the first may swap
        for t, v in lp.top:
            assert abs(v - float(ref[i, t])) < TOL
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    return events


@pytest.mark.parametrize("method", ["ar", "specexec"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_transformers_log_softmax(models, method, temperature):
    prompt = models.tokenizer("def f(x):\n  return")["input_ids"]
    events = check(models, prompt, 3, method=method, sampling=SamplingParams(temperature=temperature, top_p=0.9))
    if method == "specexec":
        assert max(len(ev.tokens) for ev in events[1:]) > 1  # several tokens from one pass were checked


def test_logprobs_under_a_grammar_are_the_models_own(json_pair):  # noqa: F811
    """With a grammar the reported logprobs stay the raw model's (a forbidden token may be a top one)."""
    prompt = json_pair.tokenizer("data:\n")["input_ids"]
    check(json_pair, prompt, 2, grammar=SPEC)


def test_zero_alternatives_and_off(models):
    prompt = models.tokenizer("for i in")["input_ids"]
    check(models, prompt, 0)
    events = list(generate(models, DecodeState(), prompt, GenerationConfig(shape=TreeShape(16, 8), max_new_tokens=8)))
    assert all(ev.logprobs is None for ev in events)


def test_negative_alternatives_are_refused(models):
    with pytest.raises(GrammarError, match="logprobs must be >= 0"):
        list(generate(models, DecodeState(), [1, 2], GenerationConfig(logprobs=-1)))
