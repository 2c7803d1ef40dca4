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
other model (resident HF) runs the jobs' forwards one after the other, with the same result. The jobs
the model's one-call stack serves (stream/leanstack.py: a resident Llama GGUF, a few tokens each) run
through it instead of the layer loop: the one-token jobs (plain decoding) all in ONE call and one
head call, each packed weight read once for all of them and every row computed as that job alone
computes it; a job of several tokens in a call of its own. Either way each job's logits equal
model(...) on it alone (which takes the stack too) bit for bit.
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
        out = model(
            input_ids=job.ids[None],
            position_ids=job.positions[None],
            attention_mask=job.mask,
            use_cache=True,
            logits_to_keep=1 if job.last_only else 0,
            **cache_kwargs(model, job.cache),
        )
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
    for i in model._layer_stream():  # layer i's weights are bound now: every sequence uses them
        layer = model.layers[i]
        for lane in lanes:
            lane.h = layer(
                lane.h,
                attention_mask=lane.masks[types[i]],
                position_ids=lane.position_ids,
                use_cache=True,
                position_embeddings=lane.pos_emb,
                **lane.cache_kw,
            )


@torch.inference_mode()
def _streamed(model, jobs: list[ForwardJob]) -> list[torch.Tensor]:
    """The OffloadedCausalLM.forward steps, with the per-layer step run for every job in turn; the jobs
    the one-call stack serves run through it together, in one call, and through the head together."""
    t0 = time.perf_counter()
    lanes, layered, stacked = [], [], []  # every job's lane; those run layer by layer; those on the stack
    stack = getattr(model, "lean", None)
    stack = None if stack is not None and stack.streamed else stack  # its streamed layers: per pass (forward)
    model.stats.streamed_bytes_per_pass = 0
    stall0 = model.prefetcher.stall_seconds
    for job in jobs:
        h = model.embed_tokens(job.ids[None])  # (1, T, hidden) on the device
        pos = job.positions[None]
        if stack is not None and stack.serves(h, job.mask, job.cache):
            lanes.append(_Lane(h, None, model.rotary_emb(h, pos), pos, {}))
            stacked.append((len(lanes) - 1, job))
            continue
        lanes.append(
            _Lane(
                h,
                model._masks(h, job.mask, job.cache, pos, pos),
                model.rotary_emb(h, pos),
                pos,
                cache_kwargs(type(model.layers[0]), job.cache),
            )
        )
        layered.append(lanes[-1])
    groups = _calls(stacked)
    for group in groups:  # one-token jobs in one call: the packed weights read once for all
        outs = stack.run([(lanes[i].h, lanes[i].pos_emb, job.mask, job.cache) for i, job in group])
        for (i, _), h in zip(group, outs):
            lanes[i].h = h
    if layered or model.plan.streamed:  # a model with a stack streams nothing: no pass to pull
        _layers(model, layered)
    out = [None] * len(jobs)
    for i, (lane, job) in enumerate(zip(lanes, jobs)):
        if lane.masks is not None:
            out[i] = _logits(model, model.lm_head(_final(model, lane.h, job)))
    for group in groups:  # through the head the same way (each row as alone when grouped)
        rows = [_final(model, lanes[i].h, job)[0] for i, job in group]  # normed per job, as alone
        head = stack.head(model.lm_head, torch.cat(rows)[None], rowwise=len(group) > 1)
        for (i, _), lg in zip(group, _logits(model, head).split([len(r) for r in rows])):
            out[i] = lg
    model._account(t0, stall0)
    return out


def _calls(stacked: list) -> list[list]:
    """The stack's calls for its (lane index, job) pairs: every one-token job together (computed row by
    row as alone, so each stays bit-identical to its pass alone), each longer job in a call of its own
    (a tree or a prefill tail alone takes the faster several-row schedule)."""
    ones = [p for p in stacked if len(p[1].ids) == 1]
    return ([ones] if ones else []) + [[p] for p in stacked if len(p[1].ids) != 1]


def _final(model, h: torch.Tensor, job: ForwardJob) -> torch.Tensor:
    """The final norm of a job's hidden states (its last row only for `last_only`): (1, T or 1, hidden)."""
    h = model.norm(h)
    return h[:, -1:] if job.last_only else h


def _logits(model, head: torch.Tensor) -> torch.Tensor:
    """(T, V) logits from the head's (1, T, V) output."""
    return apply_final_softcap(head, model.family.final_softcap)[0]
