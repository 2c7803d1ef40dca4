"""Byte formulas of the memory plan: model shapes, KV caches, NF4 quant states, pass activations.

Contract: pure functions of config.json values (`Arch`), dtypes and token counts; no I/O.
`req` arguments are `memplan.PlanRequest`s (only dtype, device, ctx, attn, draft_dtype and
max_beams are read). Every formula states the tensors it counts; memplan.py sums them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import OffloadError

NF4_BLOCK, NF4_NESTED_BLOCK = 64, 256
PREFILL_CHUNK = 256            # prompt tokens per target pass at least (bigger when the tree is)
_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class Arch:
    """Shapes the plan needs, from config.json (text_config for multimodal wrappers)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_positions: int


def arch_of(config: dict) -> Arch:
    c = config.get("text_config") or config
    try:
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        return Arch(hidden, int(c["intermediate_size"]), int(c["num_hidden_layers"]), heads,
                    int(c.get("num_key_value_heads") or heads), int(c.get("head_dim") or hidden // heads),
                    int(c["vocab_size"]), bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
                    int(c.get("max_position_embeddings") or 2048))
    except (KeyError, TypeError, ValueError) as exc:
        raise OffloadError(f"config.json lacks {exc}; cannot plan memory for this model") from None


def dtype_bytes(name: str) -> int:
    try:
        return _BYTES[name.lower()]
    except KeyError:
        raise OffloadError(f"unsupported dtype {name!r}; use bf16, fp16, fp32 or nf4") from None


def compute_bytes(req) -> int:
    """Bytes per element of the target's compute dtype (nf4 computes in bf16 on CUDA, fp32 on CPU)."""
    if req.dtype == "nf4":
        return 2 if req.device == "cuda" else 4
    return dtype_bytes(req.dtype)


def kv_rows(ctx: int, budget: int, max_beams: int) -> tuple[int, int]:
    """(target, draft) cache rows: the context plus the largest tree each cache ever holds.

    Target: committed tokens (< ctx) + root + `budget` verified nodes. Draft: committed tokens +
    every node tree growth runs; nodes that drop out of the top-`budget` after running stay in the
    cache, so allow twice the budget plus one batch of beams.
    """
    return ctx + budget + 1, ctx + 2 * budget + max_beams + 1


def pass_tokens(budget: int) -> int:
    """Largest target pass: a verify pass (budget + 1) or a prefill chunk, whichever is bigger."""
    return max(budget + 1, PREFILL_CHUNK)


def nf4_state_bytes(numel: int) -> int:
    """QuantState of one NF4 weight (blocksize 64, double-quantized), as the loader keeps it:
    uint8 absmax per block + fp32 nested absmax per 256 blocks + 256-entry fp32 nested code
    + 16-entry fp32 NF4 code + fp32 offset."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK) + 256 * 4 + 16 * 4 + 4


def torch_dtype(name: str) -> torch.dtype:
    return {2: torch.float16 if "16" in name and "b" not in name else torch.bfloat16, 4: torch.float32}[dtype_bytes(name)]


def draft_bytes(ck, dtype: str) -> int:
    """Draft parameters in `dtype` (a tied lm_head shares the embedding) + rotary buffers;
    `ck` is a memlayers.Checkpoint (its config and safetensors headers)."""
    a, b = arch_of(ck.config), dtype_bytes(dtype)
    total = 0
    for name, e in ck.tensors.items():
        if name.endswith("inv_freq") or (a.tied and name == "lm_head.weight"):
            continue
        total += math.prod(e.shape) * b
    return total + rotary_bytes(a)


def rotary_bytes(a: Arch) -> int:
    """HF rotary embedding buffers: inv_freq and original_inv_freq, head_dim/2 fp32 each."""
    return 2 * (a.head_dim // 2) * 4


def kv_bytes(a: Arch, rows: int, elem: int) -> int:
    """K and V for every layer: (kv_heads, rows, head_dim) each, in the compute dtype."""
    return 2 * a.layers * a.kv_heads * a.head_dim * rows * elem


def pass_bytes(a: Arch, t: int, s: int, c: int, attn: str, logit_rows: int, deq_numel: int = 0,
               fused: bool = False) -> int:
    """Transient device bytes of one pass of T new tokens over S key positions (one layer alive).

    hidden states (residual, normed, attention/MLP outputs: 4 x T x hidden), q/k/v before and
    after RoPE (2 x T x (H + 2 KV) x hd), GQA-expanded K/V (2 x H x S x hd), attention scores
    (H x T x S: sdpa's math path keeps scores and softmax output; eager adds an fp32 softmax),
    MLP gate/up/act/product (4 x T x I), the 4-D additive mask and its expanded copy (2 x T x S),
    one dequantized NF4 weight, and the pass's logits plus fp32 copies for sampling (V x (c + 8)).
    `fused`: a causal prefill pass under CUDA SDPA (flash / memory-efficient kernels, no additive
    mask): no H x T x S scores and only a T x S boolean mask are ever materialized.
    """
    hidden = 4 * t * a.hidden * c
    qkv = 2 * t * (a.heads + 2 * a.kv_heads) * a.head_dim * c
    gqa = 2 * a.heads * s * a.head_dim * c if a.kv_heads != a.heads else 0
    scores = 0 if fused else a.heads * t * s * (2 * c + (4 if attn == "eager" else 0))
    mlp = 4 * t * a.intermediate * c
    mask = t * s if fused else 2 * t * s * c
    logits = logit_rows * a.vocab * (c + 8)
    return hidden + qkv + gqa + scores + mlp + mask + deq_numel * c + logits


PREFILL_SHARE = 5   # a prefill pass may take up to 1/5 of the device (CPU: of the RAM) for activations


def fused_prefill(req) -> bool:
    """Prefill passes run the model's causal path (engine.run_prompt passes no additive mask):
    on CUDA, SDPA's fused kernels never materialize the scores."""
    return req.device == "cuda" and req.attn == "sdpa"


def prefill_chunk(ta: Arch, req, budget: int, capacity: int) -> int:
    """Prompt tokens per target pass: the whole --ctx when its activations fit 1/PREFILL_SHARE of
    `capacity` (or the verify pass's, if larger), else the largest halving of it that does, never
    below pass_tokens(budget). Every prefill pass streams every offloaded layer once, so a prompt
    that fits --ctx costs one weight stream whenever the memory allows."""
    c = compute_bytes(req)
    deq = ta.intermediate * ta.hidden if req.dtype == "nf4" else 0
    floor = min(pass_tokens(budget), req.ctx)
    fused = fused_prefill(req)
    allow = max(capacity // PREFILL_SHARE, pass_bytes(ta, floor, req.ctx, c, req.attn, 1, deq, fused))
    chunk = req.ctx
    while chunk > floor and pass_bytes(ta, chunk, req.ctx, c, req.attn, 1, deq, fused) > allow:
        chunk = max(floor, chunk // 2)
    return chunk


def activation_bytes(ta: Arch, da: Arch | None, req, rows: tuple[int, int], budget: int,
                     chunk: int | None = None, draft_prefill: bool = True) -> int:
    """The largest pass of either model: target verify pass, target prefill chunk, draft passes
    (a draft that reads the target's KV never prefills: `draft_prefill` False)."""
    c = compute_bytes(req)
    deq = ta.intermediate * ta.hidden if req.dtype == "nf4" else 0
    chunk = min(pass_tokens(budget), req.ctx) if chunk is None else chunk
    worst = max(pass_bytes(ta, budget + 1, rows[0], c, req.attn, budget + 1, deq),
                pass_bytes(ta, chunk, req.ctx, c, req.attn, 1, deq, fused_prefill(req)))
    if da is not None:
        dc = dtype_bytes(req.draft_dtype)
        worst = max(worst, pass_bytes(da, req.max_beams, rows[1], dc, req.attn, req.max_beams),
                    pass_bytes(da, chunk, req.ctx, dc, req.attn, 1, 0, fused_prefill(req)) if draft_prefill else 0)
    return worst
