"""Gemma-3 (`gemma3_text`) for a caller that computes one rotary pass and hands it to every layer.

Contract: `causal_lm_class()` is a subclass of transformers' Gemma3ForCausalLM with the same parameters,
buffers and outputs. HF rotates local and global layers with different RoPE bases (its rotary takes a
`layer_type`), while specx computes `rotary_emb(h, position_ids)` once per pass: `TypedRotary` without
a layer type returns a `TypedRope`, the global layers' (cos, sin) carrying every type's pair in
`by_type`, and each `TypedLayer` picks its own type's pair (a plain (cos, sin) passes through).
A config with `PLUS_ONE` (GGUF: norm weights stored as 1 + w) gets `PlusOneNorm`s computing HF's
x_hat * (1 + (s - 1)) from the stored s, bitwise what HF computes from w = s - 1.
"""

from __future__ import annotations

from functools import lru_cache

PLUS_ONE = "specx_norms_plus_one"  # config attribute: norm weights are stored as 1 + w (GGUF)


class TypedRope(tuple):
    """(cos, sin) of the global layers; `by_type[layer_type]` is each layer type's (cos, sin)."""

    by_type: dict


@lru_cache(maxsize=1)
def causal_lm_class():
    from transformers import Gemma3ForCausalLM
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RMSNorm, Gemma3RotaryEmbedding

    class TypedRotary(Gemma3RotaryEmbedding):
        def forward(self, x, position_ids, layer_type=None):
            if layer_type is not None:
                return super().forward(x, position_ids, layer_type)
            forward = super().forward
            by_type = {t: forward(x, position_ids, t) for t in self.layer_types}  # this config's types, sorted
            rope = TypedRope(by_type.get("full_attention") or next(iter(by_type.values())))
            rope.by_type = by_type
            return rope

    class TypedLayer(Gemma3DecoderLayer):
        def forward(self, hidden_states, position_embeddings=None, *args, **kwargs):
            if isinstance(position_embeddings, TypedRope):
                position_embeddings = position_embeddings.by_type[self.self_attn.layer_type]
            return super().forward(hidden_states, position_embeddings, *args, **kwargs)

    # hfcompat reads a layer's cache keyword (`cache` or `past_key_values`) off its forward's
    # signature: point it at HF's own forward, which this one passes every keyword to
    TypedLayer.forward.__wrapped__ = Gemma3DecoderLayer.forward

    class PlusOneNorm(Gemma3RMSNorm):
        def forward(self, x):
            out = self._norm(x.float())
            return (out * (1.0 + (self.weight.float() - 1.0))).type_as(x)

    class SpecxGemma3ForCausalLM(Gemma3ForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            # same buffers and parameters: only the classes change, so nothing is re-initialised
            self.model.rotary_emb.__class__ = TypedRotary
            for layer in self.model.layers:
                layer.__class__ = TypedLayer
            if getattr(config, PLUS_ONE, False):
                for mod in self.model.modules():
                    if type(mod) is Gemma3RMSNorm:
                        mod.__class__ = PlusOneNorm

    return SpecxGemma3ForCausalLM
