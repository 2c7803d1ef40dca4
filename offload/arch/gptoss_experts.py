"""gpt-oss's experts computed one routed expert at a time, from expert e's slice of each fused tensor.

Contract: `RoutedExperts(experts, compute_dtype)` stands in for transformers' GptOssExperts `experts`
(hidden (T, H), router indices (T, K), routing weights (T, K) -> (T, H)) where the experts are not four 3-D
parameters bound whole: a format's stored blocks (formats/mxfp4.py, formats/gguf_gptoss.py subclass it) or
experts read on demand (stream/expertstore.py sets `source`; `source.stream(es)`, where it exists, reads ahead).
`parts(e)` is {name: row e} of each fused tensor (`names`); `weights(parts)` -> (gate_up (H, 2I), gate_up_bias
(2I,), down (I, H), down_bias (H,)) in `compute_dtype`. The math is transformers' "grouped_mm" path, so the
outputs are its bits: per (token, slot) routed to e, y = gate(x W_gu + b_gu) W_d + b_d (GptOssExperts._apply_gate)
times its routing weight, summed over the K slots; a slot whose index is E (computed elsewhere) adds zero.
"""

from __future__ import annotations

import torch
from torch import nn

NAMES = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class RoutedExperts(nn.Module):
    names = NAMES  # the fused tensors, [E, ...] each; expert e's part is row e
    source = None  # None: parts come from the parameters; else source(e) -> {name: expert e's part}

    def __init__(self, experts: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_experts, self.alpha, self.limit = experts.num_experts, experts.alpha, experts.limit
        self.compute_dtype = compute_dtype

    @classmethod
    def from_hf(cls, experts: nn.Module) -> RoutedExperts:
        """A 16/32-bit RoutedExperts holding transformers' GptOssExperts' parameters (same tensors)."""
        out = cls(experts)
        for name in NAMES:
            setattr(out, name, getattr(experts, name))
        return out

    def parts(self, e: int) -> dict[str, torch.Tensor]:
        if self.source is not None:
            return self.source(e)
        return {name: getattr(self, name)[e] for name in self.names}

    def weights(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(parts[n] for n in NAMES)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        return GptOssExperts._apply_gate(self, gate_up)  # reads self.alpha, self.limit

    def stream(self, experts: list[int]):
        """Each of `experts`' parts in order: the source's own stream (reading ahead) where it has one,
        else parts(e)."""
        if self.source is not None and hasattr(self.source, "stream"):
            return self.source.stream(experts)
        return (self.parts(e) for e in experts)

    def expert(self, parts: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """One expert (its parts) on rows x (n, H) -> (n, H), before the routing weight."""
        gate_up, gate_up_bias, down, down_bias = self.weights(parts)
        h = torch.mm(x.to(gate_up.dtype), gate_up)  # (n, 2I), gate and up interleaved by column
        h.add_(gate_up_bias)
        h = self._apply_gate(h)  # (n, I)
        y = torch.mm(h.to(down.dtype), down)  # (n, H)
        return y.add_(down_bias)

    def forward(self, hidden_states: torch.Tensor, router_indices=None, routing_weights=None) -> torch.Tensor:
        t, k = router_indices.shape
        flat = router_indices.reshape(-1)  # (T K,): pair p = token p // K, slot p % K
        out = hidden_states.new_zeros(t * k, hidden_states.shape[-1])  # weighted output of each pair
        # ascending, as transformers' sort groups them; an index E marks a slot computed elsewhere (split: zero here)
        experts = [e for e in torch.unique(flat).tolist() if e < self.num_experts]
        for e, parts in zip(experts, self.stream(experts)):
            pairs = (flat == e).nonzero()[:, 0]
            y = self.expert(parts, hidden_states[pairs // k])
            out[pairs] = (y * routing_weights.reshape(-1)[pairs, None]).to(out.dtype)
        # transformers sums each token's K weighted outputs with one reduction (not index_add_)
        return out.view(t, k, -1).sum(dim=1).to(hidden_states.dtype)
