"""gpt-oss (transformers' GptOssForCausalLM) from 16/32-bit or MXFP4 safetensors, with attention sinks under any mask.

Contract: gpt-oss runs as transformers' GptOssForCausalLM unchanged (moe.MOE_FAMILIES names it): its
parameter names are the checkpoint's tensor names (a layer's experts are four stored tensors,
`mlp.experts.gate_up_proj` (E, H, 2I) with gate and up interleaved by column, `gate_up_proj_bias`
(E, 2I), `down_proj` (E, I, H), `down_proj_bias` (E, H)), so the loader binds and streams them like any
layer's parameters. `register()` (idempotent) adds the attention function `NAME` ("specx_sinks") the
family runs under, with transformers' `eager_mask` as its mask builder; `sink_attention_forward` also
takes transformers' other mask forms (None = causal, bool), so attention.py's "specx_gqa" hands it
every call that carries sinks (`s_aux`). Attention with sinks is softmax([q k^T * scale + mask,
sink_h]) without the sink's column, @ V: the sink logit joins each head's denominator only. With the
CPU flash kernel, which returns each row's logsumexp L of the masked logits, the output is
flash(q, k, v, mask) * sigmoid(L - sink_h) (= e^L / (e^L + e^sink_h)), equal to transformers' to fp32
rounding; that path serves fp32 on the CPU only. Elsewhere it is transformers' gpt-oss eager function
itself (in 16 bits the two round differently enough to change a greedy continuation). Both take any
additive mask, the caller's 4-D tree masks included.
"""

from __future__ import annotations

import torch

from offload.arch.cpuflash import flash_op

NAME = "specx_sinks"


def register() -> str:
    """Make NAME known to transformers (attention and mask interfaces); returns NAME."""
    from transformers.masking_utils import eager_mask

    from offload.arch.hfcompat import register_as

    return register_as(NAME, sink_attention_forward, eager_mask)


def _flash_with_lse(query, key, value, mask, scaling):
    """(out (B, H, Q, D), logsumexp (B, H, Q)) from the CPU flash kernel in fp32, or None where it does not apply."""
    ok = (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and key.dtype == value.dtype == query.dtype
        and mask is not None
        and mask.dtype == query.dtype
        and not torch.is_grad_enabled()
        and flash_op()
    )
    if not ok:
        return None
    try:
        out, lse = flash_op()(query, key, value, 0.0, False, attn_mask=mask, scale=scaling)[:2]
    except RuntimeError:  # the kernel refuses these inputs: the eager path decides
        return None
    return out, lse


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
    got = None
    if dropout == 0.0 and not kwargs.get("output_attentions", False):
        got = _flash_with_lse(query, key, value, mask, scaling)
    if got is None:
        return eager_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    out, lse = got
    # each row's share that survives the sink: e^L / (e^L + e^s) = sigmoid(L - s), per head h
    keep = torch.sigmoid(lse - module.sinks.float()[None, :, None])  # (B, H, Q)
    out = out * keep[..., None].to(out.dtype)
    return out.transpose(1, 2).contiguous(), None
