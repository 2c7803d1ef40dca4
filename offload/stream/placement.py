"""Placement plan: which decoder layers stay on the device, which stream from RAM or disk.

Contract: `plan_offload` is a pure function of per-layer byte sizes and budgets: the prefix of layers
that fits `max_device_memory` stays resident (None: every layer, tier "none"); the streamed rest get host
arenas while they fit `max_host_memory` (None: `free_ram`), the others are read from disk every pass.
`device_bytes` adds `slots` staging buffers of the largest streamed layer. `OffloadedCausalLM.plan` is it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from offload.sizes import format_bytes


@dataclass
class OffloadPlan:
    resident: list[int]
    streamed: list[int]
    ram_layers: list[int]
    disk_layers: list[int]
    layer_bytes: list[int]
    slots: int
    host_bytes: int
    device_bytes: int
    direct_io: bool | None = None  # set once the disk reader knows whether O_DIRECT works
    dense: list[int] = field(default_factory=list)  # resident layers whose packed linears are dequantized once

    @property
    def tier(self) -> str:
        if self.disk_layers:
            return "disk"
        return "ram" if self.streamed else "none"

    @property
    def bytes_per_layer(self) -> int:
        return max(self.layer_bytes) if self.layer_bytes else 0

    @property
    def slot_bytes(self) -> int:
        return max((self.layer_bytes[i] for i in self.streamed), default=0)

    def describe(self) -> str:
        """One line, e.g. `offload: 3 layers resident, 5 streamed from disk (O_DIRECT), 41.9 MB/layer`."""
        head = f"offload: {len(self.resident)} layers resident"
        per = f"{format_bytes(self.bytes_per_layer)}/layer"
        if not self.streamed:
            return f"{head}, none streamed, {per}"
        io = "O_DIRECT" if self.direct_io is not False else "buffered reads"
        if not self.disk_layers:
            src = "from RAM"
        elif not self.ram_layers:
            src = f"from disk ({io})"
        else:
            src = f"({len(self.ram_layers)} from RAM, {len(self.disk_layers)} from disk, {io})"
        return f"{head}, {len(self.streamed)} streamed {src}, {per}"


def plan_offload(
    layer_bytes: list[int], max_device_memory: int | None, max_host_memory: int | None, free_ram: int, slots: int = 2
) -> OffloadPlan:
    """Place layers: resident prefix within the device budget, then RAM, then disk."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    device_budget = float("inf") if max_device_memory is None else max_device_memory
    host_budget = free_ram if max_host_memory is None else max_host_memory
    n_resident = _fitting(layer_bytes, device_budget)
    resident = list(range(n_resident))
    streamed = list(range(n_resident, len(layer_bytes)))
    n_ram = _fitting([layer_bytes[i] for i in streamed], host_budget)
    ram_layers, disk_layers = streamed[:n_ram], streamed[n_ram:]
    used = sum(layer_bytes[:n_resident])
    host = sum(layer_bytes[i] for i in ram_layers)
    slot_bytes = max((layer_bytes[i] for i in streamed), default=0)
    device_bytes = used + (slots * slot_bytes if streamed else 0)
    return OffloadPlan(resident, streamed, ram_layers, disk_layers, list(layer_bytes), slots, host, device_bytes)


def _fitting(sizes: list[int], budget: float) -> int:
    """How many leading `sizes` fit `budget` together (sizes are >= 0: the running total never falls)."""
    return sum(1 for total in accumulate(sizes) if total <= budget)
