"""The target's own low-bit substitute as its draft (`--draft self`, after SubSpec).

Contract: `build_self_draft(target, progress, bits, skip)` returns an `OffloadedCausalLM` of the target's
architecture whose embeddings, final norm, lm_head, rotary buffers and RESIDENT decoder layers are the
target's own module objects (no second copy; a packed Q8_0 head is read over 8-bit activations,
`draft_head`), and whose STREAMED layers are low-bit substitutes that stay on the device (or, for the
layers in `skip`, pass-throughs), so the draft never touches the weight stream: `bits` 4 = NF4 (the
target's nf4 cache, quant/quant_cache.py), 3 or 2 = HQQ (quant/lowbit.py), both built once from the
16-bit checkpoint. `SelfDraftError` (an OffloadError) says in one line why there is none (4-bit
substitutes of a 4-bit target, no 16-bit weights, a mixture-of-experts target). Where NOTHING streams,
`build_self_draft` (with `skip`) or `build_skip_draft(target, skip)` returns the layer-skip self-draft
(LayerSkip, SWIFT, Draft & Verify): the target's own modules with the `skip` layers as pass-throughs,
`substitute_bits` LAYER_SKIP. Substitutes' device bytes are counted in `draft.pool`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from offload.arch.moe import MOE_FAMILIES
from offload.cpu.ggml_kernel import PackedHead
from offload.cpu.leanstack import LeanStack
from offload.errors import OffloadError
from offload.formats.prequant import bnb4_config
from offload.stream.loader import Subset
from offload.stream.model import PACKED_FORMATS

SUBSTITUTE_BITS = (4, 3, 2)
LAYER_SKIP = 0  # `substitute_bits` of the layer-skip self-draft: no substitutes, the target's layers, some left out
MOE_REFUSED = (
    "--draft self: a mixture-of-experts target has no low-bit substitutes yet (all layers resident, "
    "--offload none, it drafts by skipping layers); fix: a small --draft DIR, or --method ar"
)


class SelfDraftError(OffloadError):
    """No self-draft for this target (the message names why and the fix)."""


def streamed_layers(target) -> list[int]:
    """Decoder layers the target does not keep on the device (none for an HF-resident target)."""
    if getattr(target, "plan", None) is None:
        return []
    return sorted(set(range(len(target.layers))) - set(target.plan.resident))


def _format(target) -> str:
    ck = getattr(target, "checkpoint", None)
    return ck.format if ck is not None else ("bnb-nf4" if bnb4_config(target.config) is not None else "bf16")


def _opened(target, source):
    """The target's opened Checkpoint where `source` is its path (not opened again), else `source`."""
    ck = getattr(target, "checkpoint", None)
    return ck if ck is not None and Path(ck.path) == Path(source) else source


def sixteen_bit_source(target) -> Path | None:
    """The 16-bit checkpoint behind `target`: its source (a packed int4 one's is dequantized), or the one its
    nf4 cache was built from (None for a pre-quantized bitsandbytes checkpoint)."""
    from offload.quant.quant_cache import manifest_source

    source = Path(target.source)
    return source if _format(target) != "bnb-nf4" else manifest_source(source)


def check_self_draft(target, bits: int = 4) -> list[int]:
    """The layers to substitute, or SelfDraftError when a self-draft makes no sense here."""
    if bits not in SUBSTITUTE_BITS:
        raise SelfDraftError(f"--draft-bits must be 4, 3 or 2 (got {bits})")
    if getattr(target.config, "model_type", None) in MOE_FAMILIES:
        raise SelfDraftError(MOE_REFUSED)
    quantized = _format(target) in ("bnb-nf4", *PACKED_FORMATS)  # packed int4: substitutes from dequantized weights
    if quantized and bits == 4:
        raise SelfDraftError(
            "--draft self: the target is already 4-bit, so 4-bit substitutes would be the "
            "target itself; fix: --draft-bits 3 or 2, load the target in 16 bits (--dtype bf16), "
            "or pass a small --draft DIR"
        )
    if quantized and sixteen_bit_source(target) is None:
        raise SelfDraftError(
            "--draft self: a pre-quantized checkpoint has no 16-bit weights to make substitutes "
            "from; fix: --target the 16-bit checkpoint with --dtype nf4, or a small --draft DIR"
        )
    return streamed_layers(target)  # [] when every layer is resident: the layer-skip draft


class PassThrough(nn.Module):
    """A decoder layer the draft skips: hidden states go through unchanged (and it writes no KV)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def skip_block(n_layers: int, n_skip: int) -> list[int]:
    """A contiguous block of `n_skip` layers in the middle of the stack (the first and the last layers
    always stay): what a partial self-draft leaves out before the layers' influence is measured."""
    n_skip = max(0, min(n_skip, n_layers - 2))
    start = max(1, (n_layers - n_skip) // 2)
    return list(range(start, start + n_skip))


def build_self_draft(
    target, progress: Callable[[int, int, str], None] | None = None, bits: int = 4, skip: list[int] | tuple = ()
):
    if not streamed_layers(target):
        return build_skip_draft(target, skip)
    layers = [i for i in check_self_draft(target, bits) if i not in set(skip)]
    skipped = sorted(set(skip) & set(streamed_layers(target)))
    source = _opened(target, sixteen_bit_source(target))
    if bits == 4:
        draft = skeleton(target, source, layers, dtype="nf4", progress=progress, nf4_compute=target.dtype)
    else:
        draft = _hqq_draft(target, source, layers, bits, progress)
    for i in range(len(draft.layers)):
        if i in skipped:
            draft.layers[i] = PassThrough()
        elif i not in layers:
            draft.layers[i] = target.layers[i]  # resident in the target: the same module, bound once
    draft.substituted, draft.substitute_bits, draft.skipped = layers, bits, skipped
    draft.lm_head = draft_head(target.lm_head)
    draft.lean = LeanStack.build(draft)  # kernel-block substitutes (CPU fp32): the draft's pass in one C call
    return draft


def skeleton(target, source=None, layers=(), dtype=None, **options):
    """An OffloadedCausalLM with the target's globals whose `layers` are loaded resident from `source` (the
    target's checkpoint) at `dtype` (the target's if None); every other layer a meta module until bound."""
    from offload.stream.devmem import DevicePool
    from offload.stream.model import OffloadedCausalLM

    if source is None:
        ck = getattr(target, "checkpoint", None)
        source = ck if ck is not None else target.source
    shared = (target.embed_tokens, target.norm, target.lm_head, target.rotary_emb)
    return OffloadedCausalLM.from_pretrained(
        source,
        device=target.device,
        dtype=target.dtype if dtype is None else dtype,
        offload="none",
        pool=DevicePool(target.device),
        subset=Subset(frozenset(layers), shared),
        **options,
    )


def build_skip_draft(target, skip):
    n = len(target_layers(target))
    skip = sorted(set(int(i) for i in skip))
    if not skip:
        raise SelfDraftError(
            "--draft self: every target layer is resident and no layer is left out, so the "
            "draft would be the target itself; fix: leave layers out, or pass a small --draft DIR"
        )
    if skip[0] < 0 or skip[-1] >= n or len(skip) >= n:
        raise SelfDraftError(
            f"--draft self: the layers to leave out ({skip}) must be some of the {n} layers 0-{n - 1}, not all of them"
        )
    layers = [PassThrough() if i in skip else layer for i, layer in enumerate(target_layers(target))]
    if getattr(target, "plan", None) is None:
        draft = _hf_view(target, layers)
    else:
        draft = skeleton(target)
        for i, layer in enumerate(layers):
            draft.layers[i] = layer  # the target's module (bound once, resident) or a pass-through
        draft.lm_head = draft_head(target.lm_head)
        draft.lean = LeanStack.build(draft)  # the kept layers in one C call, where the target has one
    draft.substituted, draft.substitute_bits, draft.skipped = [], LAYER_SKIP, skip
    return draft


def draft_head(head):
    return head.for_draft() if isinstance(head, PackedHead) else head


def target_layers(target):
    """The decoder layers of an OffloadedCausalLM (`.layers`) or of an HF causal LM (`.model.layers`)."""
    return target.layers if getattr(target, "plan", None) is not None else target.model.layers


def _hf_view(target, layers):
    """A second view of an HF causal LM (`--offload none`): a shallow copy whose inner model holds
    `layers`; every parameter, buffer, config and submodule is the target's own object."""
    import copy

    draft = copy.copy(target)
    draft._modules = dict(target._modules)  # nn.Module keeps submodules here: a dict of its own
    inner = copy.copy(target.model)
    inner._modules = dict(target.model._modules)
    inner.layers = nn.ModuleList(layers)
    draft.model = inner
    from offload.stream.devmem import DevicePool

    draft.pool = DevicePool(target.device)  # counts nothing: no device bytes of its own
    return draft


def _hqq_draft(target, source, layers: list[int], bits: int, progress):
    """A weightless skeleton of the target's architecture whose substituted layers get HQQ weights."""
    from offload.quant.lowbit import ensure_lowbit_layers, lowbit_layer, shard_path

    cache = ensure_lowbit_layers(source, layers, bits, progress)
    draft = skeleton(target, source)
    for i in layers:
        draft.layers[i] = lowbit_layer(draft.layers[i], shard_path(cache, i), target.device, target.dtype, draft.pool)
    return draft
