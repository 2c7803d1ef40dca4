"""Which of `specx serve`'s sequences a request takes, and what it finds there (llama-server's slot selection).

Contract: a `Slot` is one sequence's `DecodeState`, the ticket decoding in it (None: free), when it
was last taken, and whether its rows are a finished background task's (limits.task_of: nobody sends
that prompt again). `choose(slots, free, full, cache)` is (index, rows lost) of the free slot a
request for `full` takes, by these keys in order:
1. it loses nothing: no rows that nothing else keeps (the request, another sequence, a prompt-cache
   entry); an empty slot, a background task's rows and under MIN_ROWS rows lose nothing;
2. it displaces no conversation (MIN_ROWS or more rows beyond what the request reuses);
3. it shares the most rows with the request (a conversation's next turn goes back to its sequence);
4. least recently used; when every free slot loses rows, only this counts.
`donor(slots, i, full)` is (index, rows) of the sequence holding MIN_ROWS or more rows of `full`'s
prefix beyond slot i's, which the scheduler copies (prompt_cache.copy_prefix) instead of prefilling.
`waits(...)`: a background request that would lose a conversation's rows waits while another
background request decodes (it ends soon: limits.TASK_CAPS), so nothing waits for ever.
"""

from __future__ import annotations

from dataclasses import dataclass

from specexec_cli.core.engine import DecodeState
from specexec_cli.session.prompt_cache import common_prefix, reusable

MIN_ROWS = 16  # fewer rows than this are not worth a copy, nor counted as lost (prompt_cache.MIN_TOKENS)


@dataclass
class Slot:
    """One sequence's caches and who holds them."""

    state: DecodeState  # committed ids and both caches
    ticket: object = None  # the scheduler.Ticket decoding in it; None = free
    used: float = 0.0  # perf_counter when last taken (least recently used first)
    background: bool = False  # its rows are a finished background task's: no request will continue them


def displaced(slot: Slot, full: list[int]) -> int:
    """A conversation's rows beyond what a request for `full` reuses (0: under MIN_ROWS, or none held)."""
    gone = 0 if slot.background else slot.state.target_len - reusable(full, slot.state)
    return gone if gone >= MIN_ROWS else 0


def lost(slots: list[Slot], k: int, full: list[int], cache) -> int:
    """Rows slot k's cache loses when a request for `full` takes it (module docstring, rule 1)."""
    st = slots[k].state
    if not displaced(slots[k], full):
        return 0
    kept = reusable(full, st)
    if cache is not None:
        kept = max(kept, cache.covered(st))
    for j, other in enumerate(slots):  # the same rows in another sequence
        if j != k and kept < st.target_len:
            kept = max(kept, min(common_prefix(st.ids, other.state.ids), other.state.target_len))
    gone = st.target_len - kept
    return gone if gone >= MIN_ROWS else 0


def choose(slots: list[Slot], free: list[int], full: list[int], cache) -> tuple[int, int]:
    def key(k: int) -> tuple:
        if lost(slots, k, full, cache):  # every free slot loses rows: the conversation left longest goes
            return False, False, 0, -slots[k].used
        return True, not displaced(slots[k], full), reusable(full, slots[k].state), -slots[k].used

    best = max(free, key=key)
    return best, lost(slots, best, full, cache)


def donor(slots: list[Slot], i: int, full: list[int]) -> tuple[int, int]:
    own = reusable(full, slots[i].state)
    best, rows = -1, own + MIN_ROWS - 1
    for j, slot in enumerate(slots):
        if j != i and (n := reusable(full, slot.state)) > rows:
            best, rows = j, n
    return (best, rows) if best >= 0 else (-1, 0)


def waits(slots: list[Slot], loss: int, background: bool) -> bool:
    busy = [s.ticket for s in slots if s.ticket is not None]
    return background and loss > 0 and any(t.background and t.paused is None for t in busy)
