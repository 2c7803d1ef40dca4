"""offload: stream a causal LM's decoder layers from RAM or disk to the compute device.

Contract: the public API is `OffloadedCausalLM`, `parse_size`, `plan_offload`, `OffloadPlan`,
`OffloadError` (and `format_bytes`). This package never imports `specexec_cli`.
"""

from offload.errors import OffloadError
from offload.sizes import format_bytes, parse_size
from offload.stream.model import OffloadedCausalLM, OffloadStats
from offload.stream.placement import OffloadPlan, plan_offload

__all__ = [
    "OffloadError",
    "OffloadPlan",
    "OffloadStats",
    "OffloadedCausalLM",
    "format_bytes",
    "parse_size",
    "plan_offload",
]
