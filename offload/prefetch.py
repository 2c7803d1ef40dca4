"""Layer prefetcher: yields streamed layer i on the device while layer i+1.. are being loaded.

Contract (one protocol for every tier and device):
    pf = Prefetcher(order, load, slots, device)      # load(layer, slot) -> device buffer
    for layer_id, buf in pf.pass_():                 # streamed layers, in `order`
        compute(layer_id, buf)                       # buf valid until the generator resumes
    pf.close()
- The k-th streamed layer of a pass goes to slot k % slots. Jobs run FIFO on ONE background
  thread (the "copy engine"): at most `slots` layers are in flight or ready at once.
- Resuming the generator releases the slot just used and queues the layer `slots` ahead into
  it. When a pass ends, the first `slots` layers of the NEXT pass are queued at once, so their
  transfer overlaps whatever the caller does between passes (the draft's tree growth).
- CUDA: jobs run under a side stream. The job first waits (stream.wait_event) on the event the
  compute stream recorded when it released the slot, issues the copy, and records a ready
  event; the compute stream waits on that event before using the buffer. Buffers are marked
  with record_stream. No device-wide synchronize anywhere.
- If a pass is abandoned (exception mid-forward), in-flight jobs are drained and the next pass
  starts clean.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import torch


class Prefetcher:
    def __init__(self, order: list[int], load: Callable[[int, int], torch.Tensor], slots: int,
                 device: torch.device, is_free: Callable[[int], bool] | None = None):
        self.order, self.load, self.slots, self.device = list(order), load, slots, device
        self.is_free = is_free   # layers whose load is a no-op run inline, same protocol
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.free_events: list = [None] * slots
        self.pending: dict[int, Future] = {}
        self.wait_seconds = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-copy") if order else None

    def _job(self, layer: int, slot: int, free_event):
        if not self.cuda:
            return self.load(layer, slot), None
        with torch.cuda.stream(self.copy_stream):
            if free_event is not None:
                self.copy_stream.wait_event(free_event)
            buf = self.load(layer, slot)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        return buf, ready

    def _submit(self, k: int) -> None:
        if k in self.pending or k >= len(self.order):
            return
        slot, layer = k % self.slots, self.order[k]
        if self.is_free is not None and self.is_free(layer):
            # Nothing to move (RAM tier on CPU: the arena is the device buffer): no thread hop.
            fut: Future = Future()
            fut.set_result(self._job(layer, slot, None))
            self.pending[k] = fut
            return
        self.pending[k] = self._pool.submit(self._job, layer, slot, self.free_events[slot])

    def _release(self, k: int, buf: torch.Tensor) -> None:
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            buf.record_stream(stream)
            ev = torch.cuda.Event()
            ev.record(stream)
            self.free_events[k % self.slots] = ev

    def prefetch_next_pass(self) -> None:
        """Queue the first `slots` layers of a pass (no-op for those already queued)."""
        for k in range(min(self.slots, len(self.order))):
            self._submit(k)

    def pass_(self) -> Iterator[tuple[int, torch.Tensor]]:
        if not self.order:
            return
        finished = False
        try:
            self.prefetch_next_pass()
            for k, layer in enumerate(self.order):
                self._submit(k)
                t0 = time.perf_counter()
                buf, ready = self.pending.pop(k).result()
                self.wait_seconds += time.perf_counter() - t0
                if ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(ready)
                yield layer, buf
                self._release(k, buf)
                self._submit(k + self.slots)
            finished = True
        finally:
            if not finished:
                self._drain()
        self.prefetch_next_pass()

    def _drain(self) -> None:
        for fut in self.pending.values():
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the pass already failed; its error propagates
                pass
        self.pending.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._drain()
            self._pool.shutdown(wait=True)
            self._pool = None
