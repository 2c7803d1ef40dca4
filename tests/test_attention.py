"""offload/arch/attention.py: GQA attention without repeated K/V, against transformers' own kernels.

A tiny seeded Llama (fp32) with 8:1 and 2:1 grouping runs a prefix, then a tree pass under a 4-D
additive tree mask over the cache; the logits under NAME equal those of HF's "sdpa" and "eager"
implementations of the same weights, and while NAME runs, transformers' `repeat_kv` (in its SDPA
integration and in the Llama module) raises: no K/V is ever repeated. The streamed OffloadedCausalLM
runs under NAME too.
"""

from __future__ import annotations

import pytest
import torch

from offload.arch import attention
from offload.arch.hfcompat import cache_kwargs


def _model(heads: int, kv_heads: int, impl: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = attention.implementation("sdpa") if impl == "sdpa*" else impl
    return model


def _tree(past: int):
    """A 7-node tree (root, two children, grandchildren): ids, (1, 7) positions, (1, 1, 7, past+7) mask."""
    parents = [-1, 0, 0, 1, 1, 2, 5]
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    n = len(parents)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            allowed[i, j] = True
            j = parents[j]
    mask = torch.full((1, 1, n, past + n), torch.finfo(torch.float32).min)
    mask[..., :past] = 0
    mask[..., past:] = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    return torch.tensor([[5, 7, 9, 11, 13, 17, 19]]), torch.tensor([depth]) + past, mask


def _logits(model, prefix, tree):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prefix, **cache_kwargs(model, cache), use_cache=True)
        ids, pos, mask = tree
        return model(
            input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache), use_cache=True
        ).logits


def _no_repeat(monkeypatch):
    import transformers.integrations.sdpa_attention as hf_sdpa
    import transformers.models.llama.modeling_llama as hf_llama

    def boom(*a, **k):
        raise AssertionError("repeat_kv called")

    monkeypatch.setattr(hf_sdpa, "repeat_kv", boom)
    monkeypatch.setattr(hf_llama, "repeat_kv", boom)


@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (4, 2)])
def test_equal_logits_and_no_repeat(heads, kv_heads, monkeypatch):
    prefix = torch.tensor([[1, 2, 3, 4, 5, 6, 8, 10, 12]])
    tree = _tree(prefix.shape[1])
    refs = {impl: _logits(_model(heads, kv_heads, impl), prefix, tree) for impl in ("sdpa", "eager")}
    _no_repeat(monkeypatch)
    with pytest.raises(AssertionError, match="repeat_kv"):  # the patch bites HF's own masked path
        _logits(_model(heads, kv_heads, "sdpa"), prefix, tree)
    ours = _logits(_model(heads, kv_heads, "sdpa*"), prefix, tree)
    for impl, ref in refs.items():
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5, msg=f"{impl}")


def test_implementation_names():
    assert attention.implementation("sdpa") == attention.NAME
    assert attention.implementation("eager") == "eager"  # Gemma-2's soft-capped attention
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert attention.NAME in AttentionInterface._global_mapping
    assert attention.NAME in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


def test_prepared_mask_aligned_once_and_released():
    """CUDA's mask preparation: a bool mask becomes additive at a width rounded to 8 (strides the
    memory-efficient kernel takes without a copy), once per source mask, gone at release()."""
    allowed = torch.rand(1, 1, 3, 13) > 0.5
    a = attention._prepared(allowed, torch.float32, 4)
    assert a.shape == (1, 1, 12, 13) and all(s % attention.ALIGN == 0 for s in a.stride()[:-1])
    assert attention._prepared(allowed, torch.float32, 4) is a  # shared by every layer
    want = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[0, 0]
    for g in range(4):
        assert torch.equal(a[0, 0, 3 * g : 3 * g + 3], want)
    aligned = torch.zeros(1, 1, 3, 16)[..., :13]  # core/tree.py's layout
    assert attention._prepared(aligned, torch.float32, 1) is aligned  # used as is, no copy
    attention.release()
    assert not attention._PREPARED
    attention._prepared(allowed, torch.float32, 2)
    del allowed  # dies with its source mask
    assert not attention._PREPARED


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("strategy", ["fold", "groups"])
@pytest.mark.parametrize("as_bool", [False, True])
def test_cuda_strategies_equal_gqa(q_len, strategy, as_bool):
    """The fold and per-group paths CUDA runs (here on CPU, torch's own backend) equal one SDPA
    call with enable_gqa, for tree-like masks given as bool or additive."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, q_len, 16), torch.randn(1, 2, 11, 16), torch.randn(1, 2, 11, 16)
    allowed = torch.rand(1, 1, q_len, 11) > 0.4
    allowed[..., 0] = True
    mask = allowed if as_bool else torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    out = attention.without_gqa(q, k, v, mask, 4, 0.0, None, strategy, None)
    attention.release()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_strategy_choice():
    assert attention.mask_strategy("cpu", 2048, 8, 8, 128) == "gqa"
    assert attention.mask_strategy("cuda", 1, 8, 8, 128) == "fold"
    assert attention.mask_strategy("cuda", 256, 8, 8, 128) == "fold"  # folded mask <= one layer's K/V
    assert attention.mask_strategy("cuda", 257, 8, 8, 128) == "groups"
    assert attention.mask_strategy("cuda", 64, 1, 8, 128) == "none"


def test_offloaded_model_runs_gqa_attention(tmp_path, monkeypatch):
    """The streamed decoder (offload/stream/model.py) runs under NAME and matches HF's sdpa logits, no repeat."""
    from offload.stream.model import OffloadedCausalLM

    hf = _model(8, 1, "sdpa")
    hf.save_pretrained(tmp_path)
    prefix = torch.tensor([[1, 2, 3, 4, 5, 6, 8, 10, 12]])
    tree = _tree(prefix.shape[1])
    ref = _logits(hf, prefix, tree)
    model = OffloadedCausalLM.from_pretrained(tmp_path, offload="disk", max_host_memory=0)
    try:
        assert model.config._attn_implementation == attention.NAME
        _no_repeat(monkeypatch)
        torch.testing.assert_close(_logits(model, prefix, tree), ref, rtol=1e-5, atol=1e-5)
    finally:
        model.close()


def test_prepared_once_for_all_layers(monkeypatch):
    """Every layer of a pass gets the same mask object from transformers: the CUDA path prepares it once."""
    made = []
    real = torch.empty

    def counting(*a, **k):
        out = real(*a, **k)
        made.append(out.shape)
        return out

    torch.manual_seed(0)
    q, k = torch.randn(1, 8, 300, 16), torch.randn(1, 2, 311, 16)
    allowed = torch.rand(1, 1, 300, 311) > 0.4
    module = torch.nn.Module()
    module.num_key_value_groups = 4
    monkeypatch.setattr(attention, "mask_strategy", lambda *a: "groups")  # CUDA's choice for a 300-token pass
    monkeypatch.setattr(torch, "empty", counting)
    for _ in range(3):  # three layers, one prepared mask
        attention.gqa_attention_forward(module, q, k, k, allowed)
    attention.release()
    assert made.count((1, 1, 300, 312)) == 1
