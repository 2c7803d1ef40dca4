"""Allocations of one layer's attention against the memory plan's terms (CPU, torch's profiler).

The profiler records every CPU allocation and free (`profile_memory`); their running sum in time
order gives the peak bytes a call held beyond its inputs. One layer's attention (offload/arch/
attention.py's specx_gqa, on q/k/v of a GQA layer with G = 4) runs under a tree mask and under
the boolean causal mask of a prefill chunk over a cache; its peak must stay within the plan's terms
for that call (membytes.pass_bytes: the attention output and its (B, Q, H, D) copy, 2 x T x H x hd x c,
plus attention.mask_bytes, which is 0 on CPU). The same measurement of transformers' own "sdpa"
(it repeats K/V whenever a mask is given) exceeds that bound, so the measurement can fail. A whole
decoder layer over a preallocated cache stays within pass_bytes less the mask and logits.
"""

from __future__ import annotations

import pytest
import torch

from offload.arch import attention

HEADS, KV_HEADS, HEAD_DIM, PAST = 8, 2, 64, 1536


def peak_bytes(fn) -> int:
    """Peak of the running sum of allocations minus frees while `fn` runs (its result included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    held = peak = 0
    for _, delta in events:
        held += delta
        peak = max(peak, held)
    return peak


class _Module(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True
    training = False


def _inputs(t: int, tree: bool):
    torch.manual_seed(0)
    s = PAST + t
    q = torch.randn(1, HEADS, t, HEAD_DIM)
    k, v = torch.randn(1, KV_HEADS, s, HEAD_DIM), torch.randn(1, KV_HEADS, s, HEAD_DIM)
    if tree:  # additive, at the width rounded to 8 (core/tree.py's layout), random ancestor sets
        allowed = torch.rand(t, s) > 0.5
        allowed[:, :PAST] = True
        mask = torch.zeros(t, attention.padded(s))[:, :s].masked_fill_(~allowed, torch.finfo(torch.float32).min)
    else:  # transformers' boolean causal mask of a chunk over PAST cached rows
        mask = torch.ones(t, s, dtype=torch.bool).tril(PAST)
    return q, k, v, mask[None, None]


def _planned(t: int, s: int, tree: bool) -> int:
    c = 4
    return 2 * t * HEADS * HEAD_DIM * c + attention.mask_bytes(
        "cpu", t, s, HEADS // KV_HEADS, KV_HEADS, HEAD_DIM, c, c if tree else 1
    )


@pytest.mark.parametrize("t,tree", [(257, True), (1, True), (512, False)])
def test_attention_within_plan(t, tree):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, mask = _inputs(t, tree)
    ours = peak_bytes(lambda: attention.gqa_attention_forward(_Module(), q, k, v, mask))
    planned = _planned(t, PAST + t, tree)
    assert ours <= planned, (ours, planned)
    hf = peak_bytes(lambda: sdpa_attention_forward(_Module(), q, k, v, mask, is_causal=False))
    if t > 1:
        assert hf > planned  # the bound bites: HF's masked path repeats K/V
    out = attention.gqa_attention_forward(_Module(), q, k, v, mask)[0]
    torch.testing.assert_close(
        out, sdpa_attention_forward(_Module(), q, k, v, mask, is_causal=False)[0], rtol=1e-5, atol=1e-5
    )


def test_decoder_layer_within_pass_bytes():
    """A Llama decoder layer over a reserved slab cache, a 512-token chunk over 1536 cached rows:
    its peak stays within the plan's pass term less the mask (allocated by the caller) and logits."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from offload.arch.hfcompat import cache_kwargs
    from offload.planning.membytes import arch_of, pass_bytes
    from specexec_cli.core.kvcache import SlabCache, reserve

    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
    )
    cfg._attn_implementation = attention.register()
    layer = LlamaDecoderLayer(cfg, 0).eval()
    cache = SlabCache()
    holder = type("M", (), {"config": cfg, "dtype": torch.float32, "device": torch.device("cpu")})()
    reserve(cache, holder, PAST + 512)
    t = 512
    _, _, _, mask = _inputs(t, False)
    pos = torch.arange(PAST, PAST + t)[None]
    h = torch.randn(1, t, cfg.hidden_size)
    rope = LlamaRotaryEmbedding(cfg)(h, pos)
    kw = cache_kwargs(type(layer), cache)
    cache.layers[0].length = PAST

    def run():
        with torch.inference_mode():
            layer(h, attention_mask=mask, position_ids=pos, use_cache=True, position_embeddings=rope, **kw)

    measured = peak_bytes(run)
    a = arch_of(cfg.to_dict())
    planned = pass_bytes(a, t, PAST + t, 4, "sdpa", 0, fused=True, device="cpu") - t * (PAST + t)
    assert measured <= planned, (measured, planned)
