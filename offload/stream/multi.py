"""The one pass of an OffloadedCausalLM, for one sequence or several: `forward` and `forward_many` both run it.

Contract: `run_pass(model, lanes)` returns each `Lane`'s (B, T or keep, V) logits. `forward_many(model, jobs)`
runs one lane per `ForwardJob` (ids, positions, 4-D additive mask or None, its OWN cache) and returns (T, V),
or (1, V) with `last_only`, per job. Layers are iterated once, every lane through each while it is bound, so
the stream is paid once (`stats.passes` + 1); each lane's logits equal its pass alone bit for bit. The
one-call stack (cpu/leanstack.py) takes what it serves: resident, one-token lanes in ONE call, longer ones
alone; streamed, a pass of one lane. A model without a layer stream runs the jobs one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offload.arch.attention import release as release_masks
from offload.arch.families import apply_final_softcap, window_mask
from offload.arch.hfcompat import cache_kwargs
from offload.cpu import ggml_kernel


@dataclass
class ForwardJob:
    """One sequence's share of a pass."""

    ids: torch.Tensor  # (T,) long token ids
    positions: torch.Tensor  # (T,) long absolute positions
    mask: torch.Tensor | None  # (1, 1, T, past + T) additive, or None: plain causal (a prefill chunk)
    cache: object  # this sequence's own transformers Cache; the T new rows are appended to it
    last_only: bool = False  # logits of the last token only ((1, V)): a prefill chunk


@dataclass(eq=False)
class Lane:
    """One sequence's inputs to `run_pass` and its running state (eq=False: lanes compare by identity)."""

    ids: torch.Tensor | None  # (B, T) token ids; None when `h` holds the caller's embeddings
    h: torch.Tensor | None  # (B, T, hidden): the caller's embeddings, then the embedded ids, then each layer's output
    mask: torch.Tensor | None  # the caller's attention mask (4-D additive (B, 1, T, past + T), 2-D, or None: causal)
    cache: object  # the sequence's transformers Cache (None: none); the layers append the T new rows to it
    given: torch.Tensor | None  # (1 or B, T) the caller's positions; None: past + arange(T), past from the cache
    keep: int = 0  # logits of the last `keep` tokens only; 0: every token
    use_cache: object = True  # passed to every layer as is; falsy keeps the stack off
    extra: dict = field(default_factory=dict)  # further keyword arguments for every layer (keep the stack off)
    position_ids: torch.Tensor | None = None  # (1 or B, T) `given` or the derived positions (set by the pass)
    pos_emb: tuple = ()  # rotary (cos, sin) of position_ids (set by the pass)


def forward_many(model, jobs: list[ForwardJob]) -> list[torch.Tensor]:
    if not jobs:
        return []
    if not hasattr(model, "_layer_stream"):
        return [_plain(model, job) for job in jobs]
    lanes = [Lane(j.ids[None], None, j.mask, j.cache, j.positions[None], 1 if j.last_only else 0) for j in jobs]
    with torch.inference_mode():
        return [logits[0] for logits in run_pass(model, lanes)]


def _plain(model, job: ForwardJob) -> torch.Tensor:
    with torch.inference_mode():
        out = model(
            input_ids=job.ids[None],
            position_ids=job.positions[None],
            attention_mask=job.mask,
            use_cache=True,
            logits_to_keep=1 if job.last_only else 0,
            **cache_kwargs(model, job.cache),
        )
    return out.logits[0]


def run_pass(model, lanes: list[Lane]) -> list[torch.Tensor]:
    model.stats.streamed_bytes_per_pass = 0
    stall0 = model.prefetcher.stall_seconds
    # a CPU pass's small torch ops up to the stack's call on one thread (ggml_kernel's contract)
    with ggml_kernel.host_ops_on_one_thread(model.lean is not None and model.device.type == "cpu"):
        for lane in lanes:
            _embed(model, lane)
        stack, stacked = model.lean, _on_stack(model, lanes)
        layered = [lane for lane in lanes if lane not in stacked]
        pull = False
        if stacked and stack.streamed:  # one lane: layer by layer as each streamed one is bound, one C call each
            x, groups = stacked[0], [stacked]
            x.h = stack.stream(x.h, x.pos_emb, x.mask, x.cache, model._layer_stream(), model.layers)
        else:
            groups = _calls(stacked)
            for group in groups:  # one-token lanes in one call: the packed weights read once for all
                for lane, h in zip(group, stack.run([(x.h, x.pos_emb, x.mask, x.cache) for x in group])):
                    lane.h = h
            pull = bool(layered) or bool(model.plan.streamed)  # a resident stack streams nothing: no pass
        if not pull:  # the final norms too; a dense head takes torch's threads back (ggml_kernel)
            return _finish(model, lanes, groups, stall0)
    _layers(model, layered)  # transformers' layers on torch's own threads
    return _finish(model, lanes, groups, stall0)


def _finish(model, lanes: list[Lane], groups: list, stall0: float) -> list[torch.Tensor]:
    out = _heads(model, lanes, groups)
    release_masks()  # the masks attention prepared for this pass (arch/attention.py) die with it
    _account(model, stall0)
    return out


def _embed(model, lane: Lane) -> None:
    """The lane's hidden states, positions (default: past + arange(T)) and their rotary embeddings."""
    if lane.h is None:
        lane.h = model.embed_tokens(lane.ids)
    pos = lane.given
    if pos is None:
        past = lane.cache.get_seq_length() if lane.cache is not None else 0
        pos = (torch.arange(lane.h.shape[1], device=lane.h.device) + past).unsqueeze(0)
    lane.position_ids, lane.pos_emb = pos, model.rotary_emb(lane.h, pos)


def _on_stack(model, lanes: list[Lane]) -> list[Lane]:
    """The lanes the one-call stack runs: those it serves that pass no extra layer arguments and keep their K/V
    (with streamed layers, a pass of one lane only)."""
    stack = model.lean
    if stack is None or (stack.streamed and len(lanes) > 1):
        return []
    return [x for x in lanes if x.use_cache and not x.extra and stack.serves(x.h, x.mask, x.cache)]


def _calls(stacked: list[Lane]) -> list[list[Lane]]:
    """The resident stack's calls: every one-token lane together (row by row, each as alone), each longer lane
    alone (a tree or a prefill tail takes the faster several-row schedule)."""
    ones = [x for x in stacked if x.h.shape[1] == 1]
    return ([ones] if ones else []) + [[x] for x in stacked if x.h.shape[1] != 1]


def _layers(model, lanes: list[Lane]) -> None:
    """Each decoder layer once, in order, every lane through it as HF runs it."""
    masks = [_masks(model, x) for x in lanes]  # per lane: layer type -> the mask its layers take
    cache_kw = [cache_kwargs(type(model.layers[0]), x.cache) for x in lanes]
    types = model.family.layer_types
    for i in model._layer_stream():  # layer i's weights are bound now: every sequence uses them
        layer = model.layers[i]
        for x, m, kw in zip(lanes, masks, cache_kw):
            x.h = layer(
                x.h,
                attention_mask=m[types[i]],
                position_ids=x.position_ids,
                use_cache=x.use_cache,
                position_embeddings=x.pos_emb,
                **kw,
                **x.extra,
            )


def _masks(model, lane: Lane) -> dict[str, torch.Tensor | None]:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    # only a caller's positions go to HF's mask builders: with neither cache nor mask they look
    # for packed sequences, a host read (a device sync) that our contiguous positions never need
    kw = dict(config=model.config, inputs_embeds=lane.h, attention_mask=lane.mask, position_ids=lane.given)
    masks = {}
    for t in set(model.family.layer_types):
        fn = create_sliding_window_causal_mask if t == "sliding_attention" else create_causal_mask
        masks[t] = fn(**kw, **cache_kwargs(fn, lane.cache))
    custom = lane.mask is not None and lane.mask.dim() == 4
    if custom and "sliding_attention" in masks:
        # HF returns a caller's 4-D mask as-is: add the window by absolute position. Cache rows
        # [0, past) hold positions 0..past-1 (committed tokens); the new rows hold position_ids.
        k_len = lane.mask.shape[-1]
        q_pos = lane.position_ids[0]
        past = torch.arange(k_len - q_pos.numel(), device=q_pos.device)
        masks["sliding_attention"] = window_mask(
            lane.mask, q_pos, torch.cat([past, q_pos]), model.family.sliding_window
        )
    return masks


def _heads(model, lanes: list[Lane], groups: list[list[Lane]]) -> list[torch.Tensor]:
    """Every lane's logits: final norm, the last `keep` rows, head, final softcap (a stack group's rows each as
    alone: `rowwise`)."""
    on_stack = {id(x) for group in groups for x in group}
    out = {id(x): _softcap(model, model.lm_head(_final(model, x))) for x in lanes if id(x) not in on_stack}
    for group in groups:
        hs = [_final(model, x) for x in group]  # normed per lane, as alone: (1, T or keep, hidden) each
        head = ggml_kernel.head_logits(model.lm_head, hs[0] if len(hs) == 1 else torch.cat(hs, 1), rowwise=len(hs) > 1)
        for x, logits in zip(group, _softcap(model, head).split([h.shape[1] for h in hs], 1)):
            out[id(x)] = logits
    return [out[id(x)] for x in lanes]


def _final(model, lane: Lane) -> torch.Tensor:
    h = model.norm(lane.h)
    return h[:, -lane.keep :] if lane.keep else h


def _softcap(model, head: torch.Tensor) -> torch.Tensor:
    return apply_final_softcap(head, model.family.final_softcap)


def _account(model, stall0: float) -> None:
    s, pf = model.stats, model.prefetcher
    s.passes += 1
    s.streamed_bytes += s.streamed_bytes_per_pass
    s.stall_seconds = pf.stall_seconds
    s.last_pass_stall_seconds = pf.stall_seconds - stall0
    s.link_busy_seconds = pf.link_busy_seconds()  # on CUDA this also retires the completed copy events
