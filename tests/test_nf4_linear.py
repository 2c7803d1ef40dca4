"""NF4 linears: specx's Nf4Linear and the offloaded model against bitsandbytes' Linear4bit and an
independent dequantization (moved out of test_offload_io.py, which keeps the I/O tests)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from offload import OffloadedCausalLM
from tests.test_offload_io import SMALL, _ids, _make

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _linear4bit_reference(path, compute_dtype):
    """HF model whose decoder-layer linears are bitsandbytes Linear4bit (NF4) on the same bf16 weights."""
    from bitsandbytes.nn import Linear4bit, Params4bit

    ref = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for layer in ref.model.layers:
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, nn.Linear):
                q = Linear4bit(
                    mod.in_features,
                    mod.out_features,
                    bias=mod.bias is not None,
                    compute_dtype=compute_dtype,
                    quant_type="nf4",
                )
                q.weight = Params4bit(
                    mod.weight.data.clone(),
                    requires_grad=False,
                    quant_type="nf4",
                    compress_statistics=True,
                    blocksize=64,
                )
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent), child, q.to("cpu"))
    # norms / embeddings / lm_head in the compute dtype; Linear4bit keeps its packed weights
    for mod in ref.modules():
        if not isinstance(mod, Linear4bit):
            for _name, p in mod.named_parameters(recurse=False):
                p.data = p.data.to(compute_dtype)
    return ref.eval()  # the fresh Linear4bit modules too: eval picks bnb's CPU kernel where HF would


@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_nf4_matches_bnb_linear4bit(tmp_path, offload):
    path = _make(LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, **SMALL), tmp_path, seed=5, dtype=torch.bfloat16)
    ref = _linear4bit_reference(path, torch.float32)
    model = OffloadedCausalLM.from_pretrained(path, dtype="nf4", offload=offload)
    try:
        assert model.dtype == torch.float32  # nf4 computes in fp32 on CPU, bf16 on CUDA
        # packed NF4 bytes per layer: 4 bits per linear weight + norms, far below bf16 size
        assert model.plan.bytes_per_layer < 0.35 * (2 * 4 * 64 * 64 + 2 * 3 * 64 * 128)
        ids = _ids()
        with torch.no_grad():
            expected = ref(input_ids=ids).logits.float()
        for _ in range(2):
            torch.testing.assert_close(model(input_ids=ids).logits.float(), expected, atol=1e-5, rtol=1e-5)
    finally:
        model.close()


def test_nf4_linear_matches_linear4bit_bf16():
    """The bf16 compute path (used on CUDA) against Linear4bit on one layer's weight."""
    from bitsandbytes.nn import Linear4bit, Params4bit

    from offload.quant.nf4 import Nf4Linear, quantize_nf4

    torch.manual_seed(3)
    w, b = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    ref = Linear4bit(64, 96, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4")
    ref.weight = Params4bit(w.clone(), requires_grad=False, quant_type="nf4", compress_statistics=True, blocksize=64)
    ref.bias = nn.Parameter(b.clone(), requires_grad=False)
    ref = ref.to("cpu").eval()  # eval: the inference kernel transformers' generate uses
    packed, state = quantize_nf4(w, torch.device("cpu"))
    ours = Nf4Linear(64, 96, True, torch.bfloat16)
    ours.weight, ours.bias = nn.Parameter(packed, requires_grad=False), nn.Parameter(b.clone(), requires_grad=False)
    ours.quant_state = state
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(packed, ref.weight.data)
        torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)


# NF4 code book (QLoRA, arXiv 2305.14314, Appendix E): the 16 normal-float levels in [-1, 1]
NF4_LEVELS = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)


def test_nf4_linear_matches_independent_dequantization():
    """Packed bytes, statistics and the bf16 matmul checked against NF4 decoded here from first principles:
    blocks of 64, code = nearest NF4 level of w / absmax(block), two codes per byte (first in the high
    nibble), absmax double-quantized to 8 bits (code book × absmax2 per 256 blocks + offset)."""
    from offload.quant.nf4 import Nf4Linear, quantize_nf4

    torch.manual_seed(4)
    out_f, in_f = 96, 64
    w, b = torch.randn(out_f, in_f, dtype=torch.bfloat16), torch.randn(out_f, dtype=torch.bfloat16)
    packed, state = quantize_nf4(w, torch.device("cpu"))
    blocks = w.float().reshape(-1, 64)
    absmax = blocks.abs().amax(1)
    want = ((blocks / absmax[:, None]).unsqueeze(-1) - NF4_LEVELS).abs().argmin(-1).flatten()  # (n,) codes
    raw = packed.flatten().long()
    codes = torch.stack([raw >> 4, raw & 15], dim=1).flatten()[: w.numel()]
    assert (codes != want).float().mean() < 0.005  # only exact midpoints may round either way
    s2 = state.state2
    q_absmax = s2.code[state.absmax.long()] * s2.absmax.repeat_interleave(s2.blocksize)[: absmax.numel()] + state.offset
    torch.testing.assert_close(q_absmax, absmax, rtol=2e-2, atol=0)
    w_deq = (NF4_LEVELS[codes].reshape(-1, 64) * q_absmax[:, None]).reshape(out_f, in_f)
    ours = Nf4Linear(in_f, out_f, True, torch.bfloat16)
    ours.weight, ours.bias = nn.Parameter(packed, requires_grad=False), nn.Parameter(b.clone(), requires_grad=False)
    ours.quant_state = state
    x = torch.randn(3, 5, in_f, dtype=torch.bfloat16)
    with torch.no_grad():
        got = ours(x).float()
    expected = x.float() @ w_deq.T + b.float()
    torch.testing.assert_close(got, expected, atol=6e-2, rtol=2e-2)
    assert (got - x.float() @ w.float().T - b.float()).abs().max() > 1e-2  # it IS quantized (not a plain matmul)
