"""The "split" expert placement (offload/stream/splitexperts.py) on the stored formats beyond the per-expert
safetensors families tests/test_moe_split.py covers: gpt-oss's fused experts (tests/test_gpt_oss.py's fp32 model,
its MXFP4 copy, a bf16 one) and the GGUF files of tests/test_gguf_moe_apart.py (Q8_0 and Q4_K_M) and
tests/test_gguf_gpt_oss.py (F32, MXFP4_MOE, a converted MXFP4 checkpoint; slow, skipped without llama.cpp).
Checked as there: greedy ids equal transformers' and whole-layer streaming's, every tier non-empty, no layer
streams, and a large pass streams its routed experts to the device.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_gguf_gpt_oss import built  # noqa: F401 - fixture
from tests.test_gguf_moe_apart import case  # noqa: F401 - fixture
from tests.test_moe_experts_apart import _greedy
from tests.test_moe_split import check_split, check_streamed, greedy_layers, hf_ids, split_model


@pytest.fixture(scope="module", params=["fp32", "mxfp4"])
def gpt_oss(request, tmp_path_factory):
    """(kind, target dir, transformers' greedy ids: for MXFP4 its Mxfp4Config(dequantize=True) load's)."""
    from tests.mxfp4_ckpt import hf_dequantized, write_mxfp4
    from tests.test_gpt_oss import hf_greedy, make_gpt_oss

    root = tmp_path_factory.mktemp(f"gpt_oss_{request.param}")
    source = make_gpt_oss(root / "source", seed=0)
    if request.param == "fp32":
        return request.param, source, hf_greedy(source)
    target = write_mxfp4(source, root / "target")
    return request.param, target, hf_ids(hf_dequantized(target))


def test_gpt_oss_split_equals_hf_and_whole_layers(gpt_oss):
    """gpt-oss's fused experts (expert e: row e of each fused tensor; MXFP4 blocks and scales as stored) split."""
    check_split(gpt_oss[1], gpt_oss[2])


def test_gpt_oss_large_pass_streams_its_experts(gpt_oss, monkeypatch):
    """gpt-oss's fused experts (MXFP4 as stored) streamed to the device for the prefill, as per-expert ones are."""
    check_streamed(gpt_oss[1], gpt_oss[2], monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_bf16_checkpoint_split_equals_whole_layers(tmp_path, dtype):
    """A bf16 gpt-oss, computed in bf16 or cast to fp32: split gives whole-layer streaming's greedy ids."""
    from tests.test_gpt_oss import make_gpt_oss

    path = make_gpt_oss(tmp_path / "bf16", seed=0, dtype=torch.bfloat16)
    with split_model(path, dtype=dtype) as m:
        got = _greedy(m)
    assert got == greedy_layers(path, dtype)


@pytest.mark.slow
def test_gguf_moe_split_equals_transformers_and_whole_layers(case):  # noqa: F811
    """A mixture-of-experts GGUF (tests/test_gguf_moe_apart.py's files: Q8_0 Qwen3-MoE, Qwen2-MoE, Mixtral and a
    Q4_K_M Qwen3-MoE): each expert its rows of the fused tensors as stored, computed by the GGUF kernels."""
    from tests.test_gguf_moe import PROMPT as GGUF_PROMPT
    from tests.test_gguf_moe import byte_level_tokenizer
    from tests.test_gguf_moe_apart import greedy

    check_split(case[2], case[3], greedy, byte_level_tokenizer()(GGUF_PROMPT)["input_ids"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["f32", "mxfp4", "st_mxfp4"])
def test_gguf_gpt_oss_split_equals_transformers(built, kind):  # noqa: F811
    """gpt-oss GGUFs (tests/test_gguf_gpt_oss.py's: F32, llama-quantize's MXFP4_MOE, a converted MXFP4 checkpoint)."""
    from tests.test_gguf_gpt_oss import _kind
    from tests.test_gguf_moe_apart import greedy

    _kind(built, kind)
    f, want = built[3][kind], built[4][kind]
    with split_model(f) as m:
        assert greedy(m) == want, kind
