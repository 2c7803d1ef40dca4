"""The prompt cache (session/prompt_cache.py): its admission/eviction policy on synthetic cache
states, and, through a ChatSession on the tiny pair, that a conversation interleaved with other
requests restores its rows bit-exactly, prefills only the new turn and decodes the same greedy
text as the same conversation without the interleaved requests."""

from __future__ import annotations

import pytest
import torch

from specexec_cli.core import kvcache
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.session.chat import ChatSession
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.session.prompt_cache import PromptCache, make_prompt_cache, restore, token_bytes

LAYERS, HEADS, DIM = 2, 2, 4
ROW_BYTES = 2 * LAYERS * HEADS * DIM * 4  # K and V, fp32, per position (target only: no draft rows)


def state(ids: list[int], seed: int = 0) -> DecodeState:
    """A DecodeState whose target cache holds random rows for ids[:-1] (as after a reply)."""
    st = DecodeState(ids=list(ids))
    gen = torch.Generator().manual_seed(seed)
    n = len(ids) - 1
    for layer in range(LAYERS):
        k, v = (torch.randn(1, HEADS, n, DIM, generator=gen) for _ in range(2))
        st.target_cache.update(k, v, layer)
    st.target_len = n
    return st


def rows(st: DecodeState, n: int) -> list[torch.Tensor]:
    return [t[:, :, :n].clone() for layer in st.target_cache.layers for t in (layer.keys, layer.values)]


class NoModels:
    target = draft = None
    kv_rows, shared_kv = None, False


def test_a_short_request_never_evicts_a_longer_conversation_in_use():
    conv, title = state(list(range(1, 101))), state([500 + i for i in range(40)], seed=1)
    cache = PromptCache(capacity=120 * ROW_BYTES)
    assert cache.save(conv) and cache.entries[0].nbytes == 99 * ROW_BYTES
    cache.clock += 1
    assert not cache.save(title)  # no room without evicting the longer, recently used conversation
    assert [e.target_len for e in cache.entries] == [99] and cache.stats.refused == 1
    cache.clock += cache.protect_requests  # nobody continued it for protect_requests requests
    assert cache.save(title)
    assert [e.target_len for e in cache.entries] == [39] and cache.stats.evictions == 1


def test_a_continued_conversation_survives_a_longer_one_shot():
    conv = state(list(range(1, 61)))
    cache = PromptCache(capacity=100 * ROW_BYTES)
    assert cache.save(conv)
    cache.clock += 1
    assert cache.prepare(state([0]), list(range(1, 61)) + [7, 8], NoModels) == 59  # turn 2 restores it
    follow_up = state([400 + i for i in range(80)], seed=2)  # longer: the history pasted into one message
    cache.clock += 1
    assert not cache.save(follow_up) and [e.target_len for e in cache.entries] == [59]
    cache.clock += cache.protect_requests
    assert cache.save(follow_up) and [e.target_len for e in cache.entries] == [79]


def test_lru_by_bytes_and_short_snapshots_are_not_kept():
    cache = PromptCache(capacity=100 * ROW_BYTES)
    a, b, c = (state([k * 1000 + i for i in range(41)], seed=k) for k in (1, 2, 3))
    for st in (a, b):
        cache.clock += 1
        assert cache.save(st)
    cache.clock += 1
    assert cache.save(c)  # same length: the least recently used one (a) goes
    assert [e.ids[0] for e in cache.entries] == [2000, 3000] and cache.nbytes == 80 * ROW_BYTES
    assert not cache.save(state([7] * 10)) and len(cache.entries) == 2  # under min_tokens
    assert not PromptCache(capacity=10 * ROW_BYTES).save(a)  # larger than the whole cache


def test_a_longer_turn_of_the_same_conversation_replaces_its_snapshot():
    cache = PromptCache(capacity=1000 * ROW_BYTES)
    turn1 = state(list(range(1, 60)))
    assert cache.save(turn1)
    turn2 = state(list(range(1, 60)) + list(range(200, 240)))
    assert cache.save(turn2)
    assert [e.target_len for e in cache.entries] == [98] and cache.stats.saves == 2
    assert cache.save(turn1) and len(cache.entries) == 1  # covered by the longer one: nothing new kept


def test_restore_is_bit_exact_and_prepare_saves_what_a_rewind_would_discard():
    conv = state(list(range(1, 81)), seed=3)
    want = rows(conv, 79)
    cache = PromptCache(capacity=1000 * ROW_BYTES)
    live = conv
    other = [900, 901, 902] + list(range(300, 330))
    assert cache.prepare(live, other, NoModels) == 0  # nothing better cached ...
    assert len(cache.entries) == 1  # ... but the conversation was kept before the rewind
    live.ids[:], live.target_len = other, 0  # the other request takes the live state
    kvcache.crop(live.target_cache, 0)
    again = list(range(1, 81)) + [5, 6, 7]
    assert cache.prepare(live, again, NoModels) == 79 and cache.stats.hits == 1
    assert live.ids == list(range(1, 80)) and live.target_len == 79
    assert all(torch.equal(a, b) for a, b in zip(rows(live, 79), want))


@pytest.fixture(scope="module")
def models(tiny_pair):
    return load_models(LoadOptions(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32", device="cpu"))


def reply(session: ChatSession, full: list[int]) -> tuple[list[int], int]:
    """(greedy reply tokens, prompt tokens not prefilled)."""
    ids = session.prefill_ids(full)
    cached = len(full) - (len(session.state.ids) + len(ids) - session.state.target_len)
    out = [t for ev in session.decode(ids) for t in ev.tokens]
    return out, cached


def test_interleaved_requests_do_not_cost_the_conversation(models):
    cfg = GenerationConfig(shape=TreeShape(8, 8), max_new_tokens=12)
    enc = lambda s: list(models.tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    with_cache = ChatSession(models, cfg, code=True, prompt_cache=make_prompt_cache(models, None, 10**8))
    alone = ChatSession(models, cfg, code=True)
    conv = enc("def parse(line):\n    x = ")
    for turn in range(3):
        got, cached = reply(with_cache, conv)
        draft_rows = [
            t[:, :, : with_cache.state.draft_len].clone()
            for layer in with_cache.state.draft_cache.layers
            for t in (layer.keys, layer.values)
        ]
        snap_ids = list(with_cache.state.ids)
        reply(with_cache, enc("write a title for: ") + conv[-20:])  # the shapes a client sends in between
        reply(with_cache, enc("suggest follow ups"))
        want, alone_cached = reply(alone, conv)
        assert got == want
        assert cached == alone_cached and (turn == 0 or cached >= 0.5 * len(conv))
        if turn < 2:  # the snapshot holds the draft's rows too, restored exactly
            entry = next(e for e in with_cache.prompt_cache.entries if e.ids == snap_ids)
            assert entry.draft_len > 0
            assert all(torch.equal(a, b) for a, b in zip((t for pair in entry.draft for t in pair), draft_rows))
        conv = conv + got + enc("\ny = 3\n")
    assert with_cache.prompt_cache.stats.hits >= 2
    assert token_bytes(models.target) == 2 * 3 * 2 * 16 * 4  # layers, kv heads, head_dim, fp32


def test_restore_into_a_fresh_state_and_no_cache_at_zero(models):
    assert make_prompt_cache(models, None, 0) is None
    session = ChatSession(models, GenerationConfig(shape=TreeShape(4, 4), max_new_tokens=4), code=True)
    reply(session, list(models.tokenizer("import os\nimport sys\n")["input_ids"]))
    cache = PromptCache(10**8)
    assert cache.save(session.state)
    fresh = DecodeState()
    restore(cache.entries[0], fresh, models)
    assert fresh.ids == session.state.ids and fresh.target_len == session.state.target_len
    n = fresh.target_len
    assert all(
        torch.equal(a.keys[:, :, :n], b.keys[:, :, :n])
        for a, b in zip(fresh.target_cache.layers, session.state.target_cache.layers)
    )


def test_a_self_drafts_shared_cache_keeps_no_rows_of_its_own():
    st = state(list(range(1, 41)))
    st.draft_cache, st.draft_len = kvcache.SharedCache(st.target_cache), 39  # the draft reads the target's rows
    cache = PromptCache(capacity=1000 * ROW_BYTES)
    assert cache.save(st) and cache.entries[0].draft == [] and cache.entries[0].nbytes == 39 * ROW_BYTES
    fresh = state([0])
    fresh.draft_cache = kvcache.SharedCache(fresh.target_cache)
    restore(cache.entries[0], fresh, NoModels)
    assert fresh.target_len == 39 and fresh.draft_len == 0 and fresh.draft_cache.start == 0
    assert all(torch.equal(a, b) for a, b in zip(rows(fresh, 39), rows(st, 39)))
