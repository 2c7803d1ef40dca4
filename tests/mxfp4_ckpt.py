"""Tiny gpt-oss checkpoints with MXFP4 experts, laid out as the published ones (offload/formats/mxfp4.py).

Contract: `quantize(w)` turns logical expert matrices w (E, K, N) (x @ W per expert) into their stored
(blocks (E, N, K/32, 16) uint8, scales (E, N, K/32) uint8): per group of 32 inputs the smallest E8M0
exponent s with max|w| <= 6 * 2^(s - 127), each weight rounded to the nearest FP4 e2m1 value of w / 2^(s-127),
input 2j in byte j's low nibble and 2j + 1 in its high one. `write_mxfp4(src, out)` re-stores a 16/32-bit
gpt-oss checkpoint `src` so (the experts' matrices quantized, everything else as it was, config.json with
`quantization_config: {quant_method: mxfp4}`, the test tokenizer). `hf_dequantized(path, dtype)` is
transformers' own load of it with `Mxfp4Config(dequantize=True)`, computing in `dtype`: the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from offload.formats.mxfp4 import FP4_VALUES, GROUP
from tests.conftest import make_tokenizer

_POSITIVE = torch.tensor(FP4_VALUES[:8])  # codes 0..7; code | 8 is the negative


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, K, N) float -> (blocks (E, N, K/32, 16), scales (E, N, K/32)), uint8 both."""
    e, k, n = w.shape
    g = w.float().transpose(1, 2).reshape(e, n, k // GROUP, GROUP)  # (E, N, G, 32): a group's 32 inputs
    amax = g.abs().amax(dim=-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # max|w| / 2^exp <= 6, the largest FP4 value
    x = g / torch.exp2(exp)[..., None]
    code = (x.abs()[..., None] - _POSITIVE).abs().argmin(dim=-1)  # nearest magnitude, 0..7
    code = (code | ((x < 0) & (code > 0)).long() * 8).to(torch.uint8)  # sign bit 3 (no negative zero)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)  # (E, N, G, 16)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def write_mxfp4(src: Path, out: Path) -> Path:
    """A copy of the gpt-oss checkpoint `src` with its experts' matrices stored as MXFP4."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize(tensors.pop(name))
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(cfg))
    make_tokenizer().save_pretrained(out)
    return out


def hf_dequantized(path: Path, dtype=torch.float32):
    """transformers' GptOssForCausalLM of the MXFP4 checkpoint, its experts dequantized at load."""
    import transformers

    q = transformers.Mxfp4Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=q).eval()
    # transformers 5.17 keeps the dequantized experts in bf16 whatever `dtype` says (5.24 follows it); the
    # values are exact in bf16, so the cast makes both versions compute in `dtype`
    return model.to(dtype)
