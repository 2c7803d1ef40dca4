"""gpt-oss (transformers' GptOssForCausalLM) from 16/32-bit or MXFP4 safetensors, with attention sinks under any mask.

Contract: gpt-oss runs as transformers' GptOssForCausalLM unchanged, its parameter names the checkpoint's
(a layer's experts are four fused tensors: `gate_up_proj` (E, H, 2I) with gate and up interleaved by
column, `gate_up_proj_bias` (E, 2I), `down_proj` (E, I, H), `down_proj_bias` (E, H)). `register()`
(idempotent) adds the attention function `NAME` ("specx_sinks") with transformers' `eager_mask`;
`sink_attention_forward` takes any mask form (None = causal, bool, additive, tree masks included).
With sinks, attention is softmax([q k^T * scale + mask, sink_h]) without the sink's column, @ V. In fp32
on the CPU it is flash(q, k, v, mask) * sigmoid(L - sink_h), L the kernel's logsumexp of each row,
equal to transformers' to fp32 rounding; elsewhere transformers' gpt-oss eager function itself (in
16 bits the two round differently enough to change a greedy continuation).
"""

from __future__ import annotations

import torch

from offload.arch.cpuflash import cpu_flash

NAME = "specx_sinks"


def register() -> str:
    from transformers.masking_utils import eager_mask

    from offload.arch.hfcompat import register_as

    return register_as(NAME, sink_attention_forward, eager_mask)


def _additive(mask: torch.Tensor | None, q_len: int, k_len: int, dtype, device) -> torch.Tensor:
    """(B, 1, Q, K) additive `dtype` mask from transformers' forms: None (causal, the Q queries being
    the last Q of the K keys: query q sees keys j <= K - Q + q), bool (True = attend) or additive."""
    low = torch.finfo(dtype).min
    if mask is None:
        seen = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)  # (Q, 1) last key each query sees
        far = torch.arange(k_len, device=device)[None, :] > seen  # (Q, K)
        return torch.zeros(1, 1, q_len, k_len, dtype=dtype, device=device).masked_fill(far, low)
    if mask.shape[-1] != k_len:
        mask = mask[..., :k_len]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, low)
    return mask.to(dtype)


def sink_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, H, Q, D), key/value (B, Hkv, K, D), mask (B, 1, Q, K) or None -> ((B, Q, H, D), weights)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    kwargs.pop("is_causal", None)
    mask = _additive(attention_mask, query.shape[2], key.shape[2], query.dtype, query.device)
    got = None  # (out (B, H, Q, D), logsumexp (B, H, Q)) from the CPU flash kernel, in fp32 only
    if query.is_cpu and query.dtype == torch.float32 and not kwargs.get("output_attentions", False):
        got = cpu_flash(query, key, value, mask, dropout, scaling, lse=True)
    if got is None:
        return eager_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    out, lse = got
    # each row's share that survives the sink: e^L / (e^L + e^s) = sigmoid(L - s), per head h
    keep = torch.sigmoid(lse - module.sinks.float()[None, :, None])  # (B, H, Q)
    out = out * keep[..., None].to(out.dtype)
    return out.transpose(1, 2).contiguous(), None
