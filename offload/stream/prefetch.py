"""Layer prefetcher: a ring of staging slots that keeps the weight stream busy across passes.

Contract:
    pf = Prefetcher(order, store, device)   # store: storage.LayerStore (read, copy, slots, host_slots, is_free)
    for layer_id, buf in pf.pass_():     # streamed layers, in `order`
        compute(layer_id, buf)           # buf valid until the generator resumes
    pf.close()
- Two stages, each on ONE background thread: A reads layer j into host slot j % host_slots (inline for a
  RAM arena, `store.is_free`); B (CUDA only) copies it into device slot j % slots on a side stream.
  A(j) waits for the slot's previous user (CPU: compute released j - host_slots; CUDA: copy
  B(j - host_slots)); B(j) for compute to release j - slots. The ring runs past a pass's end: the next
  pass's first layers load while the caller drafts. Jobs of an abandoned pass are discarded.
- CUDA: ordered by events only (no `record_stream`, no device-wide synchronize); `close()` waits for
  copies in flight.
- `link_busy_seconds(now)`: cumulative link time (CPU: read jobs; CUDA: completed copy events);
  `stall_seconds`: time compute waited for a layer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Prefetcher:
    def __init__(self, order: list[int], store, device: torch.device):
        self.order, self.read, self.copy, self.device = list(order), store.read, store.copy, device
        n = max(1, len(self.order))
        self.cuda = device.type == "cuda"
        self.slots = max(1, min(store.slots, n))  # device slots (D)
        self.host_slots = max(self.slots, min(store.host_slots or store.slots, n))  # host staging slots (H >= D)
        self.is_free = store.is_free
        self.copy_stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.free_events: list = [None] * self.slots  # CUDA: compute released device slot d
        self.jobs_a: dict[int, tuple[int, Future]] = {}  # seq -> (pass id, read future)
        self.jobs_b: dict[int, tuple[int, Future]] = {}  # seq -> (pass id, copy future), CUDA
        self.host_owner: dict[int, Future] = {}  # host slot -> copy future of its last layer
        self.pass_id = 1  # id of the pass that consumes seqs [start, start + len(order))
        self.start = 0
        self.started = False  # has pass `pass_id` begun?
        self.next_a = self.next_b = 0  # next seq to submit to each stage
        self.stall_seconds = 0.0
        self._busy_lock = threading.Lock()
        self._busy_done = 0.0  # completed link time (CPU: read jobs)
        self._busy_t0: float | None = None  # start of the read job now running (CPU)
        self._timed: list = []  # CUDA: (start, end) events of issued copies
        self._pool_a = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-read") if order else None
        self._pool_b = ThreadPoolExecutor(1, thread_name_prefix="offload-copy") if order and self.cuda else None

    # ------------------------------------------------------------ jobs (background threads)

    def _job_a(self, layer: int, h: int, prev_copy: Future | None) -> torch.Tensor:
        if prev_copy is not None:  # CUDA: host slot h still feeds the copy of seq j - host_slots
            _, ready = prev_copy.result()
            ready.synchronize()  # waits for that one copy only, on this thread
        with self._busy_lock:
            self._busy_t0 = time.perf_counter()
        try:
            return self.read(layer, h)
        finally:
            with self._busy_lock:
                self._busy_done += time.perf_counter() - self._busy_t0
                self._busy_t0 = None

    def _job_b(self, layer: int, d: int, fut_a: Future, free_event):
        host = fut_a.result()
        with torch.cuda.stream(self.copy_stream):
            if free_event is not None:
                self.copy_stream.wait_event(free_event)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
            buf = self.copy(layer, host, d)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record(self.copy_stream)
        with self._busy_lock:
            self._timed.append((start, ready))
        return buf, ready

    # ------------------------------------------------------------ submission (caller's thread)

    def _tag(self, seq: int) -> int:
        return self.pass_id + (seq - self.start) // len(self.order)

    def _submit_a(self, seq: int) -> None:
        layer, h = self.order[(seq - self.start) % len(self.order)], seq % self.host_slots
        if self.is_free is not None and self.is_free(layer):  # nothing to move: no thread hop (None: never)
            fut = Future()
            fut.set_result(self.read(layer, h))
        else:
            fut = self._pool_a.submit(self._job_a, layer, h, self.host_owner.get(h) if self.cuda else None)
        self.jobs_a[seq] = (self._tag(seq), fut)
        self.next_a = seq + 1

    def _submit_b(self, seq: int) -> None:
        layer, d = self.order[(seq - self.start) % len(self.order)], seq % self.slots
        _, fut_a = self.jobs_a.pop(seq)
        fut = self._pool_b.submit(self._job_b, layer, d, fut_a, self.free_events[d])
        self.host_owner[seq % self.host_slots] = fut
        self.jobs_b[seq] = (self._tag(seq), fut)
        self.next_b = seq + 1

    def _fill(self, released: int) -> None:
        """Queue every job the ring allows once compute released all seqs < `released`."""
        if not self.cuda:
            while self.next_a < released + self.host_slots:
                self._submit_a(self.next_a)
            return
        while True:
            if self.next_b < min(released + self.slots, self.next_a):
                self._submit_b(self.next_b)
            elif self.next_a < self.next_b + self.host_slots:
                self._submit_a(self.next_a)
            else:
                return

    def _take(self, seq: int) -> torch.Tensor:
        jobs = self.jobs_b if self.cuda else self.jobs_a
        _, fut = jobs.pop(seq)
        t0 = time.perf_counter()
        out = fut.result()
        self.stall_seconds += time.perf_counter() - t0
        if not self.cuda:
            return out
        buf, ready = out
        torch.cuda.current_stream(self.device).wait_event(ready)
        return buf

    def _release(self, seq: int, buf: torch.Tensor) -> None:
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            ev = torch.cuda.Event()  # the copy into this slot after the next ring turn waits on it
            ev.record(stream)
            self.free_events[seq % self.slots] = ev

    def pass_(self) -> Iterator[tuple[int, torch.Tensor]]:
        if not self.order:
            return
        if self.started:  # the previous pass ran (to its end or not)
            self.pass_id += 1
            self.start += len(self.order)
        self.started = True
        stale = [seq for seq, (tag, _) in (*self.jobs_a.items(), *self.jobs_b.items()) if tag != self.pass_id]
        if stale:  # left by a pass abandoned halfway: never hand them out
            self._drain()
            self.start = self.next_a = self.next_b = max(self.next_a, self.next_b)
        begin = self.start
        for k, layer in enumerate(self.order):
            seq = begin + k
            self._fill(seq)
            buf = self._take(seq)
            yield layer, buf
            self._release(seq, buf)
        self._fill(begin + len(self.order))  # the next pass's first layers, right away

    # ------------------------------------------------------------ accounting and shutdown

    def link_busy_seconds(self, now: float | None = None) -> float:
        """Cumulative link time up to `now` (perf_counter); CUDA counts copies whose events completed."""
        with self._busy_lock:
            if self.cuda:
                keep = []
                for start, end in self._timed:
                    if end.query():
                        self._busy_done += start.elapsed_time(end) / 1e3
                    else:
                        keep.append((start, end))
                self._timed = keep
                return self._busy_done
            running = self._busy_t0
            busy = self._busy_done
        if running is not None:
            busy += max(0.0, (time.perf_counter() if now is None else now) - running)
        return busy

    def wait_idle(self) -> None:
        """Block until every queued job finished (measurement helper; keeps their results)."""
        for _, fut in (*self.jobs_a.values(), *self.jobs_b.values()):
            fut.exception()

    def _drain(self) -> None:
        for _, fut in (*self.jobs_a.values(), *self.jobs_b.values()):
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the pass that queued it already failed
                pass
        self.jobs_a.clear()
        self.jobs_b.clear()
        self.host_owner.clear()

    def close(self) -> None:
        """Wait for every job and for copies still in flight on the copy stream, then stop the
        threads: the slots and pinned buffers may be freed (or unpinned) right after (idempotent)."""
        if self._pool_a is None and self._pool_b is None:
            return
        self._drain()
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # issued != finished: the DMA may still read host memory
        for pool in (self._pool_a, self._pool_b):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool_a = self._pool_b = None
