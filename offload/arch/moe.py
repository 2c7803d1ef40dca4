"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) with one parameter per stored tensor.

Contract: `causal_lm_class(model_type)` is a subclass of transformers' *ForCausalLM for a `MOE_FAMILIES`
type whose parameter names are the checkpoint's, so the loader binds, streams and checks the experts like
any dense layer's: each sparse block's fused `experts` becomes an `ExpertList` of E `Expert`s of three
nn.Linear named as stored (`model.layers.i.mlp.experts.e.gate_proj.weight`; Mixtral's w1, w3, w2 under
`block_sparse_moe`, still reached as `layer.mlp`). `ExpertList.forward(hidden (T, H), top_k_index (T, K),
top_k_weights (T, K))` is HF's eager experts loop; a loader holding the experts apart sets `source`
(`ExpertList.routed`). gpt-oss stores fused experts: its class is transformers' own (gptoss.py).
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

# model_type -> (HF class, (gate, up, down) linear names as stored, the block's stored name);
# names None: the checkpoint stores the fused 3-D experts themselves, HF's class runs as is (gptoss.py)
MOE_FAMILIES = {
    "mixtral": ("MixtralForCausalLM", ("w1", "w3", "w2"), "block_sparse_moe"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", ("gate_proj", "up_proj", "down_proj"), "mlp"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", ("gate_proj", "up_proj", "down_proj"), "mlp"),
    "gpt_oss": ("GptOssForCausalLM", None, "mlp"),
}


class Expert(nn.Module):
    """One expert's SwiGLU-style MLP: down(act(gate(x)) * up(x)), x (t, H) -> (t, H)."""

    def __init__(self, hidden: int, inter: int, act, names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        for name, (fan_in, fan_out) in zip(names, ((hidden, inter), (hidden, inter), (inter, hidden))):
            setattr(self, name, nn.Linear(fan_in, fan_out, bias=False))
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class ExpertList(nn.ModuleList):
    """HF's fused experts module as E separate `Expert`s (children "0".."E-1"), same forward."""

    source = None  # None: the children hold their weights; else source(e) -> expert e, weights bound (contract)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        n = len(self)
        out = torch.zeros_like(hidden_states)  # (T, H)
        with torch.no_grad():
            # (T, K) expert ids -> (E + 1, K, T) one-hot; index E is an "unassigned" slot HF skips
            mask = nn.functional.one_hot(top_k_index, num_classes=n + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        es = [e for e in hit[:, 0].tolist() if e != n]
        for e, expert in zip(es, self.routed(es)):
            k_pos, tok = torch.where(mask[e])  # (slot k, token) pairs routed to e
            y = expert(hidden_states[tok]) * top_k_weights[tok, k_pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def routed(self, es: list[int]):
        """Experts `es` in order, weights in place: the children, else the source's `stream(es)` (reading
        ahead) where it has one, else source(e) one at a time."""
        if self.source is None:
            return (self[e] for e in es)
        if hasattr(self.source, "stream"):
            return self.source.stream(es)
        return (self.source(e) for e in es)


def _split_layers(model: nn.Module, model_type: str) -> None:
    """Replace each block's `experts` (HF's fused 3-D parameters) by an ExpertList of the same shapes."""
    _, names, stored = MOE_FAMILIES[model_type]
    for layer in model.model.layers:
        block = layer.mlp
        fused = getattr(block, "experts", None)
        if fused is None:
            continue  # a dense MLP layer (Qwen mlp_only_layers)
        if getattr(fused, "has_bias", False) or not hasattr(fused, "gate_up_proj"):
            raise TypeError(f"{type(fused).__name__}: experts with biases or without a gate are not supported")
        block.experts = ExpertList(
            Expert(fused.hidden_dim, fused.intermediate_dim, fused.act_fn, names) for _ in range(fused.num_experts)
        )
        if stored != "mlp":
            # register the block under its stored name (parameter names follow), and keep `layer.mlp`,
            # which HF's decoder layer calls, as a plain attribute (outside _modules: named once)
            del layer._modules["mlp"]
            layer.add_module(stored, block)
            object.__setattr__(layer, "mlp", block)


@cache
def causal_lm_class(model_type: str):
    import transformers

    base = getattr(transformers, MOE_FAMILIES[model_type][0])
    if MOE_FAMILIES[model_type][1] is None:  # gpt-oss: transformers' own class (gptoss.py)
        return base

    class PerExpertCausalLM(base):
        def __init__(self, config):
            super().__init__(config)
            _split_layers(self, model_type)

    PerExpertCausalLM.__name__ = PerExpertCausalLM.__qualname__ = f"PerExpert{base.__name__}"
    return PerExpertCausalLM
