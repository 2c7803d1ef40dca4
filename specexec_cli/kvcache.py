"""Model calls and KV-cache surgery shared by every decoding method.

Contract: a model is any HF-style causal LM (resident or `offload.OffloadedCausalLM`) that takes
`input_ids, attention_mask (4-D additive), position_ids, past_key_values` and returns `.logits`.
Caches are `transformers.DynamicCache`; `compact` rewrites each layer's K/V in place so that the
rows kept after a speculative pass become contiguous, with no model re-run.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    """An empty full-attention cache (tree masks need every position, so no sliding layers)."""
    return DynamicCache()


def cache_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def model_dtype(model) -> torch.dtype:
    dtype = getattr(model, "dtype", torch.float32)
    return dtype if dtype.is_floating_point else torch.float32


def forward(model, cache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One model pass over T new tokens. tokens/positions: (T,) long; mask: (1, 1, T, past+T).

    Returns (T, V) logits; the tokens' K/V are appended to `cache`.
    """
    device = model.device
    with torch.inference_mode():
        out = model(
            input_ids=tokens.to(device)[None],  # (1, T)
            position_ids=positions.to(device)[None],  # (1, T)
            attention_mask=mask.to(device=device, dtype=model_dtype(model)),
            past_key_values=cache,
            use_cache=True,
        )
    return out.logits[0]


@torch.inference_mode()
def compact(cache: DynamicCache, start: int, rows: torch.Tensor) -> None:
    """Keep cache rows [0, start) plus the absolute rows `rows` (ascending, all >= start).

    The kept rows are moved to [start, start + len(rows)) and the rest is cut off.
    """
    n = int(rows.numel())
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        idx = rows.to(layer.keys.device)
        for name in ("keys", "values"):
            t = getattr(layer, name)  # (B, H, S, D)
            t[:, :, start : start + n] = t.index_select(2, idx)
            setattr(layer, name, t[:, :, : start + n])


def crop(cache: DynamicCache, length: int) -> None:
    """Cut the cache back to its first `length` positions."""
    compact(cache, length, torch.empty(0, dtype=torch.long))
