"""Constrained sampling at T > 0: every emitted token follows the target's MASKED processed distribution.

Setup: the fake table LMs of tests/fakes.py over an 8-token byte-level vocabulary that spells JSON
arrays of integers (`TOKENS`), the grammar {"type": "array", "items": {"type": "integer"}}, T = 0.7
with top-k = 3 and top-p = 0.9, a low-noise draft. The reference is written here, independently of
specx and of the grammar engine: `allowed_next` is the array-of-integers language as a hand-written
state machine (no leading zeros, ", " between items, nothing after "]"), and the reference law of
a token is: raw logits -> forbidden tokens at -inf -> temperature -> top-k -> top-p.

What is tested, for `--method ar` and specexec: support (no token the reference gives probability 0
is ever emitted, so nothing outside the grammar or the top-k/top-p cut), and the Pearson chi-square
of each token's rank under its reference law against the expected counts E_k = sum_i p_i(rank k)
(valid and conservative for heterogeneous multinomials), at alpha = 1e-3. Masking after top-k/top-p
instead of before would change both: the test asserts the two laws differ on the contexts visited.
"""

from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import chi2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig, Models
from specexec_cli.core.grammar import GrammarSpec
from specexec_cli.core.methods import generate
from specexec_cli.core.sampling import SamplingParams
from tests.fakes import TableLM, next_logits, noisy, random_table

pytest.importorskip("xgrammar")  # the `grammar` extra

TOKENS = ["<eos>", "[", "]", ",", " ", "1", "2", "0"]
V = len(TOKENS)
EOS, OPEN, CLOSE, COMMA, SPACE = 0, 1, 2, 3, 4
DIGITS = {5, 6, 7}
PARAMS = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
SPEC = GrammarSpec("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}}))
PROMPT = [SPACE, COMMA]  # any context: the grammar starts with the reply


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {("\u0120" if c == " " else c): i for i, c in enumerate(TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def allowed_next(reply: list[int]) -> set[int]:
    """The array-of-integers language, by hand: tokens allowed after `reply` (empty: complete)."""
    if not reply:
        return {OPEN}
    last = reply[-1]
    if last == CLOSE:
        return set()
    if last == OPEN:
        return {CLOSE} | DIGITS
    if last == COMMA:
        return {SPACE}
    if last == SPACE:
        return set(DIGITS)
    # inside an integer: digits after a leading "0" are not JSON
    start = len(reply) - 1
    while start > 0 and reply[start - 1] in DIGITS:
        start -= 1
    leading_zero = reply[start] == 7
    return {COMMA, CLOSE} if leading_zero else {COMMA, CLOSE} | DIGITS


def reference_probs(logits: torch.Tensor, ok: set[int], masked_first: bool = True) -> torch.Tensor:
    """Raw logits -> mask -> T -> top-k -> top-p (the law specx must follow); masked_first=False:
    the mask applied after top-k/top-p instead (the law a wrong order would give)."""
    x = logits.double().clone()
    keep = torch.zeros(V, dtype=torch.bool)
    keep[list(ok)] = True
    if masked_first:
        x[~keep] = float("-inf")
    x = x / PARAMS.temperature
    kth = torch.sort(x, descending=True).values[PARAMS.top_k - 1]
    x[x < kth] = float("-inf")
    p = torch.softmax(x, -1)
    order = torch.argsort(p, descending=True)
    before = torch.cumsum(p[order], 0) - p[order]
    cut = torch.zeros(V, dtype=torch.bool)
    cut[order[before >= PARAMS.top_p]] = True
    cut[order[0]] = False
    p[cut] = 0
    if not masked_first:
        p[~keep] = 0
    return p / p.sum()


@pytest.fixture(scope="module")
def tables():
    target = random_table(V, seed=11, scale=2.0)
    target[:, :, CLOSE] -= 1.5  # longer arrays: more tokens per reply
    return target, noisy(target, 0.4, seed=12)


def emitted(tables, method: str, runs: int):
    """(reference law, token) of every emitted token over `runs` seeded replies."""
    target, draft = tables
    m = Models(
        target=TableLM(target), draft=TableLM(draft), tokenizer=tokenizer(), eos_ids=frozenset([EOS]), ctx_limit=4096
    )
    out = []
    for seed in range(runs):
        cfg = GenerationConfig(
            method=method, shape=TreeShape(16, 8), sampling=PARAMS, seed=seed, max_new_tokens=40, grammar=SPEC
        )
        events = list(generate(m, DecodeState(), list(PROMPT), cfg))
        reply = [t for ev in events for t in ev.tokens]
        for i, tok in enumerate(reply):
            ok = allowed_next(reply[:i])
            out.append(
                (
                    reference_probs(next_logits(target, PROMPT + reply[:i]), ok),
                    tok,
                    ok,
                    next_logits(target, PROMPT + reply[:i]),
                )
            )
        if events[-1].finish == "stop":
            assert reply[-1] == CLOSE and not allowed_next(reply)
    return out


def rank_chi2(samples) -> tuple[float, int]:
    """Pearson chi-square of the tokens' ranks under their laws (bins with E < 5 merged into the last)."""
    obs = torch.zeros(V, dtype=torch.float64)
    exp = torch.zeros(V, dtype=torch.float64)
    for p, tok, _, _ in samples:
        order = torch.argsort(p, descending=True)
        obs[int((order == tok).nonzero()[0, 0])] += 1
        exp += p[order]
    k = int((exp >= 5).sum())
    o = torch.cat([obs[: k - 1], obs[k - 1 :].sum()[None]])
    e = torch.cat([exp[: k - 1], exp[k - 1 :].sum()[None]])
    return float(((o - e) ** 2 / e).sum()), len(o) - 1


@pytest.mark.parametrize("method", ["ar", "specexec"])
def test_constrained_sampling_follows_the_masked_law(tables, method):
    samples = emitted(tables, method, runs=200)
    assert len(samples) >= 1500, len(samples)
    for p, tok, _, _ in samples:
        assert p[tok] > 0, (tok, p)  # never outside the grammar or the top-k / top-p cut
    stat, dof = rank_chi2(samples)
    assert dof >= 1
    assert chi2.sf(stat, dof) > 1e-3, (stat, dof)


def test_mask_order_matters_on_these_contexts(tables):
    """Power: masking after top-k/top-p would give another law on a good share of the contexts."""
    samples = emitted(tables, "ar", runs=30)
    differ = sum(
        float((reference_probs(lg, ok) - reference_probs(lg, ok, masked_first=False)).abs().sum()) > 0.1
        for _, _, ok, lg in samples
    )
    assert differ >= len(samples) // 5, (differ, len(samples))
