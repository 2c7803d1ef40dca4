"""The one door between host and device: every copy in draft, verify and commit goes through here.

Contract: code on the speculative step's hot path never calls `.cpu()`, `.item()`, `.tolist()`
or `int(tensor)` on a tensor that may live on the device; it calls `to_host`,
which copies the tensor to the host and adds one call and its bytes to the process-wide
`COUNTER`. Small host-built tensors (token ids, positions, tree ancestor columns, kept cache rows)
reach the device only through `upload`, which packs any number of them into ONE copy and counts
it (`uploads` is the part of `calls` that went host→device). Its outputs are marked as uploaded:
passing one to `upload` again (e.g. staged ids and positions handed on to `kvcache.forward`) is
free and uncounted, on the CPU as on a GPU, so one step can stage everything a pass needs in one copy. On CUDA a device→host copy is a
blocking synchronisation and a pageable host→device copy of a fresh tensor one more, so the
counter is the step's synchronisation count. Calls are counted on the CPU too (where the copy is
a no-op), so CPU tests check the transfer pattern a GPU run would have: how many copies per draft
forward and per commit (constant in tree depth and in layer count) and how many bytes each
(which must not grow with the vocabulary). `snapshot`/`since` measure one step.
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
    """Host-built long tensors → the device in ONE counted copy: flattened, concatenated, moved,
    and split back into views of their shapes (marked, see `uploaded`). Tensors already uploaded
    pass through."""
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
