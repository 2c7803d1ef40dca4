"""offload: stream a causal LM's decoder layers from RAM or disk to the compute device.

Contract: the public API is `OffloadedCausalLM`, `parse_size`, `plan_offload`, `OffloadPlan`,
`OffloadError` (and `format_bytes`), imported with the package. This package never imports
`specexec_cli`; specexec_cli imports offload only through this module and three package facades,
`offload.formats`, `offload.planning` and `offload.selfdraft`, each with its `__all__`.
The rest of `__all__` is what a front end needs of the engine, quantizers and model support,
re-exported lazily (offload/lazy.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offload.errors import OffloadError
from offload.lazy import lazy_getattr
from offload.sizes import format_bytes, parse_size
from offload.stream.model import OffloadedCausalLM
from offload.stream.placement import OffloadPlan, plan_offload

if TYPE_CHECKING:
    from offload.arch.attention import implementation as gqa_attention
    from offload.arch.hfcompat import cache_kwargs
    from offload.arch.moe import Expert, ExpertList
    from offload.quant.dense import densify
    from offload.quant.lowbit import LowbitLinear
    from offload.quant.lowbit import quantize_weight as lowbit_quantize_weight
    from offload.quant.nf4 import packing_for
    from offload.quant.quant_cache import cache_dir as nf4_cache_dir
    from offload.quant.quant_cache import cache_key as nf4_cache_key
    from offload.quant.quant_cache import is_complete as nf4_cache_complete
    from offload.quant.quant_cache import write_quantized
    from offload.stream.devmem import DevicePool
    from offload.stream.loader import accelerator_half
    from offload.stream.multi import ForwardJob, forward_many

_LAZY = {  # name here -> (module, name there)
    "gqa_attention": ("offload.arch.attention", "implementation"),
    "cache_kwargs": ("offload.arch.hfcompat", "cache_kwargs"),
    "Expert": ("offload.arch.moe", "Expert"),
    "ExpertList": ("offload.arch.moe", "ExpertList"),
    "densify": ("offload.quant.dense", "densify"),
    "LowbitLinear": ("offload.quant.lowbit", "LowbitLinear"),
    "lowbit_quantize_weight": ("offload.quant.lowbit", "quantize_weight"),
    "packing_for": ("offload.quant.nf4", "packing_for"),
    "nf4_cache_dir": ("offload.quant.quant_cache", "cache_dir"),
    "nf4_cache_key": ("offload.quant.quant_cache", "cache_key"),
    "nf4_cache_complete": ("offload.quant.quant_cache", "is_complete"),
    "write_quantized": ("offload.quant.quant_cache", "write_quantized"),
    "DevicePool": ("offload.stream.devmem", "DevicePool"),
    "accelerator_half": ("offload.stream.loader", "accelerator_half"),
    "ForwardJob": ("offload.stream.multi", "ForwardJob"),
    "forward_many": ("offload.stream.multi", "forward_many"),
}

__all__ = [
    "DevicePool",
    "Expert",
    "ExpertList",
    "ForwardJob",
    "LowbitLinear",
    "OffloadError",
    "OffloadPlan",
    "OffloadedCausalLM",
    "accelerator_half",
    "cache_kwargs",
    "densify",
    "format_bytes",
    "forward_many",
    "gqa_attention",
    "lowbit_quantize_weight",
    "nf4_cache_complete",
    "nf4_cache_dir",
    "nf4_cache_key",
    "packing_for",
    "parse_size",
    "plan_offload",
    "write_quantized",
]


__getattr__ = lazy_getattr(__name__, _LAZY)  # the names of _LAZY, looked up in their modules at each use
