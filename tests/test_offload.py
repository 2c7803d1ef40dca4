"""Tests for the offload package: streamed logits == HF logits on every tier, nf4 == bnb
Linear4bit, device-byte budget, compute/IO overlap, and OffloadError messages naming files.

Fixtures build tiny random checkpoints with save_pretrained so the real loading path runs.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from offload import OffloadedCausalLM, parse_size, plan_offload
from offload.arch.hfcompat import cache_kwargs, output_cache_kwargs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
VOCAB = 96


def _llama_config(layers=4, tie=True, **kw):
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        **kw,
    )


def _save(model, path, **kw):
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    return _save(LlamaForCausalLM(_llama_config()).eval(), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    torch.manual_seed(1)
    path = _save(
        LlamaForCausalLM(_llama_config(tie=False)).eval(), tmp_path_factory.mktemp("sharded"), max_shard_size="200KB"
    )
    assert (path / "model.safetensors.index.json").exists()
    return path


def _ref(path, dtype=torch.float32):
    return LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _ids(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g)


# ---------------------------------------------------------------- sizes and plan


@pytest.mark.parametrize(
    "text,expected",
    [("0", 0), ("1024", 1024), ("512MB", 512 * 10**6), ("24GB", 24 * 10**9), ("1.5GiB", 3 * 2**29), ("2 kib", 2048)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("junk", ["", "abc", "12XB", "-5", "1.2.3GB"])
def test_parse_size_rejects_junk(junk):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(junk)


def test_plan_offload_tiers():
    sizes = [100] * 8
    p = plan_offload(sizes, None, None, free_ram=10**9)
    assert p.tier == "none" and p.resident == list(range(8)) and p.device_bytes == 800
    p = plan_offload(sizes, 300, 200, free_ram=10**9, slots=2)
    assert p.resident == [0, 1, 2] and p.ram_layers == [3, 4] and p.disk_layers == [5, 6, 7]
    assert p.tier == "disk" and p.host_bytes == 200 and p.device_bytes == 300 + 2 * 100
    p.direct_io = True
    assert p.describe() == "offload: 3 layers resident, 5 streamed (2 from RAM, 3 from disk, O_DIRECT), 100 B/layer"
    p = plan_offload(sizes, 0, None, free_ram=10**9)
    assert p.tier == "ram" and p.describe().startswith("offload: 0 layers resident, 8 streamed from RAM")


# ---------------------------------------------------------------- exactness per tier

TIERS = [
    ("auto", {}, "none"),
    ("ram", {"slots": 1}, "ram"),
    ("ram", {"slots": 2}, "ram"),
    ("disk", {"slots": 1}, "disk"),
    ("disk", {"slots": 2, "max_host_memory": 0}, "disk"),
]


@pytest.mark.parametrize("offload,kw,tier", TIERS)
def test_streamed_logits_equal_hf(llama_dir, offload, kw, tier):
    ref = _ref(llama_dir)
    model = OffloadedCausalLM.from_pretrained(llama_dir, dtype=torch.float32, offload=offload, **kw)
    try:
        assert model.plan.tier == tier
        ids = _ids()
        with torch.no_grad():
            expected = ref(input_ids=ids).logits
        for _ in range(2):  # second pass runs on the layers prefetched at the end of the first
            torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
    finally:
        model.close()


def test_sharded_mixed_tiers(sharded_dir):
    ref = _ref(sharded_dir)
    layer = OffloadedCausalLM.from_pretrained(sharded_dir, offload="ram").plan.layer_bytes[0]
    model = OffloadedCausalLM.from_pretrained(
        sharded_dir, dtype=torch.float32, offload="auto", max_device_memory=layer, max_host_memory=layer
    )
    try:
        p = model.plan
        assert (p.resident, p.ram_layers, p.disk_layers) == ([0], [1], [2, 3])
        ids = _ids(5, seed=3)
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=0)
    finally:
        model.close()


def test_forward_arguments_equal_hf_on_a_streamed_tier(llama_dir):
    """forward's Hugging Face-style arguments (it is one lane of the pass forward_many runs,
    offload/stream/multi.py): a batch of two rows, inputs_embeds without a cache, logits_to_keep, extra
    keyword arguments for the layers, a DynamicCache made when use_cache and none is given and the
    positions of the next call derived from its length: HF's logits each time, one pass per call."""
    ref = _ref(llama_dir)
    model = OffloadedCausalLM.from_pretrained(llama_dir, dtype=torch.float32, offload="ram", slots=1)
    field = next(iter(output_cache_kwargs(CausalLMOutputWithPast, None)))  # `cache` or `past_key_values`
    try:
        assert model.plan.streamed
        ids = torch.cat([_ids(seed=5), _ids(seed=6)])  # (2, 7)
        with torch.no_grad():
            embeds = model.embed_tokens(ids[:1])
        calls = [
            {"input_ids": ids},
            {"inputs_embeds": embeds, "use_cache": False},
            {"input_ids": ids[:1], "logits_to_keep": 2},
            {"input_ids": ids[:1], "use_cache": False, "output_attentions": False},
        ]
        for kw in calls:
            passes = model.stats.passes
            out = model(**kw)
            assert model.stats.passes == passes + 1
            with torch.no_grad():
                torch.testing.assert_close(out.logits, ref(**kw).logits, atol=1e-5, rtol=0)
            assert kw.get("use_cache") is not False or getattr(out, field) is None
        made = getattr(model(input_ids=ids[:1, :4], use_cache=True), field)
        assert isinstance(made, DynamicCache) and made.get_seq_length() == 4
        got = model(input_ids=ids[:1, 4:], use_cache=True, **cache_kwargs(model, made)).logits  # positions 4..6
        cache = DynamicCache(config=ref.config)
        with torch.no_grad():
            ref(input_ids=ids[:1, :4], use_cache=True, **cache_kwargs(ref, cache))
            want = ref(input_ids=ids[:1, 4:], use_cache=True, **cache_kwargs(ref, cache)).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert made.get_seq_length() == 7
    finally:
        model.close()


def _tree_mask(parents, past, dtype):
    """Additive (1,1,T,past+T) mask: each node sees the whole prefix, itself and its ancestors."""
    t = len(parents)
    allowed = torch.zeros(t, past + t, dtype=torch.bool)
    allowed[:, :past] = True
    for i, p in enumerate(parents):
        allowed[i, past + i] = True
        while p >= 0:
            allowed[i, past + p] = True
            p = parents[p]
    mask = torch.zeros(t, past + t, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@pytest.mark.parametrize("offload,slots", [("ram", 2), ("disk", 1)])
def test_tree_mask_cache_positions(llama_dir, offload, slots):
    ref = _ref(llama_dir)
    model = OffloadedCausalLM.from_pretrained(llama_dir, dtype=torch.float32, offload=offload, slots=slots)
    try:
        prefix = _ids(6, seed=1)
        caches = [DynamicCache(config=model.config), DynamicCache()]
        with torch.no_grad():
            a = ref(input_ids=prefix, **cache_kwargs(ref, caches[0]), use_cache=True).logits
        b = model(input_ids=prefix, **cache_kwargs(model, caches[1]), use_cache=True).logits
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        # A tree of 5 nodes: 0 -> (1, 2), 1 -> 3, 2 -> 4; positions follow depth, not index.
        tree = _ids(5, seed=2)
        mask = _tree_mask([-1, 0, 0, 1, 2], past=6, dtype=torch.float32)
        pos = torch.tensor([[6, 7, 7, 8, 8]])
        with torch.no_grad():
            a = ref(
                input_ids=tree, attention_mask=mask, position_ids=pos, **cache_kwargs(ref, caches[0]), use_cache=True
            ).logits
        b = model(
            input_ids=tree, attention_mask=mask, position_ids=pos, **cache_kwargs(model, caches[1]), use_cache=True
        ).logits
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        # Compaction like the engine's: keep prefix + accepted nodes 0, 2, 4, then decode one more.
        keep = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 10])
        for cache in caches:
            for lay in cache.layers:
                lay.keys, lay.values = lay.keys[:, :, keep], lay.values[:, :, keep]
        nxt, pos = _ids(1, seed=4), torch.tensor([[9]])
        with torch.no_grad():
            a = ref(input_ids=nxt, position_ids=pos, **cache_kwargs(ref, caches[0]), use_cache=True).logits
        b = model(input_ids=nxt, position_ids=pos, **cache_kwargs(model, caches[1]), use_cache=True).logits
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        for ca, cb in zip(caches[0].layers, caches[1].layers):
            torch.testing.assert_close(cb.keys, ca.keys, atol=1e-5, rtol=0)
    finally:
        model.close()


def _assert_bf16_close(model, ref):
    """Streamed bf16 logits within bf16 tolerance of the resident HF model's."""
    ids = _ids()
    with torch.no_grad():
        expected = ref(input_ids=ids).logits.float()
    torch.testing.assert_close(model(input_ids=ids).logits.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_bf16_close_to_hf(tmp_path, offload):
    torch.manual_seed(2)
    path = _save(LlamaForCausalLM(_llama_config()).to(torch.bfloat16).eval(), tmp_path)
    ref = _ref(path, torch.bfloat16)
    model = OffloadedCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload=offload)
    try:
        assert model.dtype == torch.bfloat16
        _assert_bf16_close(model, ref)
    finally:
        model.close()


def test_fp32_file_loaded_as_bf16_from_disk(llama_dir):
    """Disk tier with a dtype cast after the O_DIRECT read."""
    ref = _ref(llama_dir).to(torch.bfloat16)
    model = OffloadedCausalLM.from_pretrained(llama_dir, dtype="bf16", offload="disk")
    try:
        _assert_bf16_close(model, ref)
    finally:
        model.close()
