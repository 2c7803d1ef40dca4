"""Host<->device traffic of a speculative step: counted by transfers.to_host / upload, small,
vocabulary-free, and constant in tree depth and in layer count, at T = 0 and at T > 0.

On the CPU the copies are no-ops, but every one still goes through `to_host` or `upload`, so these
tests see the pattern a GPU run has: how many synchronisations per draft forward and how many bytes
each. Per draft forward: one upload (token ids, positions, the tree's ancestor columns and the
n-gram proposals, `kvcache.stage`; the mask is then built on the device) and one download of the
(B, 2k [+1]) top-k block. Per step on top: the verify pass (one upload of its inputs, one download
of every node's chosen token as one (n,) vector, in both modes) and the commit (the kept rows, one
upload per cache, never one per layer). No logits row crosses at T > 0: the race noise is computed
on the device (sampling.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specexec_cli.core import transfers
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig, Models
from specexec_cli.core.methods import generate
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.core.stats import RunStats

SHAPE = TreeShape(budget=48, max_depth=8, max_beams=8, max_branch=4)


class NullTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def tiny_llama(vocab: int, seed: int, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def pair(vocab: int, layers: int = 2) -> Models:
    return Models(tiny_llama(vocab, 1, layers), tiny_llama(vocab, 2, layers), NullTokenizer(), frozenset({-1}), 256)


def run_steps(
    m: Models, method: str, temperature: float = 0.0, scores: str = "calibrated+ngram", shape: TreeShape = SHAPE
):
    """Decode 24 tokens; per target pass: (draft forwards, host transfers, bytes). Also the RunStats."""
    forwards = []
    hook = m.draft.register_forward_pre_hook(lambda *_: forwards.append(1))
    cfg = GenerationConfig(
        method=method,
        shape=shape,
        sampling=SamplingParams(temperature),
        max_new_tokens=24,
        extra={"scores": scores, "gamma": 4},
    )
    stats, steps = RunStats(), []
    try:
        ids = [(7 * i) % 50 + 1 for i in range(20)] * 2  # repeated text: n-gram branches fire
        for ev in generate(m, DecodeState(), ids, cfg):
            stats.add(ev)
            if ev.pass_index > 0:
                steps.append((len(forwards), ev.host_transfers, ev.host_transfer_bytes, len(ev.tokens)))
            forwards.clear()
    finally:
        hook.remove()
    return steps, stats


def test_to_host_counts_calls_and_bytes():
    before = transfers.snapshot()
    out = transfers.to_host(torch.zeros(3, 5, dtype=torch.float32))
    assert out.device.type == "cpu"
    moved = transfers.since(before)
    assert (moved.calls, moved.bytes) == (1, 60)


def test_upload_packs_tensors_into_one_counted_copy():
    before = transfers.snapshot()
    a, b = transfers.upload("cpu", torch.arange(6).view(2, 3), torch.tensor([7, 8]))
    moved = transfers.since(before)
    assert (moved.calls, moved.uploads, moved.bytes) == (1, 1, 8 * 8)
    assert a.tolist() == [[0, 1, 2], [3, 4, 5]] and b.tolist() == [7, 8]


def _bytes_bound(shape: TreeShape) -> int:
    """Per draft forward: the (B, 2k+1) fp32 top-k block down; ids, positions, ancestor columns and
    proposals (B (D + 4) longs) up; plus one verify + commit of a budget-sized tree amortised over
    >= 1 forward (its inputs and child table up, the (n,) int32 choices down, the kept rows up)."""
    b, k, d, n = shape.max_beams, shape.max_branch, shape.max_depth, shape.budget + 1
    return b * (2 * k + 1) * 4 + b * (d + 4) * 8 + n * (d + 5 + k) * 8 + n * 4 + 2 * n * 8


@pytest.mark.parametrize("method", ["specexec", "chain", "specinfer", "sequoia"])
def test_bytes_per_draft_forward_do_not_grow_with_vocab(method):
    """Same tree limits, 16x the vocabulary: the bytes copied per draft forward stay put (T = 0;
    T > 0 is held to the same bound and to the greedy figure below)."""
    per_forward = {}
    for vocab in (256, 4096):
        steps, _ = run_steps(pair(vocab), method)
        fwd = sum(s[0] for s in steps)
        per_forward[vocab] = sum(s[2] for s in steps) / fwd
    assert per_forward[4096] <= _bytes_bound(SHAPE) < 4096 * 4  # less than one vocabulary row
    assert per_forward[4096] <= 1.5 * per_forward[256]


@pytest.mark.parametrize("method", ["specexec", "chain"])  # tree growth and chain growth
def test_transfers_per_step_are_constant_in_depth_and_layers(method):
    """T = 0: at most 2 copies per draft forward (one staged upload, the top-k down) plus 4 per
    step (verify: one staged upload, the choices down; commit: kept rows, one per cache), whether
    the tree may grow 4 deep with 2 layers or 12 deep with 6 (a per-layer or per-level copy would
    break the bound)."""
    for layers, depth in ((2, 4), (6, 12)):
        shape = TreeShape(budget=48, max_depth=depth, max_beams=8, max_branch=4)
        steps, stats = run_steps(pair(256, layers), method, shape=shape)
        assert steps
        for forwards, calls, _, _ in steps:
            assert calls <= 2 * forwards + 4, (layers, depth, forwards, calls)
    rec = stats.to_json()
    assert rec["host_transfers_per_pass"] == pytest.approx(stats.host_transfers / stats.target_passes, abs=0.01)
    assert rec["host_transfer_bytes_per_pass"] > 0


@pytest.mark.parametrize("method", ["specexec", "ar", "chain", "specinfer", "sequoia"])
def test_sampled_verify_copies_one_vector_per_pass(method):
    """T > 0: one device→host copy per draft forward (its top-k block) and ONE for the verify step
    (every node's token, chosen on the device), whatever the number of emitted tokens; the bytes of
    a pass exceed the greedy figure for the same limits by less than one fp32 vocabulary row."""
    vocab = 4096
    m = pair(vocab)
    if method == "sequoia":  # measure its acceptance vector first: that calibration runs the draft once
        from specexec_cli.core.methods.sequoia import acceptance_vector

        acceptance_vector(m, list(range(1, 30)), SamplingParams(0.8), None)
    before = transfers.snapshot()
    steps, sampled = run_steps(m, method, temperature=0.8)
    moved = transfers.since(before)
    downloads = moved.calls - moved.uploads
    assert steps and downloads
    for forwards, calls, _nbytes, _emitted in steps:
        assert calls <= 2 * forwards + 4
    total_forwards = sum(s[0] for s in steps)
    assert downloads == total_forwards + len(steps) + 1  # + 1: the prefill's draw
    if total_forwards:
        assert sum(s[2] for s in steps) / total_forwards <= _bytes_bound(SHAPE)
    assert any(s[3] > 1 for s in steps) or method == "ar"  # passes did emit several tokens
    _, greedy = run_steps(pair(vocab), method, temperature=0.0)
    t0, t1 = greedy.to_json(), sampled.to_json()
    assert t1["host_transfer_bytes_per_pass"] - t0["host_transfer_bytes_per_pass"] < vocab * 4
