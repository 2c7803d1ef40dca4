"""GQA-aware attention for masked multi-query passes, registered with transformers.

Contract: `register()` (idempotent) adds the attention function `NAME` ("specx_gqa") to
transformers' AttentionInterface and, for mask building, maps the same name to transformers'
own `sdpa_mask` in AttentionMaskInterface; `implementation(config_or_name)` is the name a model
should run under ("specx_gqa" where HF would run "sdpa", otherwise the name unchanged: Gemma-2's
soft-capped "eager" stays eager). The function is transformers' SDPA except where SDPA would
repeat K/V: with G = heads / kv_heads > 1 and a mask shared by the heads ((B, 1, Q, K), a tree
mask or a causal one), the G query heads of each KV head are folded into the query axis,

    q (B, H, Q, D) -> (B, Hkv, G*Q, D),  mask (B, 1, Q, K) -> (B, 1, G*Q, K) (rows repeated G times),

so one SDPA call reads each KV head once (no (B, H, K, D) copy of the cache: 2*G*K*D*Hkv bytes
per layer saved), and the (B, Hkv, G*Q, D) output unfolds back to (B, Q, H, D). The repeated mask
is built once per forward (cached on the mask tensor's identity and version), not once per layer.
Softmax rows are independent, so the result equals HF's `sdpa`/`eager` to rounding. Without a mask,
with one query, with per-head masks or position biases it is HF's `sdpa_attention_forward` as is.
"""

from __future__ import annotations

import torch

NAME = "specx_gqa"
_REPEATED: dict = {}   # key of the last mask folded -> its (B, 1, G*Q, K) repetition


def register() -> str:
    """Make NAME known to transformers (attention and mask interfaces); returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, gqa_attention_forward)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def implementation(name: str) -> str:
    """NAME in place of "sdpa" (registering it); any other implementation unchanged."""
    return register() if name == "sdpa" else name


def _folded_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, 1, Q, K) -> (B, 1, G*Q, K): row g*Q + q is mask row q (one copy per forward)."""
    if mask.is_inference():   # no version counter to key on (masks HF builds under inference mode)
        return mask.repeat(1, 1, groups, 1)
    key = (mask.data_ptr(), tuple(mask.shape), mask.dtype, mask.device, mask._version, groups)
    hit = _REPEATED.get("key")
    if hit == key:
        return _REPEATED["value"]
    out = mask.repeat(1, 1, groups, 1)
    _REPEATED.update(key=key, value=out, source=mask)   # `source` keeps the pointer from being reused
    return out


def gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (B, H, Q, D), key/value (B, Hkv, K, D) -> ((B, Q, H, D), None), as transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q_len, dim = query.shape
    foldable = (groups > 1 and attention_mask is not None and q_len > 1 and attention_mask.dim() == 4
                and attention_mask.shape[1] == 1 and kwargs.get("position_bias") is None
                and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False))
    if not foldable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads = key.shape[1]
    q = query.reshape(b, kv_heads, groups * q_len, dim)       # head h = kv*G + g -> rows g*Q .. g*Q+Q-1
    mask = _folded_mask(attention_mask, groups)
    if mask.shape[0] != b and mask.shape[0] != 1:
        raise ValueError(f"attention mask batch {mask.shape[0]} does not match the query batch {b}")
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, is_causal=False)
    out = out.reshape(b, heads, q_len, value.shape[-1])       # (B, Hkv, G*Q, D) -> (B, H, Q, D)
    return out.transpose(1, 2).contiguous(), None
