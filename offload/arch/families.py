"""Model families: what differs between the decoder-only LMs the offload path runs.

Contract: `causal_lm_class(config)` returns the HF *ForCausalLM class for a `SUPPORTED` `model_type`
(Gemma-3 as gemma3.py's subclass, the mixture-of-experts families as moe.py's) or raises OffloadError;
`meta_model(config, where)` builds it on the meta device (one OffloadError line when it cannot).
`Family.of(config)` gives the knobs `OffloadedCausalLM` applies around HF's decoder layers: the attention
implementation, `final_softcap` (Gemma-2: logits <- cap * tanh(logits / cap)) and the sliding-window
layers. `window_mask(mask, q_pos, k_pos, window)` puts a sliding window on an additive 4-D mask by
ABSOLUTE positions (HF returns caller-built 4-D tree masks unchanged). `restore_buffers` re-creates
Gemma's non-persistent `embed_scale` (lost by `to_empty`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.arch import moe
from offload.errors import OffloadError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", *moe.MOE_FAMILIES)


def causal_lm_class(config):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in SUPPORTED:
        raise OffloadError(f"unsupported model_type {config.model_type!r}; supported: {', '.join(SUPPORTED)}")
    if config.model_type == "gemma3_text":
        from offload.arch import gemma3

        return gemma3.causal_lm_class()
    if config.model_type in moe.MOE_FAMILIES:
        return moe.causal_lm_class(config.model_type)
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type])  # HF's class, as is


def meta_model(config, where, fix: str = "fix or re-download it"):
    """The contract's OffloadError line names `where` and `fix`."""
    try:
        with torch.device("meta"):
            return causal_lm_class(config)(config)
    except (RuntimeError, ValueError, TypeError, ArithmeticError, AttributeError) as exc:
        raise OffloadError(
            f"{where}: cannot build the model ({exc.__class__.__name__}: {str(exc)[:100]}); {fix}"
        ) from None


@dataclass(frozen=True)
class Family:
    attn_implementation: str  # "specx_gqa", "eager" where logits are soft-capped, "specx_sinks" (gpt-oss)
    final_softcap: float | None  # Gemma-2 final_logit_softcapping (None = off)
    layer_types: tuple[str, ...]  # per decoder layer: "full_attention" | "sliding_attention"
    sliding_window: int | None  # keys with q_pos - k_pos >= window are masked on sliding layers

    @classmethod
    def of(cls, config) -> Family:
        n = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types:
            types = tuple(types[:n])
        else:
            # Mistral and Mixtral (and Qwen with use_sliding_window) apply one window to every layer.
            on = bool(window) and (
                config.model_type in ("mistral", "mixtral") or getattr(config, "use_sliding_window", False)
            )
            types = ("sliding_attention" if on else "full_attention",) * n
        if "sliding_attention" not in types:
            window = None
        return cls(
            attn_implementation=_attention(config),
            final_softcap=getattr(config, "final_logit_softcapping", None),
            layer_types=types,
            sliding_window=window,
        )


def _attention(config) -> str:
    if config.model_type == "gpt_oss":
        from offload.arch.gptoss import register

        return register()  # "specx_sinks"
    from offload.arch.attention import implementation  # "sdpa" runs as the GQA-aware specx_gqa

    return "eager" if getattr(config, "attn_logit_softcapping", None) else implementation("sdpa")


def window_mask(mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Additive (B, 1, Q, K) mask with keys at distance >= window also masked; q_pos (Q,), k_pos (K,)
    the absolute positions of the queries and of the keys (cache row order)."""
    far = (q_pos[:, None] - k_pos[None, :]) >= window  # (Q, K)
    return mask.masked_fill(far[None, None], torch.finfo(mask.dtype).min)


def apply_final_softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def restore_buffers(module: torch.nn.Module) -> None:
    for mod in module.modules():
        if hasattr(mod, "scalar_embed_scale") and hasattr(mod, "embed_scale"):
            mod.embed_scale = torch.tensor(mod.scalar_embed_scale, device=mod.weight.device)
