"""The self-draft: the target's own layers at 3 or 2 bits (HQQ) or nf4, as a draft model.

Contract: `build` assembles the draft from the target's Checkpoint and quantized substitutes;
`influence` measures which layers matter most for the draft's agreement. Above `stream`.
The public API is `__all__`, re-exported lazily (offload/lazy.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offload.lazy import lazy_getattr

if TYPE_CHECKING:
    from offload.selfdraft.build import LAYER_SKIP, build_self_draft, sixteen_bit_source, streamed_layers, target_layers
    from offload.selfdraft.influence import (
        CALIBRATION,
        layer_influence,
        pick_skipped,
        rule_order,
        store_influence,
        stored_influence,
    )

_LAZY = {  # name here -> (module, name there)
    "LAYER_SKIP": ("offload.selfdraft.build", "LAYER_SKIP"),
    "build_self_draft": ("offload.selfdraft.build", "build_self_draft"),
    "sixteen_bit_source": ("offload.selfdraft.build", "sixteen_bit_source"),
    "streamed_layers": ("offload.selfdraft.build", "streamed_layers"),
    "target_layers": ("offload.selfdraft.build", "target_layers"),
    "CALIBRATION": ("offload.selfdraft.influence", "CALIBRATION"),
    "layer_influence": ("offload.selfdraft.influence", "layer_influence"),
    "pick_skipped": ("offload.selfdraft.influence", "pick_skipped"),
    "rule_order": ("offload.selfdraft.influence", "rule_order"),
    "store_influence": ("offload.selfdraft.influence", "store_influence"),
    "stored_influence": ("offload.selfdraft.influence", "stored_influence"),
}

__all__ = [
    "CALIBRATION",
    "LAYER_SKIP",
    "build_self_draft",
    "layer_influence",
    "pick_skipped",
    "rule_order",
    "sixteen_bit_source",
    "store_influence",
    "stored_influence",
    "streamed_layers",
    "target_layers",
]


__getattr__ = lazy_getattr(__name__, _LAZY)  # the names of _LAZY, looked up in their modules at each use
