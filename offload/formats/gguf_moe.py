"""Mixture-of-experts GGUF files (Qwen3-MoE, Qwen2-MoE, Mixtral) read onto the per-expert HF model.

Contract (gguf.py's reader, at open):
- `model_type(first, arch, experts)`: HF model_type of a GGUF with `{arch}.expert_count` (`llama` is
  how llama.cpp writes a Mixtral); any other MoE architecture is one OffloadError line.
- `TABLE`: which of transformers' GGUF key tables reads a type; `config_keys(head, arch, model_type,
  cfg)` adds what they leave out: expert and shared-expert FFN sizes (keys, else layer 0's tensors),
  Mixtral's expert counts, llama.cpp's routing (Qwen2-MoE's top-k not renormalised; every layer sparse).
- `expert_names(config, shapes)`: {fused `blk.N.ffn_{gate,up,down}_exps.weight`: HF per-expert names
  in expert order}; `legacy_names(fused)`: the same under the per-expert names of older Mixtral files.
- `slices(part, t, count)`: the E per-expert views of fused tensor `t`, expert e's whole rows at its
  own byte range (nothing copied at open).
- `fit_shape(info, want)`: a 1-D stored vector that is HF's (1, n) weight (Qwen2-MoE's shared-expert
  gate) gets that shape.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from offload.errors import OffloadError
from offload.formats import gguf_meta
from offload.formats import gguf_quants as gq
from offload.formats.base import TensorInfo

MODEL_TYPE = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral", "gpt-oss": "gpt_oss"}
TABLE = {"mixtral": "llama"}  # transformers' GGUF key table for the type, where it has none of its own
_PROJ = ("gate", "up", "down")  # llama.cpp's ffn_{gate,up,down}_exps, in arch/moe.MOE_FAMILIES name order
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight")


def model_type(first: Path, arch: str, experts) -> str:
    if arch not in MODEL_TYPE:
        raise OffloadError(
            f"{first}: a mixture-of-experts GGUF ({experts} experts) is not supported yet; use the model's "
            f"safetensors checkpoint (specx reads the MoE GGUFs of qwen3moe, qwen2moe and Mixtral, not {str(arch)[:40]!r})"
        )
    return MODEL_TYPE[arch]


def config_keys(head, arch: str, model_type: str, cfg: dict) -> None:

    def v(key):
        return gguf_meta.value(head, f"{arch}.{key}")

    for key, hf, tensor in (
        ("expert_feed_forward_length", "moe_intermediate_size", "blk.0.ffn_gate_exps.weight"),
        ("expert_shared_feed_forward_length", "shared_expert_intermediate_size", "blk.0.ffn_gate_shexp.weight"),
    ):
        size = v(key) if v(key) is not None else _rows(head, tensor)
        if size is not None and model_type != "mixtral":  # Mixtral's experts are intermediate_size wide
            cfg[hf] = int(size)
    if model_type == "mixtral":
        cfg["num_local_experts"] = int(v("expert_count"))
        cfg["num_experts_per_tok"] = int(v("expert_used_count") or 2)
    if model_type == "qwen2_moe":
        cfg["norm_topk_prob"] = False  # llama.cpp's qwen2moe graph weights the top-k as the softmax gives them
    if model_type in ("qwen2_moe", "qwen3_moe"):
        cfg.update(mlp_only_layers=[], decoder_sparse_step=1)


def _rows(head, name: str) -> int | None:
    """Rows of tensor `name` (ggml dims (cols, rows, ...)) in this part, or None: the size files written
    before llama.cpp stored the expert FFN sizes as keys imply."""
    t = next((t for t in head.tensors if t.name == name), None)
    return int(t.shape[1]) if t is not None and len(t.shape) >= 2 else None


def expert_names(config, shapes: dict) -> dict[str, list[str]]:
    from offload.arch.moe import MOE_FAMILIES

    names = MOE_FAMILIES[config.model_type][1]
    if names is None:  # gpt-oss: its experts keep their stored form (gguf_gptoss.py)
        return {}
    out: dict[str, dict[int, str]] = {}
    for hf_name in shapes:
        m = _EXPERT.fullmatch(hf_name)
        if m and m[4] in names:
            fused = f"blk.{m[1]}.ffn_{_PROJ[names.index(m[4])]}_exps.weight"
            out.setdefault(fused, {})[int(m[3])] = hf_name
    return {k: [d[e] for e in sorted(d)] for k, d in out.items()}


def legacy_names(fused: dict[str, list[str]]) -> dict[str, str]:
    """{`blk.N.ffn_gate.E.weight`: HF name}: the per-expert tensors of Mixtral files written before
    llama.cpp fused them (early 2024), each read as it is stored."""
    return {
        k.replace("_exps.weight", f".{e}.weight"): name for k, names in fused.items() for e, name in enumerate(names)
    }


def slices(part: Path, t, count: int) -> list:
    """The `count` per-expert views of fused tensor `t` (see the contract), as ReaderTensor-like records."""
    dims = [int(d) for d in t.shape.tolist()]  # ggml order: (cols, rows, experts)
    tid = int(t.tensor_type)
    if len(dims) != 3 or dims[2] != count:
        raise OffloadError(
            f"{part}: tensor {t.name!r} has shape {list(reversed(dims))}, not {count} experts' matrices; "
            "the file does not match its metadata"
        )
    per = gq.nbytes(tid, (dims[1], dims[0]))
    shape = np.array(dims[:2])  # a ggml shape as gguf's ReaderTensor.shape holds it
    return [
        SimpleNamespace(name=f"{t.name}[{e}]", tensor_type=tid, shape=shape, data_offset=int(t.data_offset) + e * per)
        for e in range(count)
    ]


def fit_shape(info: TensorInfo, want: tuple[int, ...] | None) -> TensorInfo:
    stored = tuple(info.meta["shape"])
    if want is None or len(want) != 2 or want[0] != 1 or stored != tuple(want[1:]):
        return info
    shape = tuple(want) if info.qtype is None else info.shape
    return dataclasses.replace(info, shape=shape, meta={**info.meta, "shape": tuple(want)})
