"""Synthetic checkpoints the GPU run times: 70B-shaped decoder layers, a 1B-shaped draft, in the run's folder.

Contract:
- `TARGET` / `DRAFT`: Llama-3-70B's decoder layer (hidden 8192, MLP 28672, 64 query heads of head_dim
  128, 8 KV heads: 8:1 GQA) and Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads of 64, 8 KV
  heads, MLP 8192), both with a 32000-token vocabulary: the globals are resident and not what is
  timed, and the full 128k vocabulary would triple the bytes each format writes. `SMOKE_*` are the
  same proportions tiny, for the CPU.
- `write_bf16(dir, shape, layers, device)`: random bf16 weights (std 0.02), safetensors, one file per
  layer (bench/gpu.py's writer); a finished write is reused (its config.json is written last).
- `write_q4k(dir, shape, layers)`: the same shape as a GGUF in llama.cpp's Q4_K_M mix (Q4_K, Q6_K for
  half the V/down weights and the output; tests/gguf_build.write_sparse_llama's header), the data
  region filled with random blocks whose fp16 scales are small and finite (no NaN or Inf: the
  values change no kernel's work, a real file's would do the same).
- `write_nf4_stack(dir, shape, layers, device)`: an nf4 (bitsandbytes) checkpoint of `layers`
  identical decoder layers without a 16-bit copy of them: ONE random bf16 layer quantized by the
  4-bit cache's writer (offload/quant/quant_cache.write_quantized, the device's packing), its
  shard written again under each layer's names, the globals linked; `.done` is written last and a
  finished write is reused. The 16-bit source (one layer) is removed once quantized.
- `layer_numel(shape)`: the linear weights of one decoder layer.
Everything lands under the folder given (the run's --out): nothing outside it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 32000
TARGET = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=VOCAB,
)
DRAFT = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=VOCAB,
    layers=16,
)
SMOKE_TARGET = dict(
    hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=1, head_dim=32, vocab_size=512
)
SMOKE_DRAFT = dict(
    hidden_size=64,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=512,
    layers=2,
)


def _bench_gpu():
    """bench/gpu.py as a module (its checkpoint writer and layer shapes)."""
    spec = importlib.util.spec_from_file_location("specx_bench_gpu", ROOT / "bench" / "gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def layer_numel(shape: dict) -> int:
    """Linear weights of one decoder layer (q, k, v, o and the three MLP matrices)."""
    return _bench_gpu().layer_params(shape)[0]


def write_bf16(out: Path, shape: dict, layers: int, device: torch.device, seed: int = 0) -> Path:
    """A random bf16 Llama of `shape` with `layers` decoder layers at `out` (reused when complete)."""
    shape = {k: v for k, v in shape.items() if k != "layers"}
    return _bench_gpu().write_model(out, shape, layers, device, seed=seed)


def write_q4k(out: Path, shape: dict, layers: int, seed: int = 0) -> Path:
    """A GGUF Q4_K_M of `shape` at `out` (a .gguf file), random blocks with finite scales."""
    import gguf

    from tests.gguf_build import write_sparse_llama

    if out.exists() and out.with_suffix(".done").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    dims = dict(
        layers=layers,
        hidden=shape["hidden_size"],
        ffn=shape["intermediate_size"],
        heads=shape["num_attention_heads"],
        kv_heads=shape["num_key_value_heads"],
        vocab=shape["vocab_size"],
        ctx=8192,
    )
    write_sparse_llama(out, dims)
    reader = gguf.GGUFReader(out, "r+")
    rng = np.random.default_rng(seed)
    scale = np.array([0.002], dtype=np.float16).view(np.uint8)
    for t in reader.tensors:
        data = t.data.reshape(-1).view(np.uint8)
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            data.view(np.float32)[:] = 1.0
            continue
        _per, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        blocks = data.reshape(-1, size)
        for r0 in range(0, len(blocks), 1 << 18):  # 256k blocks at a time: bounded host temporaries
            chunk = blocks[r0 : r0 + (1 << 18)]
            chunk[:] = rng.integers(0, 256, size=chunk.shape, dtype=np.uint8)
            for off in (0, 2) if t.tensor_type in (gguf.GGMLQuantizationType.Q4_K,) else (size - 2,):
                chunk[:, off : off + 2] = scale  # d and dmin (Q4_K) or d (Q6_K): small finite fp16
    reader.data.flush()
    del reader
    out.with_suffix(".done").write_text("")
    return out


def write_nf4_stack(out: Path, shape: dict, layers: int, device: torch.device) -> Path:
    """A pre-quantized nf4 Llama of `layers` copies of one random layer at `out` (reused when complete)."""
    from safetensors.torch import load_file, save_file

    from offload import packing_for
    from offload.quant.quant_cache import write_quantized

    done, dst = out / ".done", out / "stack"
    if done.exists() and done.read_text() == str(layers):
        return dst
    shutil.rmtree(out, ignore_errors=True)
    src, one = write_bf16(out / "src", shape, 1, device), out / "one"
    write_quantized(src, one, tokenizer=True, packing=packing_for(device))
    shutil.rmtree(src)
    index = json.loads((one / "model.safetensors.index.json").read_text())["weight_map"]
    layer_file = index["model.layers.0.input_layernorm.weight"]
    dst.mkdir()
    layer, weight_map = load_file(str(one / layer_file)), {}
    for i in range(layers):  # the same bytes under layer i's names: one shard per layer
        tensors = {k.replace("model.layers.0.", f"model.layers.{i}.", 1): t for k, t in layer.items()}
        save_file(tensors, str(dst / f"layer-{i:03d}.safetensors"), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f"layer-{i:03d}.safetensors"))
    glob = {k for k, f in index.items() if f != layer_file}
    try:
        os.link(one / index[next(iter(glob))], dst / "globals.safetensors")
    except OSError:  # a file system without hard links
        shutil.copy(one / index[next(iter(glob))], dst / "globals.safetensors")
    weight_map.update(dict.fromkeys(glob, "globals.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(one / f, dst / f)
    cfg = json.loads((one / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=layers)))
    shutil.rmtree(one)  # the globals live on through their link
    done.write_text(str(layers))
    return dst


def nf4_layer_bytes(shape: dict) -> int:
    """Bytes of one decoder layer in the nf4 cache: 4-bit codes, 8-bit absmax per 64, norms in bf16."""
    lin, norms = _bench_gpu().layer_params(shape)
    return lin // 2 + lin // 64 + lin // (64 * 256) * 4 + 2 * norms


def target_bytes(shape: dict, layers: int) -> int:
    """bf16 bytes of a stack's decoder layers (what the 16-bit run streams)."""
    lin, norms = _bench_gpu().layer_params(shape)
    return 2 * layers * (lin + norms)


def layers_for(shape: dict, want: int, ram_bytes: int, disk_bytes: int) -> int:
    """As many layers as asked, capped so the bf16 stack + its nf4 cache + the Q4_K file take at most
    half the free disk and the bf16 RAM arena at most 40% of available RAM."""
    one = target_bytes(shape, 1)
    per_layer_disk = one * (1 + 0.28 + 0.30)  # bf16 + nf4 (4.1 bits + absmax) + Q4_K_M (~4.8 bits)
    return max(1, min(want, int(0.5 * disk_bytes // per_layer_disk), int(0.4 * ram_bytes // one)))


def gemm_flops(shape: dict, n: int) -> float:
    """FLOPs of one layer's linears over n tokens."""
    return 2.0 * n * layer_numel(shape)


def attention_flops(shape: dict, n: int, past: int) -> float:
    """FLOPs of one layer's attention over n new tokens against past + n keys (QK^T and PV)."""
    return 4.0 * n * (past + n) * shape["num_attention_heads"] * shape["head_dim"]


def head_flops(shape: dict, n: int) -> float:
    """FLOPs of the lm_head over n tokens."""
    return 2.0 * n * shape["hidden_size"] * shape["vocab_size"]


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def tree_parents(n: int, seed: int = 0) -> torch.Tensor:
    """A random tree of n nodes (node 0 the root): each node's parent is its predecessor half the
    time (deep chains, as a drafted tree's best branch), else a uniformly drawn earlier node."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((n,), -1, dtype=torch.long)
    for i in range(1, n):
        parents[i] = i - 1 if torch.rand((), generator=g) < 0.5 else int(torch.randint(0, i, (), generator=g))
    return parents


def depth_of(parents: torch.Tensor) -> torch.Tensor:
    depth = torch.zeros_like(parents)
    for i in range(1, parents.numel()):
        depth[i] = depth[parents[i]] + 1
    return depth
