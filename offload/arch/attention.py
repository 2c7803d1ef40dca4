"""GQA-aware attention for masked passes, registered with transformers; it never repeats K/V.

Contract: `register()` (idempotent) adds the attention function `NAME` ("specx_gqa") to transformers'
AttentionInterface, with transformers' `sdpa_mask` as its mask builder; `implementation(name)` is the
name a model should run under ("specx_gqa" where HF would run "sdpa", any other name unchanged). The
result equals HF's `sdpa`/`eager` to rounding; without a mask, with per-head masks, soft-capping or
position biases it is HF's `sdpa_attention_forward` as is; with attention sinks (`s_aux`) gptoss.py's
`sink_attention_forward`. With G = heads / kv_heads > 1 and a mask shared by the heads ((B, 1, Q, K)),
`mask_strategy` picks:
- "gqa" (CPU): one SDPA call with `enable_gqa` pinned to the CPU flash kernel (called directly,
  `cpu_flash`, where it is the same call): no K/V copy, no mask copy (tests/test_attention_memory.py).
- "fold" (CUDA, Q = 1 or G*Q <= 2 * kv_heads * head_dim): q (B, H, Q, D) -> (B, Hkv, G*Q, D), mask ->
  (B, 1, G*Q, K) with row g*Q + q = mask row q (Q = 1: a stride-0 view; Q > 1: written once per forward
  at a width rounded up to ALIGN), one memory-efficient SDPA call.
- "groups" (CUDA, bigger Q): G memory-efficient SDPA calls, one per group member g (query heads kv*G + g).
On CUDA a mask is prepared once per forward (additive in the query dtype, at an aligned width; an aligned
additive one, as core/tree.py builds them, is used as is) and dies with its source or at `release()`,
called after every pass. `mask_bytes` gives the bytes (offload/planning/membytes.py counts them).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from offload.arch.cpuflash import cpu_flash
from offload.arch.hfcompat import register_as

NAME = "specx_gqa"
ALIGN = 8  # SDPA's memory-efficient kernel copies masks whose strides are not multiples of 8
_PREPARED: dict = {}  # (id(mask), groups, dtype) -> (weakref to the source mask, prepared mask)


def register() -> str:
    from transformers.masking_utils import sdpa_mask

    return register_as(NAME, gqa_attention_forward, sdpa_mask)


def implementation(name: str) -> str:
    return register() if name == "sdpa" else name


def padded(width: int) -> int:
    return -(-width // ALIGN) * ALIGN


def mask_strategy(device: str, q_len: int, groups: int, kv_heads: int, head_dim: int) -> str:
    """ "gqa" | "fold" | "groups" for a masked pass (module docstring); "none" when G = 1."""
    if groups <= 1:
        return "none"
    if device != "cuda":
        return "gqa"
    return "fold" if q_len == 1 or groups * q_len <= 2 * kv_heads * head_dim else "groups"


def mask_bytes(
    device: str, q_len: int, keys: int, groups: int, kv_heads: int, head_dim: int, elem: int, source: int
) -> int:
    """Device bytes the masked attention of one pass allocates beyond the caller's (1, 1, Q, K) mask,
    alive for the whole pass (prepared once per forward) or one layer (query and output copies).
    `source`: bytes per element of the mask handed in (1: bool, else additive in `elem`).
    CPU ("gqa"): none. CUDA: the additive mask at the padded width (Q x K8 x elem) unless the source
    already is one; "fold" with Q > 1: the folded mask G x Q x K8 x elem and the folded query copy
    (Q x H x D x elem); "groups": the G per-group outputs and their stacked copy (2 x Q x H x D x elem)."""
    strategy = mask_strategy(device, q_len, groups, kv_heads, head_dim)
    if device != "cuda" or strategy == "none" or q_len == 1:
        return 0
    width, heads = padded(keys), groups * kv_heads
    prepared = 0 if source == elem else q_len * width * elem
    if strategy == "fold":
        return prepared + groups * q_len * width * elem + q_len * heads * head_dim * elem
    return prepared + 2 * q_len * heads * head_dim * elem


def release() -> None:
    _PREPARED.clear()


def _prepared(mask: torch.Tensor, dtype: torch.dtype, groups: int) -> torch.Tensor:
    """(B, 1, Q, K) bool or additive -> additive `dtype` (B, 1, groups*Q, K), row g*Q + q = row q,
    with strides that are multiples of ALIGN; built once per source mask (see the module docstring)."""
    aligned = all(s % ALIGN == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    if groups == 1 and mask.dtype == dtype and aligned:
        return mask
    key = (id(mask), groups, dtype)
    hit = _PREPARED.get(key)
    if hit is not None and hit[0]() is mask:
        return hit[1]
    b, _, q_len, keys = mask.shape
    full = torch.empty(b, 1, groups * q_len, padded(keys), dtype=dtype, device=mask.device)
    full.view(b, 1, groups, q_len, -1)[..., :keys].copy_(mask.unsqueeze(2))  # bool -> 1 / 0
    if mask.dtype == torch.bool:  # allowed 1 -> 0, blocked 0 -> dtype min, in place: (x - 1) * max
        full.sub_(1).mul_(torch.finfo(dtype).max)
    out = full[..., :keys]
    _PREPARED[key] = (weakref.ref(mask, lambda _, k=key: _PREPARED.pop(k, None)), out)
    return out


def _sdpa(q, k, v, mask, dropout, scaling, backend, enable_gqa=False):
    """SDPA pinned to `backend`, or torch's own choice where it is None or cannot take these inputs."""
    from contextlib import nullcontext

    from torch.nn.attention import sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:  # torch warns why a pinned kernel cannot run before it raises: the fallback below says enough
        with sdpa_kernel(backend) if backend is not None else nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sdpa(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa)
    except RuntimeError as exc:  # the pinned kernel refuses these inputs (head size, dtype, arch): torch's choice
        if backend is None or not any(m in str(exc) for m in ("No available kernel", "No viable backend")):
            raise
        return sdpa(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa)


def without_gqa(query, key, value, mask, groups, dropout, scaling, strategy, backend):
    """ "fold" or "groups" (module docstring) for a `backend` that takes masks but not GQA."""
    b, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if strategy == "fold":
        q = query.reshape(b, kv_heads, groups * q_len, dim)  # head h = kv*G + g -> rows g*Q .. g*Q+Q-1
        m = (
            _prepared(mask, query.dtype, 1).expand(-1, -1, groups, -1)
            if q_len == 1
            else _prepared(mask, query.dtype, groups)
        )
        out = _sdpa(q, key, value, m, dropout, scaling, backend)
        return out.reshape(b, heads, q_len, value.shape[-1])
    m = _prepared(mask, query.dtype, 1).expand(-1, kv_heads, -1, -1)
    outs = [_sdpa(query[:, g::groups], key, value, m, dropout, scaling, backend) for g in range(groups)]
    return torch.stack(outs, dim=2).reshape(b, heads, q_len, value.shape[-1])  # (B, Hkv, G, Q, D) -> head kv*G+g


def gqa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, H, Q, D), key/value (B, Hkv, K, D) -> ((B, Q, H, D), None), as transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("s_aux") is not None:  # gpt-oss's attention sinks join each head's softmax: gptoss.py
        from offload.arch.gptoss import sink_attention_forward

        return sink_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    b, _heads, q_len, dim = query.shape
    foldable = (
        groups > 1
        and attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )
    if not foldable:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if attention_mask.shape[0] not in (1, b):
        raise ValueError(f"attention mask batch {attention_mask.shape[0]} does not match the query batch {b}")
    # the object transformers hands every layer (prepared masks are keyed on it); cut only if wider than the cache
    mask = attention_mask if attention_mask.shape[-1] == key.shape[-2] else attention_mask[..., : key.shape[-2]]
    strategy = mask_strategy(query.device.type, q_len, groups, key.shape[1], dim)
    from torch.nn.attention import SDPBackend

    if strategy == "gqa":
        out = cpu_flash(query, key, value, mask, dropout, scaling) if query.device.type == "cpu" else None
        if out is None:
            backend = SDPBackend.FLASH_ATTENTION if query.device.type == "cpu" else None  # CPU flash: masks and GQA
            out = _sdpa(query, key, value, mask, dropout, scaling, backend, enable_gqa=True)
    else:
        out = without_gqa(query, key, value, mask, groups, dropout, scaling, strategy, SDPBackend.EFFICIENT_ATTENTION)
    return out.transpose(1, 2).contiguous(), None
