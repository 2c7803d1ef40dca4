"""At T > 0 the self-draft's output follows the target's law (Pearson chi-square on the joint of the
first two emitted tokens).

Setup: a tiny seeded target streamed from disk with its nf4 self-draft (shared KV), T = 1, no top-k
or top-p; N independent runs (seeds 0..N-1) each emit three tokens after the same prompt: the first is
the prefill's draw, the second and third come from one tree walk (a tree of depth 1 under the
root: the draft's children, the acceptance and the bonus draw all take part); the test takes the
first two. The reference is the target's
own probabilities, computed here with a plain resident forward: p(a) p(b | a). Cells with an
expected count below 5 are pooled (~30 cells). What it guards is the self-draft's own risk: its
tree rows live in the target's KV slabs, so a draft that wrote over one committed row of the target
would change the target's law; planted once (the draft's tree writes also over the last committed
row), it failed with chi-square 146 on 30 degrees of freedom (p ~ 3e-17). A wrong acceptance rule
barely shows here, because this draft is so close to the target that its first child is nearly
always the target's draw (a planted "accept the first child when all are rejected" passed): the
acceptance rules are tested with a deliberately different draft in tests/test_distribution.py.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.session.loading import LoadOptions, load_models
from tests.conftest import make_model

N = 1000
PROMPT = "def f(x):\n    return"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sddist")
    path = make_model(root / "t", seed=5, layers=3, hidden=64)
    import os

    old = os.environ.get("SPECX_CACHE")
    os.environ["SPECX_CACHE"] = str(root / "cache")
    try:
        yield load_models(LoadOptions(str(path), "self", dtype="fp32", device="cpu", offload="disk", max_ram=0))
    finally:
        os.environ.pop("SPECX_CACHE") if old is None else os.environ.__setitem__("SPECX_CACHE", old)


def reference(models, prompt: list[int]) -> dict[tuple, float]:
    """p(a, b) = p(a | prompt) p(b | prompt, a) from the target's own logits (T = 1); an EOS first
    token ends the run, so it is the one-token cell (a,)."""
    t = models.target
    with torch.inference_mode():
        first = torch.softmax(t(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
        probs = {}
        for a in range(first.numel()):
            if a in models.eos_ids:
                probs[(a,)] = float(first[a])
                continue
            second = torch.softmax(t(input_ids=torch.tensor([prompt + [a]])).logits[0, -1].float(), -1)
            for b in range(second.numel()):
                probs[(a, b)] = float(first[a] * second[b])
    return probs


def test_self_draft_samples_follow_the_target(models):
    prompt = models.tokenizer(PROMPT)["input_ids"]
    cfg = dict(method="specexec", shape=TreeShape(8, 8), sampling=SamplingParams(1.0), max_new_tokens=3)
    counts, in_one_pass = {}, 0
    for seed in range(N):
        events = list(generate(models, DecodeState(), prompt, GenerationConfig(seed=seed, **cfg)))
        ids = tuple(t for ev in events for t in ev.tokens)[:2]
        counts[ids] = counts.get(ids, 0) + 1
        in_one_pass += (
            len(events) > 1 and events[1].accepted >= 1
        )  # the second token was a draft child the target accepted
    probs = reference(models, prompt)
    cells = sorted(probs, key=probs.get, reverse=True)
    big = [c for c in cells if probs[c] * N >= 5]
    rest_p = 1.0 - sum(probs[c] for c in big)
    obs = [counts.get(c, 0) for c in big] + [N - sum(counts.get(c, 0) for c in big)]
    exp = [probs[c] * N for c in big] + [rest_p * N]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    dof = len(obs) - 1
    assert dof >= 8, "too few cells for a meaningful test"
    assert in_one_pass > N // 4, "the draft's children should carry the second token in many runs"
    assert chi2.sf(stat, dof) > 1e-3, (stat, dof)
