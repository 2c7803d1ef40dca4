"""The memory plan and the cost model: what fits on the device and what a pass costs.

Contract: `membytes` and `memlayers` count bytes per component; `request` holds the plan's request and
result types and the margins; `memplan` fits the components into a device budget; `experts` places a
mixture of experts' routed experts and prices their passes (`expertcost`, `splitcost`); `selfplan` plans
the self-draft's widths; `passcost` models one pass on a device's rates and `draftcost` each draft
candidate's tokens per second. Imports inside the package run one way, at module level (memplan >
selfplan > draftcost > experts > expertcost > passcost, request, membytes). Pure arithmetic over headers
and card figures: it reads no weights. Nothing else in `offload` imports it. The public API is `__all__`,
re-exported lazily (offload.lazy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offload.lazy import lazy_getattr

if TYPE_CHECKING:
    from offload.planning.draftcost import LINK_EFFICIENCY, PLAIN
    from offload.planning.membytes import arch_of
    from offload.planning.memplan import plan_memory
    from offload.planning.passcost import GGUF_KERNEL, PRIORS, dequant_elems, device_for, interpolate
    from offload.planning.request import RAM_FRACTION, PlanRequest
    from offload.planning.selfplan import default_skip

_LAZY = {  # name here -> (module, name there)
    "LINK_EFFICIENCY": ("offload.planning.draftcost", "LINK_EFFICIENCY"),
    "PLAIN": ("offload.planning.draftcost", "PLAIN"),
    "arch_of": ("offload.planning.membytes", "arch_of"),
    "RAM_FRACTION": ("offload.planning.request", "RAM_FRACTION"),
    "PlanRequest": ("offload.planning.request", "PlanRequest"),
    "plan_memory": ("offload.planning.memplan", "plan_memory"),
    "GGUF_KERNEL": ("offload.planning.passcost", "GGUF_KERNEL"),
    "PRIORS": ("offload.planning.passcost", "PRIORS"),
    "dequant_elems": ("offload.planning.passcost", "dequant_elems"),
    "device_for": ("offload.planning.passcost", "device_for"),
    "interpolate": ("offload.planning.passcost", "interpolate"),
    "default_skip": ("offload.planning.selfplan", "default_skip"),
}

__all__ = [
    "GGUF_KERNEL",
    "LINK_EFFICIENCY",
    "PLAIN",
    "PRIORS",
    "RAM_FRACTION",
    "PlanRequest",
    "arch_of",
    "default_skip",
    "dequant_elems",
    "device_for",
    "interpolate",
    "plan_memory",
]


__getattr__ = lazy_getattr(__name__, _LAZY)  # the names of _LAZY, looked up in their modules at each use
