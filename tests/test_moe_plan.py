"""Mixture-of-experts plans at real sizes (offload/planning/experts.py): sparse checkpoints with real
headers of gpt-oss-120b (its 16-bit copy), Qwen3-30B-A3B, Qwen3-235B-A22B and Mixtral-8x7B on a 24 GB
card with 64 and 128 GB of RAM.

Expected bytes are recomputed here from the public config values with plain arithmetic; the distinct
expert count is checked against a simulation of uniform top-k routing, not against its own formula.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import replace

import pytest

from offload.planning.experts import distinct_experts, hit_share, pass_terms
from offload.planning.memplan import RAM_FRACTION, PlanRequest, plan_memory
from tests.sparse_ckpt import read_checkpoint, write_sparse
from tests.sparse_moe import write_sparse_moe

GB = 10**9
MODELS = ("gpt-oss-120b", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {name: read_checkpoint(write_sparse_moe(name, root / name)) for name in MODELS}
    out["draft"] = read_checkpoint(write_sparse("qwen2.5-0.5b", root / "draft"))
    du = sum(os.stat(p).st_blocks * 512 for p in root.rglob("*.safetensors"))
    assert du < 200 * 2**20, "sparse checkpoints must not allocate their data"
    return out


def card(ram_gb: int, **kw) -> PlanRequest:
    """A 24 GB card on a machine with `ram_gb` of available RAM, bf16, ctx 8192."""
    return PlanRequest(
        device="cuda",
        dtype="bf16",
        draft_dtype=kw.pop("draft_dtype", None),
        ram_free=ram_gb * GB,
        max_gpu_memory=24 * GB,
        ctx=8192,
        **kw,
    )


def expert_numbers(c: dict) -> tuple[int, int, int]:
    """(experts, bytes of one expert in bf16, sparse layers) from config.json alone."""
    h, e = c["hidden_size"], c.get("num_local_experts") or c.get("num_experts")
    if c["model_type"] == "gpt_oss":  # fused gate_up (H, 2I) + bias 2I, down (I, H) + bias H
        i = c["intermediate_size"]
        return e, 2 * (h * 2 * i + 2 * i + i * h + h), c["num_hidden_layers"]
    i = c["intermediate_size"] if c["model_type"] == "mixtral" else c["moe_intermediate_size"]
    return e, 2 * 3 * h * i, c["num_hidden_layers"]


def test_distinct_experts_match_simulated_uniform_routing():
    rng = random.Random(0)
    for e, k in ((8, 2), (128, 8), (128, 4)):
        for n in (1, 4, 16, 64):
            runs = [len({x for _ in range(n) for x in rng.sample(range(e), k)}) for _ in range(400)]
            sim = sum(runs) / len(runs)
            assert distinct_experts(n, k, e) == pytest.approx(sim, rel=0.03), (e, k, n)
    assert distinct_experts(1, 8, 128) == pytest.approx(8)
    assert distinct_experts(10_000, 2, 8) == pytest.approx(8)


def test_hottest_first_cache_serves_more_than_uniform():
    counts = [100, 50, 10, 5, 1, 1, 1, 0]  # skewed measured routing
    assert hit_share(None, 2, 8) == pytest.approx(0.25)
    assert hit_share(counts, 2, 8) == pytest.approx(150 / 168)


@pytest.mark.parametrize("name", MODELS)
def test_expert_bytes_from_headers(ckpts, name):
    ck = ckpts[name]
    ex = plan_memory(ck, None, card(128)).experts
    e, eb, layers = expert_numbers(ck.config)
    assert (ex["experts"], ex["sparse_layers"]) == (e, layers)
    assert ex["expert_bytes"] == [eb] * layers
    assert ex["top_k"] == ck.config["num_experts_per_tok"]


@pytest.mark.parametrize("ram", (64, 128))
@pytest.mark.parametrize("name", MODELS)
def test_moe_plans_fit_a_24gb_card(ckpts, name, ram):
    """Experts split from attention+shared: the card holds every layer's attention+shared part, the
    expert cache and the rest of the plan within 24 GB; every expert has exactly one home; RAM holds
    no more than the RAM budget; the split models faster than streaming whole layers."""
    ck = ckpts[name]
    plan = plan_memory(ck, None, card(ram))
    ex = plan.experts
    e, eb, layers = expert_numbers(ck.config)
    assert ex["mode"] == "split" and ex["fits"] and ex["runs"]
    dev = ex["device_bytes"]
    assert sum(dev.values()) <= 24 * GB
    assert dev["expert_cache"] == ex["gpu_experts"] * eb
    assert dev["attention_shared"] == sum(plan.layer_bytes) - e * eb * layers
    assert ex["gpu_experts"] + ex["ram_experts"] + ex["disk_experts"] == e * layers
    assert ex["host_bytes"]["experts_ram"] == ex["ram_experts"] * eb <= RAM_FRACTION * ram * GB
    assert ex["disk_bytes"] == ex["disk_experts"] * eb
    assert ex["tokens_per_second"] > ex["layers_tokens_per_second"] > 0
    assert ex["cpu_source"].startswith("prior")  # no profile measured this machine's CPU experts
    assert any("experts split" in n and "modelled" in n for n in plan.notes)


def test_more_ram_moves_experts_off_disk(ckpts):
    ck = ckpts["qwen3-235b-a22b"]
    small, big = (plan_memory(ck, None, card(r)).experts for r in (64, 128))
    assert big["disk_experts"] < small["disk_experts"]
    assert big["tokens_per_second"] > small["tokens_per_second"]


def test_verify_pass_priced_by_distinct_experts(ckpts):
    """A tree of n tokens reads the distinct experts it routes to, not n x k experts."""
    ck = ckpts["qwen3-30b-a3b"]
    plan = plan_memory(ck, None, card(128))
    from offload.planning.membytes import arch_of
    from offload.planning.passcost import device_of

    a, dev = arch_of(ck.config), device_of(card(128))
    one, many = (pass_terms(a, plan, dev, n, 512, 2).experts for n in (1, 16))
    want = distinct_experts(16, 8, 128) / distinct_experts(1, 8, 128)
    assert many / one == pytest.approx(want, rel=0.05)
    assert many / one < 16 * 0.7


def test_speculation_on_moe_takes_small_trees(ckpts):
    """With a draft, --budget auto on an MoE target prices each tree by its distinct experts: the verify
    pass grows with the tree, so the chosen tree is small, and plain decoding is the plan's own row."""
    ck, draft = ckpts["qwen3-30b-a3b"], ckpts["draft"]
    req = card(128, draft_dtype="bf16", budget=256, budget_auto=True)
    plan = plan_memory(ck, draft, req)
    small = next(c for c in plan.candidates if c["draft"] != "none")
    rows = {r["budget"]: r for r in small["by_budget"]}
    assert rows[256]["pass_seconds"] > 2 * rows[4]["pass_seconds"]
    assert small["budget"] <= 16
    plain = next(c for c in plan.candidates if c["draft"] == "none")
    assert plain["terms"]["experts"] > 0 and plain["terms"]["routed"]


def test_cpu_device_keeps_whole_layers(ckpts):
    """On a CPU the plan's own whole-layer placement runs (mode "layers"): resident layers compute only
    their routed experts, so a one-token pass reads top-k experts per layer, not all of them."""
    ck = ckpts["qwen3-30b-a3b"]
    req = replace(card(128), device="cpu", max_gpu_memory=None)
    plan = plan_memory(ck, None, req)
    ex = plan.experts
    assert ex["mode"] == "layers" and ex["runs"]
    from offload.planning.membytes import arch_of
    from offload.planning.passcost import device_of

    dev = device_of(req)
    t = pass_terms(arch_of(ck.config), plan, dev, 1, 512, 2)
    _, eb, layers = expert_numbers(ck.config)
    assert t.experts == pytest.approx(layers * max(8 * eb / dev.memory_bps, 2 * 8 * eb / 2 / dev.flops(2)), rel=1e-6)
    assert math.isfinite(ex["tokens_per_second"])


def test_a_profiled_cpu_expert_rate_prices_a_cpu_plans_experts(ckpts):
    """On a CPU the routed experts compute at the CPU expert rate a profile measured
    (`Device.dequant_bps["cpu-experts"]`), not at the memory's read rate: a one-token pass's experts
    are top-k experts per layer at that rate, and the plan names the rate's source."""
    from offload.planning.membytes import arch_of
    from offload.planning.passcost import device_for

    ck = ckpts["qwen3-30b-a3b"]
    dev = device_for("cpu", {"dequant": "measured (here)"}, {"cpu-experts": 5e9}, memory_bps=20e9)
    req = replace(card(128), device="cpu", max_gpu_memory=None, cost_device=dev)
    plan = plan_memory(ck, None, req)
    ex = plan.experts
    assert ex["cpu_bps"] == 5e9 and ex["cpu_source"] == "measured (here)"
    t = pass_terms(arch_of(ck.config), plan, dev, 1, 512, 2)
    _, eb, layers = expert_numbers(ck.config)
    assert t.experts == pytest.approx(layers * max(8 * eb / 5e9, 2 * 8 * eb / 2 / dev.flops(2)), rel=1e-6)


def test_each_pass_runs_uncached_experts_where_faster(ckpts):
    """The split prices the experts not cached on the card on the CPU or streamed to the card, whichever is faster:
    decoding on the CPU, a prefill chunk streamed (its every-expert FLOPs would take the CPU far longer)."""
    ck = ckpts["qwen3-30b-a3b"]
    plan = plan_memory(ck, None, card(128))
    from offload.planning.membytes import arch_of
    from offload.planning.passcost import device_of

    a, dev = arch_of(ck.config), device_of(card(128))
    one, chunk = (pass_terms(a, plan, dev, n, 512, 2) for n in (1, 4096))
    assert (one.routed, chunk.routed) == ("cpu", "stream")
    ex = plan.experts
    cpu_flops = 2 * 4096 * ex["top_k"] * ex["expert_weights"][0] * (1 - ex["hit"]) / ex["cpu_flops"]
    assert 10 * one.experts < chunk.experts < ex["sparse_layers"] * cpu_flops / 10


def test_measured_skewed_routing_fills_the_cache_with_hot_experts(ckpts):
    """With routing counts (hottest first) the same cache serves more of the routed experts, so the
    plan models faster than under the uniform prior."""
    from offload.planning.experts import expert_plan
    from offload.planning.membytes import arch_of
    from offload.planning.memlayers import layer_sizes

    ck = ckpts["qwen3-30b-a3b"]
    req = card(64)
    plan = plan_memory(ck, None, req)
    lay = layer_sizes(ck, arch_of(ck.config), req)
    e, _, layers = expert_numbers(ck.config)
    counts = [1000 if x % e < 16 else 1 for x in range(e * layers)]  # 16 hot experts in every layer
    skewed = expert_plan(ck, lay, req, plan, routing=counts)
    assert skewed["routing"] == "measured" and skewed["hit"] > plan.experts["hit"]
    assert skewed["tokens_per_second"] > plan.experts["tokens_per_second"]


def test_dense_bits_price_attention_in_the_quoted_format(ckpts):
    """`dense_bits` stores the rest of each layer's matrices (attention, router) at that many bits, its
    vectors (norms) in the plan's dtype: bytes recomputed from config.json; the card then holds more
    experts and the plan models faster."""
    from offload.planning.experts import expert_plan, moe_shape
    from offload.planning.membytes import arch_of
    from offload.planning.memlayers import layer_sizes

    ck = ckpts["qwen3-30b-a3b"]
    c, req = ck.config, card(64)
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    matrices = 2 * q * h + 2 * kv * h + c["num_experts"] * h  # q, o; k, v; the router
    vectors = 2 * h + 2 * hd  # two layer norms; q and k norms
    lay = layer_sizes(ck, arch_of(c), req)
    shape = moe_shape(ck, lay, req, bits=4.5, dense_bits=4.5)
    assert shape.dense_bytes == [int(matrices * 4.5 / 8 + vectors * 2)] * c["num_hidden_layers"]
    assert moe_shape(ck, lay, req, bits=4.5).dense_bytes == moe_shape(ck, lay, req).dense_bytes  # bf16 rest
    big = ckpts["qwen3-235b-a22b"]
    req = card(128)
    plan = plan_memory(big, None, req)
    lay = layer_sizes(big, arch_of(big.config), req)
    bf16_rest, quant_rest = (expert_plan(big, lay, req, plan, bits=4.5, dense_bits=d) for d in (None, 4.5))
    assert quant_rest["device_bytes"]["attention_shared"] < bf16_rest["device_bytes"]["attention_shared"] / 3
    assert quant_rest["gpu_experts"] > bf16_rest["gpu_experts"]
    assert quant_rest["tokens_per_second"] > bf16_rest["tokens_per_second"]


def test_dense_pass_model_refuses_a_moe_plan(ckpts):
    """passcost.target_pass prices dense layers only: handed a mixture-of-experts plan it refuses rather
    than price every expert as a dense MLP; draftcost hands those to experts.pass_terms."""
    from offload.planning.membytes import arch_of
    from offload.planning.passcost import device_of, target_pass

    ck = ckpts["mixtral-8x7b"]
    plan = plan_memory(ck, None, card(128))
    with pytest.raises(ValueError, match="pass_terms"):
        target_pass(arch_of(ck.config), plan, device_of(card(128)), 1, 512, 2)
    assert target_pass(arch_of(ck.config), replace(plan, experts=None), device_of(card(128)), 1, 512, 2).seconds > 0
