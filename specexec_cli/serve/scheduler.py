"""The forest thread of `specx serve`: up to --parallel N requests decode together, one target pass each step.

Contract: `Scheduler(session, parallel, metrics)` owns N slots (slots.py), each a `DecodeState` with
its own KV caches: slot 0 is the session's, the others are reserved at first use as the device-pool
component "kv_parallel" (`parallel_fit` sizes N from the memory plan). A worker thread's
`open(full, cfg, gen, cancelled, ...)` blocks until the forest thread admits the request at a pass
boundary into the slot slots.choose picks, made its best start (`_prepare`), and returns (events,
tokens to prefill): the events `ChatSession.decode` yields for one request alone. Closing the events
or `cancelled()` turning true takes the lane out at the next boundary, its committed rows kept; one
lane's error (OOM while adding it included) is raised from its events only. `close()` stops the
thread once no lane is left.
Admission: streamed requests (`interactive`) first, then by the caller's `seq`. A streamed request
finding every slot busy pauses a non-streamed lane (`Lane.pause`), which waits again ahead of later
non-streamed ones and resumes (`Lane.resume`) where it was; a ticket cancelled before it has a slot
leaves (`Withdrawn`). A request the caller took but has not opened (`expect(seq)`, then `open` or
`forget`) holds back later non-streamed ones. Tree shapes: --budget auto's `BudgetTuner.split(k)`,
fed every pass; else the --budget split evenly (core/forest.py `split_budget`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from specexec_cli.core import kvcache
from specexec_cli.core.engine import DecodeState, StepEvent
from specexec_cli.core.forest import FOREST_METHODS, Forest, Lane
from specexec_cli.errors import SpecxError
from specexec_cli.serve.slots import Slot, choose, donor, waits
from specexec_cli.session.prompt_cache import common_prefix, copy_prefix

END = object()  # a lane's queue sentinel: taken out of the forest without a finishing event


class Withdrawn(SpecxError):
    """open()'s request was cancelled (its client left, or the server stops) before it was admitted."""


@dataclass
class Ticket:
    """One request's way in and its events out."""

    full: list[int]  # the whole prompt's ids
    cfg: object  # its engine.GenerationConfig
    gen: object  # its torch.Generator
    cancelled: Callable[[], bool]  # true once the client went away or the server stops
    interactive: bool = False  # a streamed request: admitted first, and may pause a non-streamed lane
    background: bool = False  # a client's background task (limits.task_of): nobody continues its prompt
    seq: int = 0  # arrival order (first come, first served within a priority)
    admitted: threading.Event = field(default_factory=threading.Event)
    out: queue.Queue = field(default_factory=queue.Queue)  # StepEvents, then END or an exception
    prefill: int = 0  # tokens the admission left to prefill
    error: BaseException | None = None  # why admission refused it
    closed: bool = False  # the reader stopped reading (set from the worker thread)
    lane: Lane | None = None
    slot: int = -1
    paused: list[int] | None = None  # the committed ids of a lane paused for a streamed request

    def events(self) -> Iterator[StepEvent]:
        try:
            while True:
                item = self.out.get()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish:
                    return
        finally:
            self.closed = True


def parallel_fit(plan, wanted: int | None, method: str) -> tuple[int, str]:
    """(N, note): how many sequences the plan's memory holds (`wanted`; None: as many as fit, 1 to
    DEFAULT_PARALLEL; no plan: UNPLANNED_PARALLEL). Each sequence past the first adds its target and
    draft KV as "kv_parallel"; a forest pass holds every tree's hidden states, mask and logits rows
    while a prefill chunk runs: (sized budget + N - 1) x row_bytes as "forest_activations" (the trees
    together stay within the sized budget). An explicit N that does not fit is a SpecxError naming the fix."""
    if method not in FOREST_METHODS:
        if wanted not in (None, 1):
            raise SpecxError(f"--parallel {wanted} needs --method specexec or ar (this run uses --method {method})")
        return 1, ""
    if plan is None:
        return wanted or UNPLANNED_PARALLEL, ""
    per = plan.device_bytes.get("kv_target", 0) + plan.device_bytes.get("kv_draft", 0)
    room = plan.device_capacity - plan.device_total
    tree = (plan.sized_budget or plan.budget) * plan.row_bytes  # n > 1: every tree's rows in a forest pass
    fits = 1 + max(0, (room - tree) // (per + plan.row_bytes)) if per + plan.row_bytes else 1 << 30
    if wanted is not None:
        if wanted > fits:
            raise SpecxError(
                f"--parallel {wanted}: the memory plan has room for the KV caches and forest passes of {fits} "
                f"sequence{'s' if fits != 1 else ''} at --ctx {plan.ctx}; fix: --parallel {fits}, a smaller --ctx, "
                "or --offload ram (the memory resident layers take goes to the caches)"
            )
        n = wanted
    else:
        n = max(1, min(DEFAULT_PARALLEL, fits))
    if n > 1:
        plan.device_bytes["kv_parallel"] = (n - 1) * per
        plan.device_bytes["forest_activations"] = (n - 1) * plan.row_bytes + tree
    note = (
        ""
        if wanted is not None or n > 1
        else "--parallel 1: the memory plan has room for one sequence's KV caches only, so requests decode one at a time"
    )
    return n, note


DEFAULT_PARALLEL = 8  # the most sequences per pass --parallel's default takes (as many as the plan fits):
# bench/serve_parallel.py, 8 requests at once on the disk tier: --parallel 4 and 8 took
# 0.36x and 0.37x the wall of one at a time (2: 0.53x), 8 gave the first text soonest
UNPLANNED_PARALLEL = 2  # without a memory plan (nothing known of the room)


class Scheduler:
    def __init__(self, session, parallel: int, metrics):
        self.session, self.models, self.metrics = session, session.models, metrics
        self.slots = [Slot(session.state)] + [Slot(DecodeState()) for _ in range(parallel - 1)]
        self.tuner = getattr(session, "tuner", None)  # --budget auto: the speed model's split and its statistics
        self.forest = Forest(self.models, shape_for=self.tuner.split if self.tuner is not None else None)
        self.cv = threading.Condition()
        self.waiting: list[Ticket] = []
        self.closing = False
        self.expected: set[int] = set()  # seqs taken by the caller, not opened yet: later ones wait for them
        self.thread = threading.Thread(target=self._run, name="specx-forest", daemon=True)

    def close(self) -> None:
        with self.cv:
            self.closing = True
            self.cv.notify_all()
        if self.thread.is_alive():
            self.thread.join()

    def open(
        self, full: list[int], cfg, gen, cancelled: Callable[[], bool], *, seq: int, interactive: bool, background: bool
    ) -> tuple[Iterator[StepEvent], int]:
        ticket = Ticket(list(full), cfg, gen, cancelled, interactive, background, seq)
        with self.cv:
            self.expected.discard(ticket.seq)
            self.waiting.append(ticket)
            self.cv.notify_all()
        ticket.admitted.wait()
        if ticket.error is not None:
            raise ticket.error
        return ticket.events(), ticket.prefill

    def expect(self, seq: int) -> None:
        """The caller took request `seq` and will open it: no later non-streamed one is admitted first."""
        with self.cv:
            self.expected.add(seq)

    def forget(self, seq: int) -> None:
        """Request `seq` will not be opened (or was): the ones after it may go."""
        with self.cv:
            self.expected.discard(seq)
            self.cv.notify_all()

    def _held(self, ticket: Ticket) -> bool:
        """A new non-streamed ticket behind a request the caller took but has not opened yet (under cv)."""
        return (
            not ticket.interactive
            and ticket.lane is None
            and bool(self.expected)
            and ticket.seq > min(self.expected)
            and not ticket.cancelled()
        )

    # -- the forest thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cv:
                while all(self._held(t) for t in self.waiting) and not self.forest.lanes and not self.closing:
                    self.cv.wait()
                if self.closing and not self.forest.lanes:
                    for ticket in self.waiting:  # nothing is admitted once closing
                        self._refuse(ticket, SpecxError("the server is shutting down"))
                    return
                arrived = [t for t in self.waiting if not self._held(t)]
                self.waiting = [t for t in self.waiting if self._held(t)]
            try:
                self._admit(arrived)
                self._drop_stopped()
                if self.forest.lanes:
                    self._pass()
            except Exception as exc:  # noqa: BLE001 - never a dead forest thread: its requests fail, new ones go on
                for lane in list(self.forest.lanes):
                    self.forest.remove(lane)
                    self._release(lane.ticket, exc)
                for ticket in arrived:
                    unplaced = not ticket.admitted.is_set() if ticket.lane is None else ticket.slot < 0
                    if unplaced and not any(t is ticket for t in self.waiting):
                        self._refuse(ticket, exc)

    @staticmethod
    def _refuse(ticket: Ticket, exc: BaseException) -> None:
        """`ticket` fails without a slot: a new one in open(), a paused one in its events."""
        if ticket.lane is not None:
            ticket.out.put(exc)  # END: taken out quietly
        else:
            ticket.error = exc
        ticket.admitted.set()

    def _admit(self, arrived: list[Ticket]) -> None:
        """Admit in order (module docstring); a non-streamed ticket that waits (no slot free, or
        slots.waits) holds back the non-streamed ones after it."""
        held = False
        for ticket in sorted(arrived, key=lambda t: (not t.interactive, t.seq)):
            if ticket.closed or ticket.cancelled():  # gone before it (re)joined: no prefill for nobody
                self._refuse(ticket, END if ticket.lane is not None else Withdrawn("withdrawn"))
                continue
            i = -1 if held and not ticket.interactive else self._place(ticket)
            if i < 0:  # the worker runs at most N requests: a slot frees at the next boundary
                held = held or not ticket.interactive
                with self.cv:
                    self.waiting.append(ticket)
                continue
            try:
                self._start(ticket, i)
            except Exception as exc:  # noqa: BLE001 - refused (OOM reserving its caches: a 400), others go on
                self._reset(i)
                if ticket.lane is not None:  # a paused one: its reader is past open(), the error ends it
                    self._release(ticket, exc)
                ticket.error = exc
            ticket.admitted.set()

    def _place(self, ticket: Ticket) -> int:
        """The slot `ticket` takes now, or -1: it waits (module docstring, slots.py)."""
        free = [i for i, s in enumerate(self.slots) if s.ticket is None]
        if not free and ticket.interactive:
            free = self._pause_for(ticket)
        if not free:
            return -1
        want = ticket.full if ticket.paused is None else ticket.paused
        cache = self.session.prompt_cache
        i, loss = choose(self.slots, free, want, cache)
        if loss and cache is not None and ticket.background and cache.keep(self.slots[i].state, want):
            loss = 0  # the prompt cache took the conversation's rows: nothing is lost
        return -1 if waits(self.slots, loss, ticket.background) else i

    def _pause_for(self, ticket: Ticket) -> list[int]:
        """Pause the non-streamed lane whose slot suits `ticket` best; [its slot] or [] when every lane
        is streamed. Its rows stay in the slot until the newcomer rewinds them (the prompt cache keeps them)."""
        busy = [i for i, s in enumerate(self.slots) if s.ticket is not None and not s.ticket.interactive]
        if not busy:
            return []
        i = max(busy, key=lambda k: self._fit(ticket.full, k))
        other = self.slots[i].ticket
        other.paused = other.lane.pause()
        self.forest.remove(other.lane)
        self.slots[i].ticket, other.slot = None, -1
        self.slots[i].background = False  # its rows resume later: the prompt cache keeps them
        with self.cv:
            self.waiting.append(other)
        return [i]

    def _fit(self, full: list[int], k: int) -> tuple[int, float]:
        """Slot k's worth for `full` (the largest wins)."""
        ids = self.slots[k].state.ids
        reuse = common_prefix(full, ids)
        return reuse - (len(ids) - reuse), -self.slots[k].used

    def _start(self, ticket: Ticket, i: int) -> None:
        slot, m = self.slots[i], self.models
        if i > 0 and m.kv_rows is not None:  # slot 0 is the session's, reserved as "kv_target"/"kv_draft"
            kvcache.reserve(slot.state.target_cache, m.target, m.kv_rows[0], m.pool, "kv_parallel")
            if m.draft is not None and not m.shared_kv:
                kvcache.reserve(slot.state.draft_cache, m.draft, m.kv_rows[1], m.pool, "kv_parallel")
        st = slot.state
        ids = self._prepare(ticket.full if ticket.paused is None else ticket.paused, i)
        if ticket.paused is not None:  # a paused lane goes on from its committed ids
            lane = ticket.lane
            lane.resume(st, ids)
            ticket.paused = None
        else:
            ticket.prefill = len(st.ids) + len(ids) - st.target_len
            lane = Lane(m, st, ids, ticket.cfg, ticket.gen)
            lane.ticket = ticket
        ticket.lane, ticket.slot = lane, i
        slot.ticket, slot.used, slot.background = ticket, time.perf_counter(), ticket.background
        self.forest.add(lane)

    def _prepare(self, want: list[int], i: int) -> list[int]:
        """Slot i made the best start for `want` (its rows kept, a donor's prefix, a restore); the ids to prefill."""
        slot, cache = self.slots[i], self.session.prompt_cache
        if cache is not None and not slot.background:
            cache.keep(slot.state, want)
        j, rows = donor(self.slots, i, want)
        if j >= 0:
            copy_prefix(self.slots[j].state, slot.state, rows, self.models)
        return self.session.prefill_ids(want, slot.state, save=False)

    def _reset(self, i: int) -> None:
        """A slot whose admission failed: an extra slot starts over (its caches may be half reserved),
        the session's own keeps its committed rows only."""
        if i > 0:
            self.slots[i] = Slot(DecodeState())
            return
        st = self.slots[0].state
        kvcache.crop(st.target_cache, st.target_len)
        kvcache.crop(st.draft_cache, st.draft_len)

    def _release(self, ticket: Ticket, item=None) -> None:
        if item is not None:
            ticket.out.put(item)
        if ticket.slot >= 0:
            self.slots[ticket.slot].ticket = None

    def _drop_stopped(self) -> None:
        for lane in list(self.forest.lanes):
            ticket = lane.ticket
            if ticket.closed or ticket.cancelled():
                self.forest.remove(lane)  # committed rows stay: a follow-up request reuses them
                self._release(ticket, END)

    def _pass(self) -> None:
        n = len(self.forest.lanes)
        tokens = 0
        for lane, ev in self.forest.step():
            if isinstance(ev, BaseException):
                self._release(lane.ticket, ev)
            elif ev is not None:
                tokens += len(ev.tokens)
                if self.tuner is not None:
                    self.tuner.observe(ev, budget=lane.shape.budget, pass_tokens=self.forest.last_tokens)
                lane.ticket.out.put(ev)
                if ev.finish:
                    self._release(lane.ticket)
        self.metrics.forest_pass(n, tokens)
