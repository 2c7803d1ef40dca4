"""The static draft step on CUDA (marked `cuda`, skipped without a GPU): each bucket's static pass
captured once as a CUDA graph and replayed, giving the trees and ids of the eager exact-width path;
every method's draft passes are replayed graphs (chain, SpecInfer, Sequoia and staged included).

fp32 with TF32 off, as tests/test_cuda.py's token-equality tests: in bf16 (or TF32) GEMMs of
different row counts differ by an ulp and a near-tie may flip a token without any bug.
"""

from __future__ import annotations

import pytest
import torch

from specexec_cli.core import draftstep, kvcache
from specexec_cli.core.draft import DraftContext, TreeShape, grow_tree
from specexec_cli.core.engine import DecodeState, GenerationConfig, Models
from specexec_cli.core.methods import METHODS, generate
from specexec_cli.core.sampling import SamplingParams
from tests.test_transfers import NullTokenizer, tiny_llama

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PREFIX = [(7 * i) % 50 + 1 for i in range(20)]
SHAPE = TreeShape(budget=48, max_depth=8, max_beams=12, max_branch=4)


@pytest.fixture
def exact_fp32():
    """fp32 matmuls without TF32 for the test's duration (equality across GEMM shapes)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def graph_calls(monkeypatch):
    """{"capture": n, "replay": n}: CUDAGraph calls, counted by wrapping the class's methods."""
    calls = {"capture": 0, "replay": 0}
    cls = torch.cuda.CUDAGraph
    begin, replay = cls.capture_begin, cls.replay

    def counted_begin(self, *a, **k):
        calls["capture"] += 1
        return begin(self, *a, **k)

    def counted_replay(self):
        calls["replay"] += 1
        return replay(self)

    monkeypatch.setattr(cls, "capture_begin", counted_begin)
    monkeypatch.setattr(cls, "replay", counted_replay)
    return calls


def grow(model, cache):
    ctx = DraftContext(n_cached=0, pending=PREFIX, root_pos=len(PREFIX) - 1)
    return grow_tree(model, cache, ctx, SHAPE, SamplingParams())


def test_replayed_tree_equals_the_eager_one(exact_fp32, graph_calls, monkeypatch):
    """A resident draft over a reserved cache: every bucket captured once, then replayed; the tree
    equals the exact-width eager one; a second tree on the same cache captures nothing new."""
    model = tiny_llama(256, 2).cuda()
    monkeypatch.setitem(draftstep.BUCKETS, "cuda", ())
    eager_cache = kvcache.new_cache()
    kvcache.reserve(eager_cache, model, 512)
    eager = grow(model, eager_cache)
    assert graph_calls == {"capture": 0, "replay": 0}
    monkeypatch.setitem(draftstep.BUCKETS, "cuda", draftstep.POWERS)
    cache = kvcache.new_cache()
    kvcache.reserve(cache, model, 512)
    step = draftstep.step_for(model, cache)
    assert step.graphs
    for _ in range(2):
        kvcache.crop(cache, 0)
        tree = grow(model, cache)
        assert torch.equal(tree.tokens, eager.tokens) and torch.equal(tree.parents, eager.parents)
        assert torch.allclose(tree.logp, eager.logp, atol=1e-4)
        n = kvcache.cache_len(eager_cache)
        assert kvcache.cache_len(cache) == n
        assert torch.allclose(cache.layers[1].keys[:, :, :n], eager_cache.layers[1].keys[:, :, :n], atol=1e-4)
    captured = [p for p, b in step.buffers.items() if b.graph is not None]
    assert captured and graph_calls["capture"] == len(captured)  # once per bucket, over both trees
    assert graph_calls["replay"] >= 2 * len(captured)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_with_graphs_emits_the_ids_of_ar(exact_fp32, graph_calls, temperature):
    """specexec with the draft's passes replayed as graphs emits ar's ids (T = 0 and a seeded T > 0)."""
    m = Models(
        tiny_llama(256, 1).cuda(), tiny_llama(256, 2).cuda(), NullTokenizer(), frozenset({-1}), 256, kv_rows=(256, 256)
    )
    prompt = [(7 * i) % 50 + 1 for i in range(20)] * 2
    out = {}
    for method in ("ar", "specexec"):
        cfg = GenerationConfig(
            method=method, shape=SHAPE, sampling=SamplingParams(temperature), max_new_tokens=48, seed=5
        )
        out[method] = [t for ev in generate(m, DecodeState(), prompt, cfg) for t in ev.tokens]
    assert out["specexec"] == out["ar"] and len(out["ar"]) == 48
    assert graph_calls["capture"] > 0 and graph_calls["replay"] > graph_calls["capture"]


def test_every_method_replays_its_draft_passes(exact_fp32, graph_calls):
    """Each method's draft passes are replayed as graphs (counted per method) and its T = 0 ids are ar's."""
    m = Models(
        tiny_llama(256, 1).cuda(), tiny_llama(256, 2).cuda(), NullTokenizer(), frozenset({-1}), 256, kv_rows=(256, 256)
    )
    prompt = [(7 * i) % 50 + 1 for i in range(20)] * 2
    out, replays = {}, {}
    for method in METHODS:
        before = graph_calls["replay"]
        cfg = GenerationConfig(method=method, shape=SHAPE, max_new_tokens=32)
        out[method] = [t for ev in generate(m, DecodeState(), prompt, cfg) for t in ev.tokens]
        replays[method] = graph_calls["replay"] - before
    assert all(ids == out["ar"] for ids in out.values()) and len(out["ar"]) == 32
    assert replays["ar"] == 0 and all(n > 0 for method, n in replays.items() if method != "ar"), replays
