"""Sparse safetensors checkpoints of mixture-of-experts models at real sizes, for memory-plan tests.

Contract: `write_sparse_moe(config, out_dir)` writes config.json (fixtures/configs/<config>.json) and
safetensors shards whose headers list every tensor the Hugging Face checkpoint of that config holds
(bf16, real shapes, contiguous offsets; data regions are holes, as tests/sparse_ckpt.py writes them):
Mixtral (`block_sparse_moe.gate` + per-expert w1/w3/w2), Qwen3-MoE (q/k norms, `mlp.gate` +
per-expert gate/up/down) and gpt-oss 16-bit (attention biases and sinks, `mlp.router` with bias, the
fused `mlp.experts.gate_up_proj` (E, H, 2I) / `down_proj` (E, I, H) and their biases, as the bf16
copies of the published MXFP4 weights store them). `moe_tensor_shapes(cfg)` is the name -> shape map.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.sparse_ckpt import FIXTURES, _write_shard


def _attention(cfg: dict, p: str) -> dict[str, list[int]]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg["num_key_value_heads"], cfg.get("head_dim") or h // heads
    out = {
        p + "input_layernorm.weight": [h],
        p + "post_attention_layernorm.weight": [h],
        p + "self_attn.q_proj.weight": [heads * hd, h],
        p + "self_attn.k_proj.weight": [kv * hd, h],
        p + "self_attn.v_proj.weight": [kv * hd, h],
        p + "self_attn.o_proj.weight": [h, heads * hd],
    }
    if cfg["model_type"] == "qwen3_moe":
        out.update({p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]})
    if cfg["model_type"] == "gpt_oss":
        out.update(
            {
                p + "self_attn.q_proj.bias": [heads * hd],
                p + "self_attn.k_proj.bias": [kv * hd],
                p + "self_attn.v_proj.bias": [kv * hd],
                p + "self_attn.o_proj.bias": [h],
                p + "self_attn.sinks": [heads],
            }
        )
    return out


def _experts(cfg: dict, p: str) -> dict[str, list[int]]:
    h, kind = cfg["hidden_size"], cfg["model_type"]
    e = cfg.get("num_local_experts") or cfg["num_experts"]
    if kind == "gpt_oss":
        i = cfg["intermediate_size"]
        return {
            p + "mlp.router.weight": [e, h],
            p + "mlp.router.bias": [e],
            p + "mlp.experts.gate_up_proj": [e, h, 2 * i],
            p + "mlp.experts.gate_up_proj_bias": [e, 2 * i],
            p + "mlp.experts.down_proj": [e, i, h],
            p + "mlp.experts.down_proj_bias": [e, h],
        }
    block, names = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if kind == "mixtral"
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    i = cfg["intermediate_size"] if kind == "mixtral" else cfg["moe_intermediate_size"]
    out = {p + f"{block}.gate.weight": [e, h]}
    for x in range(e):
        q = p + f"{block}.experts.{x}."
        out.update(
            {q + f"{names[0]}.weight": [i, h], q + f"{names[1]}.weight": [i, h], q + f"{names[2]}.weight": [h, i]}
        )
    return out


def moe_tensor_shapes(cfg: dict) -> dict[str, list[int]]:
    """Every tensor name -> shape of the checkpoint of this MoE config (every layer sparse)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    out = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = [v, h]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update(_attention(cfg, p))
        out.update(_experts(cfg, p))
    return out


def write_sparse_moe(config: str | Path, out_dir: Path, layers_per_shard: int = 4) -> Path:
    """Sparse checkpoint of fixtures/configs/<config>.json (or a path to a config.json)."""
    src = Path(config) if Path(config).exists() else FIXTURES / f"{config}.json"
    cfg = json.loads(src.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, out_dir / "config.json")
    groups: dict[str, dict[str, list[int]]] = {}
    for name, shape in moe_tensor_shapes(cfg).items():
        layer = int(name.split(".")[2]) // layers_per_shard + 1 if name.startswith("model.layers.") else 0
        groups.setdefault(f"model-{layer:05d}.safetensors", {})[name] = shape
    weight_map = {}
    for fname, group in sorted(groups.items()):
        _write_shard(out_dir / fname, group)
        weight_map.update({n: fname for n in group})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out_dir
