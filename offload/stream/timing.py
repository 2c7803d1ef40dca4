"""Wall time of one call on a device.

Contract: `device_seconds(fn, device)` runs `fn()` once and returns its seconds: on CUDA between two events
on the current stream (after a synchronize: earlier work is not counted), elsewhere by perf_counter.
"""

from __future__ import annotations

import time

import torch


def device_seconds(fn, device: torch.device) -> float:
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
