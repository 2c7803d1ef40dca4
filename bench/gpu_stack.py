"""The GPU day's stack: a 70B-shaped checkpoint of random weights, sized to the machine's disk and RAM.

Contract: `SHAPE_70B` is Llama-3-70B's decoder layer and vocabulary (hidden 8192, MLP 28672, 64 heads
of head_dim 128, 8 KV heads: 8:1 GQA, 128256 tokens) and `DRAFT_70B` a small draft of the same
vocabulary (2 layers, hidden 512); the `*_SMOKE` shapes are tiny ones in the same proportions for a
CPU. `layer_tensors(shape)` names one decoder layer's tensors with their dims and `layer_params`
counts its linear and norm parameters. `disk_bytes` is what bench/gpu.py's phases write, per file
family: the 16-bit checkpoint, the nf4 cache (packed layers plus its 16-bit copy of the globals),
one HQQ cache per width below 4 (fp32 scales and zeros) and the draft. `layer_count` takes as many
layers as asked, as 85% of the free disk (every file counted) and 50% of the available RAM allow,
and exits naming the fix when not one fits. `write_model` writes a random bf16 Llama (std 0.02,
norms 1, the demo tokenizer) one safetensors file per layer, config.json last: a directory whose
config.json matches is a finished write and is reused. bench/gpu.py imports these names (and
tools/gpuday/stack.py reaches them through it).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import psutil
import torch

DEMO = Path(__file__).resolve().parents[1] / "specexec_cli" / "demo"
SHAPE_70B = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
)
SHAPE_SMOKE = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=1, head_dim=32, vocab_size=8192
)
DRAFT_70B = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=128,
    num_hidden_layers=2,
)
DRAFT_SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    num_hidden_layers=1,
)


def layer_tensors(shape: dict) -> dict[str, list[int]]:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    hd = shape.get("head_dim") or h // shape["num_attention_heads"]
    q = shape["num_attention_heads"] * hd
    kv = shape["num_key_value_heads"] * hd
    return {
        "input_layernorm.weight": [h],
        "post_attention_layernorm.weight": [h],
        "self_attn.q_proj.weight": [q, h],
        "self_attn.k_proj.weight": [kv, h],
        "self_attn.v_proj.weight": [kv, h],
        "self_attn.o_proj.weight": [h, q],
        "mlp.gate_proj.weight": [i, h],
        "mlp.up_proj.weight": [i, h],
        "mlp.down_proj.weight": [h, i],
    }


def layer_params(shape: dict) -> tuple[int, int]:
    """(linear weights, norm weights) of one decoder layer, in parameters."""
    t = layer_tensors(shape)
    return (sum(math.prod(d) for d in t.values() if len(d) == 2), sum(math.prod(d) for d in t.values() if len(d) == 1))


def disk_bytes(shape: dict, layers: int, bits: list[int], draft: dict) -> dict[str, int]:
    """Bytes every phase writes, per file family: checkpoint, nf4 cache, HQQ caches, draft."""
    from offload.quant.lowbit import lowbit_weight_bytes

    lin, norms = layer_params(shape)
    glob = 2 * (2 * shape["vocab_size"] * shape["hidden_size"] + shape["hidden_size"])  # embed + lm_head + norm, bf16
    nf4_layer = lin // 2 + lin // 64 + lin // (64 * 256) * 4 + 2 * norms  # codes, 8-bit absmax, nested fp32
    hqq_layer = {
        b: sum(lowbit_weight_bytes(tuple(d), b, 4) for d in layer_tensors(shape).values() if len(d) == 2) + 2 * norms
        for b in bits
        if b in (3, 2)
    }
    dl, dn = layer_params(dict(draft, vocab_size=shape["vocab_size"]))
    return {
        "checkpoint": glob + layers * 2 * (lin + norms),
        "nf4_cache": glob + layers * nf4_layer,
        **{f"hqq{b}_cache": layers * n for b, n in hqq_layer.items()},
        "draft": 2 * (2 * shape["vocab_size"] * draft["hidden_size"] + draft["num_hidden_layers"] * (dl + dn)),
    }


def layer_count(shape: dict, want: int, bits: list[int], draft: dict, where: list[Path]) -> tuple[int, dict]:
    """As many layers as asked, 85% of the free disk (all files counted) and 50% of RAM allow."""
    free = min(shutil.disk_usage(existing(p)).free for p in where)
    lin, norms = layer_params(shape)
    fixed = sum(disk_bytes(shape, 0, bits, draft).values())
    per = sum(disk_bytes(shape, 1, bits, draft).values()) - fixed
    by_disk = (int(0.85 * free) - fixed) // per
    by_ram = int(0.5 * psutil.virtual_memory().available) // (2 * (lin + norms))
    layers = min(want, by_disk, by_ram)
    if layers < 1:
        raise SystemExit(
            f"bench/gpu.py: {free / 2**30:.1f} GiB free on disk holds no layer with its caches "
            f"({per / 2**30:.2f} GiB each, {fixed / 2**30:.1f} GiB fixed); free some disk or --ckpt elsewhere"
        )
    return layers, dict(free_disk=free, planned_disk=disk_bytes(shape, layers, bits, draft))


def existing(p: Path) -> Path:
    while not p.exists():
        p = p.parent
    return p


def write_model(out: Path, shape: dict, layers: int, device: torch.device, seed: int = 0) -> Path:
    """A random bf16 Llama of `shape` (config written last: a matching one marks a whole write)."""
    from safetensors.torch import save_file

    cfg = json.loads((DEMO / "target" / "config.json").read_text())
    cfg.update(
        shape, num_hidden_layers=layers, tie_word_embeddings=False, max_position_embeddings=8192, dtype="bfloat16"
    )
    cfg.pop("torch_dtype", None)
    if (out / "config.json").exists() and json.loads((out / "config.json").read_text()) == cfg:
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(dims):
        return (torch.randn(dims, generator=gen, device=device, dtype=torch.bfloat16) * 0.02).cpu()

    h, v = shape["hidden_size"], cfg["vocab_size"]
    weight_map = {}
    save_file(
        {
            "model.embed_tokens.weight": rand([v, h]),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "lm_head.weight": rand([v, h]),
        },
        out / "globals.safetensors",
    )
    weight_map.update(
        dict.fromkeys(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"], "globals.safetensors")
    )
    for i in range(layers):
        tensors = {
            f"model.layers.{i}.{n}": (torch.ones(d, dtype=torch.bfloat16) if "norm" in n else rand(d))
            for n, d in layer_tensors(shape).items()
        }
        save_file(tensors, out / f"layer-{i:03d}.safetensors")
        weight_map.update(dict.fromkeys(tensors, f"layer-{i:03d}.safetensors"))
        print(f"{out.name}: wrote layer {i + 1}/{layers}", file=sys.stderr, flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO / "target" / f, out / f)
    (out / "config.json").write_text(json.dumps(cfg))
    return out
