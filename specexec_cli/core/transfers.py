"""The one door between host and device: every copy in draft, verify and commit goes through here.

Contract: the speculative step's hot path never calls `.cpu()`, `.item()`, `.tolist()` or
`int(tensor)` on a device tensor: `to_host` copies it and counts the call and its bytes in the
process-wide `COUNTER`. Small host-built tensors reach the device only through `upload`, which packs
any number into ONE counted copy and marks its outputs, so passing them on again is free. On CUDA
each counted copy is a synchronisation; calls are counted on the CPU too, so CPU tests check a GPU
run's transfer pattern. `snapshot`/`since` measure one step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TransferCount:
    """Device→host copies made through `to_host` (cumulative, or a difference of two snapshots)."""

    calls: int = 0  # copies either way (= blocking synchronisations on CUDA)
    bytes: int = 0  # payload bytes copied
    uploads: int = 0  # of `calls`, host→device copies (`upload`)


COUNTER = TransferCount()  # process-wide running total


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Copy `t` to the host (no-op on the CPU) and count the call and its bytes."""
    COUNTER.calls += 1
    COUNTER.bytes += t.numel() * t.element_size()
    return t.detach().cpu()


def uploaded(t: torch.Tensor) -> bool:
    """True for tensors already on an accelerator, or produced by `upload` (no copy needed)."""
    return t.device.type != "cpu" or getattr(t, "_specx_uploaded", False)


def upload(device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host-built long tensors -> the device in ONE counted copy, as marked views (uploaded ones pass through)."""
    device = torch.device(device)
    host = [t for t in tensors if not uploaded(t)]
    if not host or not tensors:
        return list(tensors)
    flat = torch.cat([t.reshape(-1).to(torch.long) for t in host])  # (sum numel,) one buffer
    COUNTER.calls += 1
    COUNTER.uploads += 1
    COUNTER.bytes += flat.numel() * flat.element_size()
    moved = flat.to(device, non_blocking=False)
    out, at = [], 0
    for t in tensors:
        if uploaded(t):
            out.append(t)
            continue
        view = moved[at : at + t.numel()].view(t.shape)
        view._specx_uploaded = True
        out.append(view)
        at += t.numel()
    return out


def snapshot() -> TransferCount:
    return TransferCount(COUNTER.calls, COUNTER.bytes, COUNTER.uploads)


def since(before: TransferCount) -> TransferCount:
    """Copies made after `before` was taken."""
    return TransferCount(COUNTER.calls - before.calls, COUNTER.bytes - before.bytes, COUNTER.uploads - before.uploads)
