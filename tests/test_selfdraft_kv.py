"""The self-draft's shared KV cache and its skipped layers (offload/selfdraft/build.py, kvcache.SharedCache).

What must hold: with `shared_kv` (the default for `--draft self`) the draft's cache is a view of the
target's slabs (same storage, no bytes of its own, no draft prefill) and every method stays lossless
at T = 0, as it does with a cache of the draft's own; a draft that skips a block of middle layers
(a middle block of pass-throughs where the plan left no room for substitutes) is lossless too; a conversation whose
turns rewind the caches stays equal to the target's own greedy decoding. fp32 throughout, so
greedy ids compare exactly (bf16 ties: tests/test_selfdraft.py).
"""

from __future__ import annotations

import pytest
import torch

from offload.selfdraft.build import PassThrough, skip_block
from specexec_cli.core import kvcache
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.session.chat import ChatSession
from specexec_cli.session.loading import LoadOptions, load_models
from tests.conftest import make_model

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("selfkv") / "t", seed=21, layers=6, hidden=64)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))


def load(target, draft="self", **kw):
    return load_models(LoadOptions(str(target), draft, dtype="fp32", device="cpu", offload="disk", max_ram=0, **kw))


def decode(models, method="specexec", n=24, state=None):
    cfg = GenerationConfig(method=method, shape=TreeShape(16, 16), max_new_tokens=n)
    ids = models.tokenizer(PROMPT)["input_ids"]
    return [t for ev in generate(models, state or DecodeState(), ids, cfg) for t in ev.tokens]


@pytest.fixture(scope="module")
def ar_ids(target):
    return decode(load(target, None), "ar")


def test_shared_cache_is_a_view_of_the_targets_slabs(target, ar_ids):
    models = load(target)
    st = DecodeState()
    forwards = []
    real = models.draft.forward
    models.draft.forward = lambda *a, **kw: forwards.append(kw["input_ids"].shape[1]) or real(*a, **kw)
    assert models.shared_kv and decode(models, state=st) == ar_ids
    assert isinstance(st.draft_cache, kvcache.SharedCache)
    for mine, theirs in zip(st.draft_cache.layers, st.target_cache.layers):
        assert mine.keys.data_ptr() == theirs.keys.data_ptr() and mine.values.data_ptr() == theirs.values.data_ptr()
    assert forwards and max(forwards) <= 16, "the draft never runs the prompt (no prefill), only tree batches"
    assert st.draft_len == st.target_len == len(st.ids) - 1


def test_a_shared_cache_never_moves_the_targets_rows(target):
    models = load(target)
    st = DecodeState()
    decode(models, n=4, state=st)
    with pytest.raises(RuntimeError, match="never moves the target's committed rows"):
        kvcache.compact(st.draft_cache, 1, torch.tensor([3]))


@pytest.mark.parametrize("method", ["specexec", "chain", "specinfer", "sequoia", "staged"])
@pytest.mark.parametrize("shared_kv", [True, False])
def test_every_method_is_lossless_with_either_cache(target, ar_ids, method, shared_kv):
    models = load(target, shared_kv=shared_kv)
    assert models.shared_kv == shared_kv
    assert decode(models, method) == ar_ids


def test_skipped_layers_are_pass_throughs_and_stay_lossless(target, ar_ids):
    models = load(target, draft_skip=2, draft_skip_rule="middle")  # the influence rule: tests/test_influence.py
    assert skip_block(6, 2) == [2, 3] and models.draft.skipped == [2, 3]
    assert all(isinstance(models.draft.layers[i], PassThrough) for i in (2, 3))
    assert models.draft.substituted == [0, 1, 4, 5]
    assert decode(models) == ar_ids


def test_turns_that_rewind_the_caches_stay_equal_to_the_target(target):
    cfg = GenerationConfig(shape=TreeShape(16, 16), max_new_tokens=12)
    sessions = [ChatSession(load(target, d), cfg, use_template=False) for d in (None, "self")]
    sessions[0].cfg = GenerationConfig(method="ar", max_new_tokens=12)
    for text in ("def f(x):", "class a:", "import os"):
        ar, sd = (s.reply(text, lambda _: None).token_ids for s in sessions)
        assert sd == ar
    ids = list(sessions[1].state.ids)
    sessions[1].prefill_ids(ids[: len(ids) // 2] + [5])  # a rewind into the middle of the conversation
    st = sessions[1].state
    assert st.draft_len == st.target_len == len(ids) // 2 and st.draft_cache.start == st.target_len


def test_the_plans_skipped_layers_reach_the_draft(target, ar_ids):
    from dataclasses import replace

    from specexec_cli.session.planning import make_plan

    opts = LoadOptions(str(target), "self", dtype="fp32", device="cpu", offload="disk", max_ram=0)
    plan = make_plan(opts, TreeShape(16, 16), False, 0.0)
    assert plan.fits and plan.skipped_layers == []  # nothing to skip where every substitute fits
    plan.skipped_layers = [4]  # one layer left out: the loader picks the least influential
    models = load_models(replace(opts, plan=plan))
    (left_out,) = models.draft.skipped
    assert plan.skipped_layers == [left_out] and isinstance(models.draft.layers[left_out], PassThrough)
    assert decode(models) == ar_ids
