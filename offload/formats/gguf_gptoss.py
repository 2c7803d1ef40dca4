"""gpt-oss GGUF files (llama.cpp architecture `gpt-oss`) read onto transformers' GptOssForCausalLM.

Contract:
- `config_dict(head)`: GptOssConfig's dict from the metadata keys (transformers' own GGUF
  table for gpt-oss misreads the YaRN keys): sizes, expert counts, llama.cpp's sliding-window layer
  pattern, RoPE (YaRN from `rope.scaling.*`, `truncate: false`), and the SwiGLU clamp `LIMIT` that no
  key carries. A missing key or another RoPE scaling is one OffloadError line.
- `hf_params(config)`: ({GGUF name: specx name}, {specx name: logical shape}), transformers' names but
  for the experts, which llama.cpp stores de-interleaved and transposed (`ffn_{gate,up}_exps` (E, I, H),
  `ffn_down_exps` (E, H, I), biases (E, I) / (E, H)): kept as stored as `mlp.experts.{gate,up,down}_{weight,bias}`.
- `GgufExperts` (an arch RoutedExperts) holds those six as stored (block-quantized: flat bytes, expert e
  the e-th 1/E of them); `weights(parts)` dequantizes one expert and re-fuses it into transformers'
  layout: gate_up (H, 2I), column 2i = gate row i and 2i + 1 = up row i; down (I, H).
- `swap_gguf_experts(layers, ckpt, compute_dtype)` puts one in every decoder layer of a meta-built model.
"""

from __future__ import annotations

import torch
from torch import nn

from offload.arch.gptoss_experts import RoutedExperts
from offload.errors import OffloadError
from offload.formats import gguf_meta
from offload.formats import gguf_quants as gq
from offload.formats.base import meta_param

ARCH = "gpt-oss"
LIMIT = 7.0  # llama.cpp's SwiGLU clamp for gpt-oss (llm_graph: LLM_FFN_SWIGLU_OAI_MOE), alpha 1.702 as HF's
GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER = {  # blk.N.<key> -> model.layers.N.<value>
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{
        f"attn_{g}.{s}": f"self_attn.{h}_proj.{s}"
        for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
        for s in ("weight", "bias")
    },
    **{f"ffn_{p}_exps.{s}": f"mlp.experts.{p}_{s}" for p in ("gate", "up", "down") for s in ("weight", "bias")},
}
REQUIRED = {  # metadata key (after `gpt-oss.`) -> HF config key
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "expert_feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
    "attention.sliding_window": "sliding_window",
    "context_length": "max_position_embeddings",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}


def config_dict(head) -> dict:

    def v(key, default=None):
        return gguf_meta.value(head, f"{ARCH}.{key}", default)

    cfg = {"model_type": "gpt_oss", "swiglu_limit": LIMIT}
    for key, hf in REQUIRED.items():
        if v(key) is None:
            raise OffloadError(
                f"{head.path}: gpt-oss metadata key '{ARCH}.{key}' is missing; re-convert the file "
                "with llama.cpp's convert_hf_to_gguf.py"
            )
        cfg[hf] = v(key)
    cfg["layer_types"] = _layer_types(v("attention.sliding_window_pattern", 2), int(cfg["num_hidden_layers"]))
    cfg["rope_parameters"] = _rope(head, v)
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if gguf_meta.value(head, f"tokenizer.ggml.{key}") is not None:
            cfg[key.replace("padding", "pad")] = int(gguf_meta.value(head, f"tokenizer.ggml.{key}"))
    return cfg


def _layer_types(pattern, n: int) -> list[str]:
    """llama.cpp's sliding-window pattern (llama_hparams::set_swa_pattern, dense last): an int p makes
    layer i sliding when i % p < p - 1 (p = 0: every layer); a per-layer array says it layer by layer."""
    if isinstance(pattern, (list, tuple)):
        swa = [bool(x) for x in pattern][:n]
    else:
        p = int(pattern)
        swa = [p == 0 or i % p < p - 1 for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in swa]


def _rope(head, v) -> dict:
    """HF rope_parameters from `rope.freq_base` and `rope.scaling.*` (YaRN or none)."""
    theta = float(v("rope.freq_base", 10000.0))
    kind = v("rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    old = v("rope.scaling.original_context_length")
    if kind != "yarn" or old is None:
        raise OffloadError(
            f"{head.path}: gpt-oss GGUF with rope.scaling.type {str(kind)[:20]!r}"
            f"{'' if old else ' and no original_context_length'}; specx reads YaRN scaling only"
        )
    return {
        "rope_type": "yarn",
        "factor": float(v("rope.scaling.factor", 1.0)),
        "beta_fast": float(v("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(v("rope.scaling.yarn_beta_slow", 1.0)),
        "original_max_position_embeddings": int(old),
        "truncate": False,
        "rope_theta": theta,
    }


def hf_params(config) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """(GGUF name -> specx name, specx name -> logical shape): transformers' parameters, the experts as stored."""
    from offload.arch.families import causal_lm_class

    with torch.device("meta"):
        hf = causal_lm_class(config)(config)
    shapes = {n: tuple(p.shape) for n, p in hf.named_parameters(remove_duplicate=False) if ".mlp.experts." not in n}
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    names = dict(GLOBAL)
    for layer in range(config.num_hidden_layers):
        names.update({f"blk.{layer}.{g}": f"model.layers.{layer}.{s}" for g, s in LAYER.items()})
        for part, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
            shapes[f"model.layers.{layer}.mlp.experts.{part}_weight"] = shape  # rows = outputs (ggml's layout)
            shapes[f"model.layers.{layer}.mlp.experts.{part}_bias"] = shape[:2]
    return names, shapes


class GgufExperts(RoutedExperts):
    names = tuple(f"{p}_{s}" for p in ("gate", "up", "down") for s in ("weight", "bias"))

    def __init__(self, experts: nn.Module, infos: dict, compute_dtype: torch.dtype):
        super().__init__(experts, compute_dtype)
        self.packed = {}  # name -> (ggml type, one expert's logical shape) for block-quantized tensors
        for name in self.names:
            info = infos[name]
            setattr(self, name, meta_param(info))
            if info.qtype is not None:
                self.packed[name] = (info.meta["ggml_type"], tuple(info.meta["shape"][1:]))

    def parts(self, e: int) -> dict[str, torch.Tensor]:
        if self.source is not None:
            return self.source(e)
        # a block-quantized tensor's expert e: the e-th 1/E of its bytes (E whole-row matrices back to back)
        return {
            n: getattr(self, n).view(self.num_experts, -1)[e] if n in self.packed else getattr(self, n)[e]
            for n in self.names
        }

    def _value(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name in self.packed:
            qtype, shape = self.packed[name]
            return gq.dequantize(t, qtype, shape, self.compute_dtype)
        return t.to(self.compute_dtype)

    def weights(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """One expert's (gate_up (H, 2I), its bias (2I,), down (I, H), its bias (H,)) in transformers' layout."""
        w = {n: self._value(n, t) for n, t in parts.items()}
        rows = torch.stack((w["gate_weight"], w["up_weight"]), dim=1)  # (I, 2, H): gate row i, then up row i
        gate_up = rows.reshape(-1, rows.shape[-1]).t().contiguous()  # (H, 2I): columns g0 u0 g1 u1 ... as HF's
        bias = torch.stack((w["gate_bias"], w["up_bias"]), dim=1).reshape(-1)  # (2I,) interleaved the same way
        return gate_up, bias, w["down_weight"].t().contiguous(), w["down_bias"]  # down (H, I) -> (I, H)


def swap_gguf_experts(layers: nn.ModuleList, ckpt, compute_dtype: torch.dtype) -> None:
    for i, layer in enumerate(layers):
        infos = {n: ckpt.tensors[f"model.layers.{i}.mlp.experts.{n}"] for n in GgufExperts.names}
        layer.mlp.experts = GgufExperts(layer.mlp.experts, infos, compute_dtype)
