"""The one door from the device to the host: every device→host copy in draft, verify and commit.

Contract: code on the speculative step's hot path never calls `.cpu()`, `.item()`, `.tolist()`
or `int(tensor)` on a tensor that may live on the device; it calls `to_host` (or `host_list`),
which copies the tensor to the host and adds one call and its bytes to the process-wide
`COUNTER`. Each call is one blocking synchronisation on CUDA, so the counter is the step's
synchronisation count. Calls are counted on the CPU too (where the copy is a no-op), so CPU tests
can check the transfer pattern a GPU run would have: how many copies per draft forward and how
many bytes each (which must not grow with the vocabulary). `snapshot`/`since` measure one step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TransferCount:
    """Device→host copies made through `to_host` (cumulative, or a difference of two snapshots)."""

    calls: int = 0  # copies (= blocking synchronisations on CUDA)
    bytes: int = 0  # payload bytes copied


COUNTER = TransferCount()  # process-wide running total


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Copy `t` to the host (no-op on the CPU) and count the call and its bytes."""
    COUNTER.calls += 1
    COUNTER.bytes += t.numel() * t.element_size()
    return t.detach().cpu()


def host_list(t: torch.Tensor) -> list:
    """`to_host(t).tolist()`: a device tensor as Python numbers, in one counted copy."""
    return to_host(t).tolist()


def snapshot() -> TransferCount:
    return TransferCount(COUNTER.calls, COUNTER.bytes)


def since(before: TransferCount) -> TransferCount:
    """Copies made after `before` was taken."""
    return TransferCount(COUNTER.calls - before.calls, COUNTER.bytes - before.bytes)
