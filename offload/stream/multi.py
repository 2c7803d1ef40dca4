"""Many sequences, one weight stream: `forward_many` runs several independent forward jobs in ONE pass.

Contract: `forward_many(model, jobs)` takes `ForwardJob`s (each its own token ids, positions,
4-D additive mask or None for plain causal, and its OWN KV cache) and returns one logits tensor per
job, in order: (T, V), or (1, V) for the job's last token with `last_only`. For an
`OffloadedCausalLM` the decoder layers are iterated once: when layer i's weights are bound (resident
or streamed through the prefetcher), every job's hidden states go through it against that job's
cache, then the next layer. The stream is paid once for all jobs (`model.stats.passes` grows by
one). Each job runs exactly the modules, shapes and inputs it would alone, in the same order, so
its logits equal `model(...)` on that job alone bit for bit; no tensor is shared between jobs
(no flat KV, no cross-sequence mask), so nothing can leak from one sequence into another. Any
other model (resident HF) runs the jobs' forwards one after the other, with the same result. A job
the model's one-call stack serves (stream/leanstack.py: a resident Llama GGUF, a few tokens) runs
through it instead of the layer loop, with the same logits as model(...) on it alone (which takes
the stack too).
Inputs are already on the model's devices (ids on `model.input_device` when it has one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from offload.arch.families import apply_final_softcap
from offload.arch.hfcompat import cache_kwargs


@dataclass
class ForwardJob:
    """One sequence's share of a pass."""

    ids: torch.Tensor  # (T,) long token ids
    positions: torch.Tensor  # (T,) long absolute positions
    mask: torch.Tensor | None  # (1, 1, T, past + T) additive, or None: plain causal (a prefill chunk)
    cache: object  # this sequence's own transformers Cache; the T new rows are appended to it
    last_only: bool = False  # logits of the last token only ((1, V)): a prefill chunk


def forward_many(model, jobs: list[ForwardJob]) -> list[torch.Tensor]:
    """Every job's logits after one pass (module docstring)."""
    if not jobs:
        return []
    if hasattr(model, "_layer_stream"):
        return _streamed(model, jobs)
    return [_plain(model, job) for job in jobs]


def _plain(model, job: ForwardJob) -> torch.Tensor:
    with torch.inference_mode():
        out = model(input_ids=job.ids[None], position_ids=job.positions[None], attention_mask=job.mask,
                    use_cache=True, logits_to_keep=1 if job.last_only else 0, **cache_kwargs(model, job.cache))
    return out.logits[0]


@dataclass
class _Lane:
    """A job's running state inside the layer loop."""

    h: torch.Tensor  # (1, T, hidden) hidden states
    masks: dict | None  # layer type -> the mask the model's layers of that type take; None: the stack ran it
    pos_emb: tuple  # rotary (cos, sin) for the job's positions
    position_ids: torch.Tensor  # (1, T)
    cache_kw: dict  # {cache keyword: the job's cache}


def _layers(model, lanes: list[_Lane]) -> None:
    """Each decoder layer once, in order (streamed ones from the prefetcher): every lane through it."""
    types = model._layer_types()
    for i in model._layer_stream():   # layer i's weights are bound now: every sequence uses them
        layer = model.layers[i]
        for lane in lanes:
            lane.h = layer(lane.h, attention_mask=lane.masks[types[i]], position_ids=lane.position_ids,
                           use_cache=True, position_embeddings=lane.pos_emb, **lane.cache_kw)
        if model.compute_hook is not None:
            model.compute_hook(i)


@torch.inference_mode()
def _streamed(model, jobs: list[ForwardJob]) -> list[torch.Tensor]:
    """The OffloadedCausalLM.forward steps, with the per-layer step run for every job in turn."""
    t0 = time.perf_counter()
    lanes, layered = [], []   # every job's lane; those that go through the layers one by one
    stack = getattr(model, "lean", None) if model.compute_hook is None else None
    model.stats.streamed_bytes_per_pass = 0
    stall0 = model.prefetcher.stall_seconds
    for job in jobs:
        h = model.embed_tokens(job.ids[None])   # (1, T, hidden) on the device
        pos = job.positions[None]
        if stack is not None and stack.serves(h, job.mask, job.cache):   # the whole stack in one call
            lanes.append(_Lane(stack(h, model.rotary_emb(h, pos), job.mask, job.cache), None, (), pos, {}))
            continue
        lanes.append(_Lane(h, model._masks(h, job.mask, job.cache, pos, pos), model.rotary_emb(h, pos), pos,
                           cache_kwargs(type(model.layers[0]), job.cache)))
        layered.append(lanes[-1])
    if layered or model.plan.streamed:   # a model with a stack streams nothing: no pass to pull
        _layers(model, layered)
    out = []
    for lane, job in zip(lanes, jobs):
        h = model.norm(lane.h)
        if job.last_only:
            h = h[:, -1:]
        head = stack.head(model.lm_head, h) if lane.masks is None else model.lm_head(h)   # None: a stack lane
        out.append(apply_final_softcap(head, model.family.final_softcap)[0])
    model._account(t0, stall0)
    return out
