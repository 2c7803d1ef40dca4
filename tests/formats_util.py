"""Tiny AWQ / GPTQ / compressed-tensors checkpoints for the format tests.

Contract: `rtn(w, groups, sym)` round-to-nearest 4-bit quantizes an (N, K) weight by input
groups (`groups`: (K,) group of each input column) and returns (codes (N, K) in [0, 15], zeros
(N, G), fp16 scales (N, G)); `reference(codes, zeros, scales, groups)` is the fp32 weight those
codes mean. `write_gptq` / `write_awq` pack them as the formats' published descriptions state
(GPTQ: AutoGPTQ's qweight/qzeros/scales/g_idx, v1 stores zero - 1; AWQ GEMM: AutoAWQ's
interleaved column order), written independently of offload/formats (these are the packers
the readers are checked against). `write_compressed` uses compressed-tensors' own compressor.
Each writer returns {hf linear weight name: fp32 reference weight}; the saved directory holds
the non-linear tensors in fp16, config.json with quantization_config, and the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def rtn(w: torch.Tensor, groups: torch.Tensor, sym: bool, zmin: int = 0):
    n, _ = w.shape
    g = int(groups.max()) + 1
    codes = torch.empty(w.shape, dtype=torch.int64)
    zeros = torch.empty(n, g, dtype=torch.int64)
    scales = torch.empty(n, g, dtype=torch.float16)
    for j in range(g):
        cols = (groups == j).nonzero().flatten()
        blk = w[:, cols].float()
        if sym:
            s = (blk.abs().amax(1) / 7.5).clamp(min=1e-4).half()
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = blk.amin(1).clamp(max=0), blk.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-4).half()
            z = torch.round(-lo / s.float()).clamp(zmin, 15).long()
        codes[:, cols] = torch.round(blk / s.float()[:, None] + z[:, None]).clamp(0, 15).long()
        zeros[:, j], scales[:, j] = z, s
    return codes, zeros, scales


def reference(codes, zeros, scales, groups) -> torch.Tensor:
    gi = groups.long()
    return (codes - zeros[:, gi]).float() * scales[:, gi].float()


def _pack(vals: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """(..., 8M) ints in [0, 15] -> (..., M) int32; field i of a word holds element order[i]."""
    v = vals.reshape(*vals.shape[:-1], -1, 8).long()
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i, src in enumerate(order):
        word |= v[..., src] << (4 * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # wrap to signed int32


def _linears(state: dict) -> list[str]:
    return sorted(n for n, t in state.items() if n.startswith("model.layers.") and n.endswith("_proj.weight"))


def _save(src: Path, out: Path, tensors: dict, qc: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"], cfg["dtype"] = qc, "float16"
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            (out / f.name).write_bytes(f.read_bytes())


def _groups(k: int, g: int, act_order: bool, seed: int) -> torch.Tensor:
    idx = torch.arange(k) // g
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        idx = torch.empty(k, dtype=torch.int64).scatter_(0, perm, torch.arange(k) // g)
    return idx


def write_gptq(
    src: Path, out: Path, group: int = 32, sym: bool = True, act_order: bool = False, v2: bool = False
) -> dict[str, torch.Tensor]:
    state, tensors, refs = load_file(str(src / "model.safetensors")), {}, {}
    lin = _linears(state)
    for name, t in state.items():
        if name not in lin:
            tensors[name] = t.half()
    for s, name in enumerate(lin):
        w = state[name].float()
        n, k = w.shape
        groups = _groups(k, group, act_order, s)
        codes, zeros, scales = rtn(w, groups, sym, zmin=0 if v2 else 1)  # v1 cannot store a zero of 0
        base = name[: -len(".weight")]
        tensors[f"{base}.qweight"] = _pack(codes.t().reshape(k // 8, 8, n).permute(0, 2, 1)).reshape(k // 8, n)
        tensors[f"{base}.qzeros"] = _pack((zeros - (0 if v2 else 1)).t().contiguous())  # (G, N/8)
        tensors[f"{base}.scales"] = scales.t().contiguous()
        tensors[f"{base}.g_idx"] = groups.to(torch.int32)
        refs[name] = reference(codes, zeros, scales, groups)
    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "sym": sym,
        "desc_act": act_order,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    }
    _save(src, out, tensors, qc)
    return refs


def write_awq(src: Path, out: Path, group: int = 32) -> dict[str, torch.Tensor]:
    state, tensors, refs = load_file(str(src / "model.safetensors")), {}, {}
    lin = _linears(state)
    for name, t in state.items():
        if name not in lin:
            tensors[name] = t.half()
    for name in lin:
        w = state[name].float()
        _n, k = w.shape
        groups = torch.arange(k) // group
        codes, zeros, scales = rtn(w, groups, sym=False)
        base = name[: -len(".weight")]
        tensors[f"{base}.qweight"] = _pack(codes.t().contiguous(), AWQ_ORDER)  # (K, N/8)
        tensors[f"{base}.qzeros"] = _pack(zeros.t().contiguous(), AWQ_ORDER)  # (G, N/8)
        tensors[f"{base}.scales"] = scales.t().contiguous()  # (G, N)
        refs[name] = reference(codes, zeros, scales, groups)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    _save(src, out, tensors, qc)
    return refs


def write_compressed(src: Path, out: Path, strategy: str = "group", sym: bool = True, group: int = 32) -> None:
    """compressed-tensors' own pipeline: min-max qparams (its calculate_qparams), its compressor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float16)
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=sym, strategy=strategy, group_size=group if strategy == "group" else None
    )
    apply_quantization_config(
        model,
        QuantizationConfig(
            config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]
        ),
    )
    for m in model.modules():
        if hasattr(m, "weight_scale"):
            w = m.weight.data.float()
            blk = w.view(w.shape[0], -1, group) if strategy == "group" else w.view(w.shape[0], 1, -1)
            s, z = calculate_qparams(blk.amin(-1), blk.amax(-1), args)
            m.weight_scale.data.copy_(s.reshape(m.weight_scale.shape).to(m.weight_scale.dtype))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(z.reshape(m.weight_zero_point.shape).to(m.weight_zero_point.dtype))
    comp = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    comp.compress_model(model)
    model.save_pretrained(out)
    comp.update_config(out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
