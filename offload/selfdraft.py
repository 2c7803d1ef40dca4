"""The target's own low-bit substitute as its draft (`--draft self`, after SubSpec).

Contract: `build_self_draft(target, source, progress)` returns an `OffloadedCausalLM` that runs the
target's architecture where
- the embeddings, final norm, lm_head, rotary buffers and every RESIDENT decoder layer are the
  target's own module objects (shared by reference: no second copy, no second read), and
- every layer the target STREAMS is replaced by a 4-bit NF4 substitute (bitsandbytes blocksize
  64, double-quantized) that stays on the device, so the draft never touches the weight stream.
The substitutes are the packed weights of the target's nf4 cache (offload/quant_cache.py): built
once from the 16-bit checkpoint with a progress bar, reused on later loads, rebuilt when the
checkpoint changes or the cache is incomplete. `SelfDraftError` (an OffloadError) says in one
line why no self-draft can be built: nothing streams, or the target already is 4-bit (its
substitutes would be the target itself). Device bytes of the substitutes are counted in their
own DevicePool (`draft.pool`); the caller adds them to its plan's "draft" component.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .errors import OffloadError
from .loader import Subset
from .prequant import bnb4_config

SUBSTITUTE_BITS = 4


class SelfDraftError(OffloadError):
    """No self-draft for this target (the message names why and the fix)."""


def streamed_layers(target) -> list[int]:
    """Decoder layers the target does not keep on the device: the ones a substitute replaces."""
    return sorted(set(range(len(target.layers))) - set(target.plan.resident))


def check_self_draft(target, source: Path) -> list[int]:
    """The layers to substitute, or SelfDraftError when a self-draft makes no sense here."""
    if bnb4_config(target.config) is not None or getattr(target, "nf4", False):
        raise SelfDraftError("--draft self: the target is already 4-bit, so 4-bit substitutes would be the "
                             "target itself; fix: load the target in 16 bits (--dtype bf16) or pass a small --draft DIR")
    layers = streamed_layers(target)
    if not layers:
        raise SelfDraftError("--draft self: every target layer is resident, so there is nothing to substitute")
    return layers


def build_self_draft(target, source: str | Path, progress: Callable[[int, int, str], None] | None = None):
    """The self-draft of an OffloadedCausalLM `target` loaded from `source` (see the contract)."""
    from .devmem import DevicePool
    from .model import OffloadedCausalLM

    layers = check_self_draft(target, Path(source))
    shared = (target.embed_tokens, target.norm, target.lm_head, target.rotary_emb)
    draft = OffloadedCausalLM.from_pretrained(
        source, device=target.device, dtype="nf4", offload="none", progress=progress,
        pool=DevicePool(target.device), subset=Subset(frozenset(layers), shared), nf4_compute=target.dtype)
    for i in range(len(draft.layers)):
        if i not in layers:
            draft.layers[i] = target.layers[i]   # resident in the target: the same module, bound once
    draft.substituted = layers
    return draft


def substitute_bytes(draft) -> int:
    """Device bytes the substitutes hold (packed weights, quant states, norms)."""
    return draft.pool.allocated


def shares_with(draft, target) -> bool:
    """True when every module the draft should borrow is the target's own object."""
    same = [draft.embed_tokens is target.embed_tokens, draft.norm is target.norm,
            draft.lm_head is target.lm_head, draft.rotary_emb is target.rotary_emb]
    same += [draft.layers[i] is target.layers[i] for i in target.plan.resident]
    return all(same)
