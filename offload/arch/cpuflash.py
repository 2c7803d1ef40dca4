"""torch's CPU flash attention kernel, called directly (attention.py's plain path, gptoss.py's sinks).

Contract: `flash_op()` is torch's `_scaled_dot_product_flash_attention_for_cpu` (out, logsumexp, ...), or
False where this torch has none. `cpu_flash(q, k, v, mask, dropout, scaling, lse)` is its output for q (B, H, Q, D),
k/v (B, H, K, D) and an additive mask of q's dtype (or None), exactly the call torch's SDPA pinned to that
kernel makes, or None where that is not known to be the same call.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def flash_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", False)


def cpu_flash(q, k, v, mask, dropout, scaling, lse: bool = False):
    """out, or (out, logsumexp) with `lse` (the contract); None where that is not the same call."""
    ok = (
        dropout == 0.0
        and q.dim() == 4
        and q.dtype in (torch.float32, torch.bfloat16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and (mask is None or mask.dtype == q.dtype)
        and not torch.is_grad_enabled()
        and flash_op()
    )
    if not ok:
        return None
    try:
        got = flash_op()(q, k, v, 0.0, False, attn_mask=mask, scale=scaling)
    except RuntimeError:  # the kernel refuses these inputs: the pinned call decides (and falls back)
        return None
    return got[:2] if lse else got[0]
