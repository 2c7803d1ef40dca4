"""Sparse safetensors checkpoints at real sizes, for memory-plan tests.

Contract: `write_sparse(config_json, out_dir)` writes config.json and safetensors shards whose
headers list every tensor a HF Llama / Qwen2 checkpoint of that config holds (bf16, real shapes,
contiguous data offsets) and whose data regions are holes made by truncate: a 70B checkpoint
costs a few kB of disk. Shards hold `layers_per_shard` decoder layers each, with an index json,
like real multi-file checkpoints. Reading a weight from these files yields zeros.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "configs"


def tensor_shapes(cfg: dict) -> dict[str, list[int]]:
    """Every tensor name -> shape of a Llama/Qwen2 checkpoint with this config."""
    h, inter, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or h // heads
    out = {"model.embed_tokens.weight": [cfg["vocab_size"], h], "model.norm.weight": [h]}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = [cfg["vocab_size"], h]
    bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    for i in range(n):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [heads * hd, h],
                p + "self_attn.k_proj.weight": [kv * hd, h],
                p + "self_attn.v_proj.weight": [kv * hd, h],
                p + "self_attn.o_proj.weight": [h, heads * hd],
                p + "mlp.gate_proj.weight": [inter, h],
                p + "mlp.up_proj.weight": [inter, h],
                p + "mlp.down_proj.weight": [h, inter],
            }
        )
        if bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": [heads * hd],
                    p + "self_attn.k_proj.bias": [kv * hd],
                    p + "self_attn.v_proj.bias": [kv * hd],
                }
            )
    return out


def _write_shard(path: Path, shapes: dict[str, list[int]]) -> None:
    header, off = {}, 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + off)  # a hole: no data blocks are written


def write_sparse(config: str | Path, out_dir: Path, layers_per_shard: int = 10) -> Path:
    """Sparse checkpoint of fixtures/configs/<config>.json (or a path to a config.json)."""
    src = Path(config) if Path(config).exists() else FIXTURES / f"{config}.json"
    cfg = json.loads(src.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, out_dir / "config.json")
    shapes = tensor_shapes(cfg)
    groups: dict[str, dict[str, list[int]]] = {}
    for name, shape in shapes.items():
        layer = int(name.split(".")[2]) // layers_per_shard + 1 if name.startswith("model.layers.") else 0
        groups.setdefault(f"model-{layer:05d}.safetensors", {})[name] = shape
    weight_map = {}
    for fname, group in sorted(groups.items()):
        _write_shard(out_dir / fname, group)
        weight_map.update({n: fname for n in group})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out_dir


def read_checkpoint(path: str | Path) -> SimpleNamespace:
    """What the memory plan reads of open_checkpoint's Checkpoint (config, tensor headers, root),
    without the validation's meta model (seconds for a 128-expert MoE); never the weight bytes."""
    from offload.formats.st_index import SafetensorsIndex

    root = Path(path)
    return SimpleNamespace(
        config=json.loads((root / "config.json").read_text()), tensors=SafetensorsIndex(root).entries, root=root
    )
