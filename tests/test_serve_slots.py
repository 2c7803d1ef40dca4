"""Which sequence a `specx serve` request takes (serve/slots.py), on synthetic cache states, and the
prefix copy between sequences (prompt_cache.copy_prefix) and the block-wise common_prefix.

A state here holds random target rows for its ids (as after a reply); a conversation is ids 1..n,
a long shared system prompt is ids 1..SYS, a background task's prompt starts with that system prompt
and goes on with ids of its own.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from specexec_cli.core.engine import DecodeState
from specexec_cli.serve.slots import MIN_ROWS, Slot, choose, donor, waits
from specexec_cli.session.prompt_cache import PromptCache, common_prefix, copy_prefix

LAYERS, HEADS, DIM = 2, 2, 4
SYS = 200  # a system prompt the conversation and the background requests share
NoModels = SimpleNamespace(target=None, draft=None, kv_rows=None, shared_kv=False)


def state(ids: list[int], seed: int = 0) -> DecodeState:
    st = DecodeState(ids=list(ids))
    gen = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        k, v = (torch.randn(1, HEADS, len(ids) - 1, DIM, generator=gen) for _ in range(2))
        st.target_cache.update(k, v, layer)
    st.target_len = len(ids) - 1
    return st


def conversation(n: int = 300) -> list[int]:
    return list(range(1, n + 1))


def task(seed: int, n: int = 120) -> list[int]:
    return list(range(1, SYS + 1)) + [1000 + seed * 200 + i for i in range(n)]


def test_a_background_request_keeps_off_the_conversation_even_when_it_shares_the_system_prompt():
    slots = [Slot(state(conversation()), used=2.0), Slot(DecodeState(), used=0.0)]
    assert choose(slots, [0, 1], task(0), None) == (1, 0)  # the empty sequence, not the one sharing 200 rows
    slots[1] = Slot(state(task(1)), used=1.0, background=True)  # a finished title request's rows
    assert choose(slots, [0, 1], task(2), None) == (1, 0)
    # nothing else free: taking the conversation's sequence loses its rows (299 - 200 shared)
    assert choose(slots, [0], task(2), None) == (0, 99)


def test_the_next_turn_goes_back_to_its_sequence_and_a_loser_is_the_least_recently_used():
    conv, other = conversation(), [5000 + i for i in range(300)]
    slots = [Slot(DecodeState()), Slot(state(other), used=1.0), Slot(state(conv), used=2.0)]
    turn = conv + [7, 8, 9]
    assert choose(slots, [0, 1, 2], turn, None) == (2, 0)  # not the empty one: no copy needed
    # a third conversation when both sequences hold one: the one left longest is displaced
    assert choose(slots, [1, 2], [9000 + i for i in range(50)], None)[0] == 1
    slots[1].used = 3.0
    assert choose(slots, [1, 2], [9000 + i for i in range(50)], None)[0] == 2


def test_rows_the_prompt_cache_or_another_sequence_holds_are_not_lost():
    conv = conversation()
    cache = PromptCache(1 << 30)
    slots = [Slot(state(conv), used=1.0), Slot(state([5000 + i for i in range(300)]), used=2.0)]
    assert choose(slots, [0, 1], task(0), cache)[1] > 0
    assert cache.save(slots[1].state)  # the second conversation is in host RAM now
    assert choose(slots, [0, 1], task(0), cache) == (1, 0)  # so its sequence is the one taken, losing nothing
    slots.append(Slot(state(conv + [3, 4])))  # the first one's rows are in a third sequence too
    assert choose(slots, [0], task(0), None) == (0, 0)


def test_a_background_request_waits_only_while_another_one_decodes():
    slots = [Slot(state(conversation())), Slot(state(task(1)), background=True)]
    assert not waits(slots, 99, True)  # nothing else will free a sequence: it takes the conversation's
    slots[1].ticket = SimpleNamespace(background=True, paused=None)
    assert waits(slots, 99, True)
    assert not waits(slots, 0, True) and not waits(slots, 99, False)  # losing nothing, or not a background one
    slots[1].ticket = SimpleNamespace(background=False, paused=None)  # a chat decodes there: no end in sight
    assert not waits(slots, 99, True)


def test_the_longest_prefix_is_copied_from_another_sequence_bit_exactly():
    conv = state(conversation(), seed=3)
    slots = [Slot(conv), Slot(DecodeState()), Slot(state(task(1), seed=4))]
    want = task(5)
    assert donor(slots, 1, want) == (0, SYS)  # the conversation and the old task both hold the system prompt
    copy_prefix(slots[0].state, slots[1].state, SYS, NoModels)
    dst = slots[1].state
    assert dst.ids == conv.ids[:SYS] and dst.target_len == SYS
    for a, b in zip(conv.target_cache.layers, dst.target_cache.layers):
        assert torch.equal(a.keys[:, :, :SYS], b.keys[:, :, :SYS]) and b.length == SYS
        assert torch.equal(a.values[:, :, :SYS], b.values[:, :, :SYS])
        assert a.keys.data_ptr() != b.keys.data_ptr()  # a copy, not a view of the lender's slab
    assert donor(slots, 1, want) == (-1, 0)  # it holds as much as anyone now
    short = [Slot(DecodeState()), Slot(state(list(range(1, MIN_ROWS))))]
    assert donor(short, 0, list(range(1, 100))) == (-1, 0)  # under MIN_ROWS: prefilled instead


def test_common_prefix_across_blocks():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(0, 3000)
        a = [rng.randrange(4) for _ in range(n)]
        cut = rng.randrange(0, n + 1)
        b = a[:cut] + ([9] if rng.random() < 0.8 else []) + a[cut:]
        naive = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        assert common_prefix(a, b) == naive == common_prefix(b, a)
