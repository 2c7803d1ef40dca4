"""The "split" expert placement runs (offload/stream/splitexperts.py): every layer's dense part resident, each routed
expert cached on the device, held in RAM or read from disk, and computed where it lives.

On this CPU-only machine the device is the CPU (the moves are no-ops): the same code path as on a card. The tiny
seeded checkpoints of tests/test_moe_families.py (Mixtral, Qwen2-MoE with a shared expert and a dense MLP layer,
Qwen3-MoE) and tests/test_gpt_oss.py (fp32 and its MXFP4 copy). Checked, with every tier non-empty: greedy ids
equal transformers' generate and whole-layer streaming's (`experts="layers"`); no layer streams (the plan streams
none, and a pass's streamed bytes are exactly the disk-tier experts' spans the store read); the device-cached
experts' weights lie in the device pool's "expert_cache" buffers and on the model's device, the others' on the
CPU; a memory plan's tier ids are what the loader places. The planner (a CUDA request planned on this machine,
tests/test_moe_plan.py's sparse Qwen3-30B-A3B) chooses the split with `runs` true, its ids one home per expert
(the hottest first with measured routing), and the dry-run notes say it runs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from offload.arch.moe import ExpertList
from offload.stream.splitexperts import SplitBlock, tier_ids, tier_order
from tests.conftest import make_tokenizer
from tests.test_moe_experts_apart import _greedy
from tests.test_moe_families import N_NEW, PROMPT, make_moe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
GB = 10**9


def hf_ids(target) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = make_tokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def family(request, tmp_path_factory):
    """(name, target dir, transformers' greedy ids)."""
    target = make_moe(request.param, tmp_path_factory.mktemp(request.param) / "target", seed=3)
    return request.param, target, hf_ids(target)


def load(target, cache: int = 3, ram: int = 2, dtype=torch.float32, **kw):
    """experts="split" with `cache` experts on the device and room for `ram` experts in RAM, the rest on disk."""
    from offload import OffloadedCausalLM

    probe = OffloadedCausalLM.from_pretrained(
        target, dtype=dtype, experts="split", expert_cache=cache, max_host_memory=0
    )
    largest = max(d.packed.nbytes for by_e in probe.split.held.values() for _, d in by_e.values())
    probe.close()
    return OffloadedCausalLM.from_pretrained(
        target, dtype=dtype, experts="split", expert_cache=cache, max_host_memory=ram * largest, **kw
    )


def tiers(m) -> dict[str, set[tuple[int, int]]]:
    """{tier: {(layer, expert)}} as the loader placed them."""
    s = m.split
    gpu = {(i, e) for i, es in s.cached.items() for e in es}
    disk = {(i, e) for i, es in s.disk.items() for e in es}
    ram = {(i, e) for i, by_e in s.held.items() for e in by_e} - gpu
    return {"gpu": gpu, "ram": ram, "disk": disk}


def expert_tensors(m, i: int, e: int) -> list[torch.Tensor]:
    """Expert e of layer i as the block computes it: an ExpertList child's parameters, a fused source's parts."""
    block = m.layers[i].mlp.experts
    assert isinstance(block, SplitBlock)
    inner = block.inner
    if isinstance(inner, ExpertList):
        return list(inner[e].parameters())
    return list(inner.source(e).values())


def check_placement(m) -> None:
    """Every tier non-empty; nothing streams; cached experts on the device in its expert cache, the others on the CPU."""
    t = tiers(m)
    assert all(t.values()), t
    assert m.plan.streamed == [] and m.plan.resident == list(range(len(m.layers)))
    cache = m.pool.by_component["expert_cache"]
    held = sum(buf.numel() for i, by_e in m.split.held.items() for e, (buf, _) in by_e.items() if (i, e) in t["gpu"])
    assert held == cache  # the device pool's expert cache is the cached experts' buffers, nothing else
    gpu_bufs = [buf for i, by_e in m.split.held.items() for e, (buf, _) in by_e.items() if (i, e) in t["gpu"]]
    for i, e in t["gpu"] | t["ram"]:
        for p in expert_tensors(m, i, e):
            inside = any(b.data_ptr() <= p.data_ptr() < b.data_ptr() + b.numel() for b in gpu_bufs)
            assert inside == ((i, e) in t["gpu"]), (i, e)
            assert p.device == (m.device if (i, e) in t["gpu"] else torch.device("cpu")), (i, e)


def check_passes(m) -> None:
    """A pass's streamed bytes are the disk experts' spans the store read, nothing of any layer's dense part."""
    ids = make_tokenizer()(PROMPT)["input_ids"]
    for n in (6, 1, 7):
        before = m.experts.bytes_read
        m(input_ids=torch.tensor([ids[:n]]))
        assert m.stats.streamed_bytes_per_pass == m.experts.bytes_read - before, n


def greedy_layers(target, dtype=torch.float32) -> list[int]:
    from offload import OffloadedCausalLM

    m = OffloadedCausalLM.from_pretrained(target, dtype=dtype, offload="disk", experts="layers")
    try:
        assert m.plan.tier == "disk" and m.split is None
        return _greedy(m)
    finally:
        m.close()


def test_split_equals_hf_and_whole_layers(family):
    name, target, want = family
    m = load(target)
    try:
        check_placement(m)
        assert _greedy(m) == want, name
        assert m.experts.reads > 0
        check_passes(m)
    finally:
        m.close()
    assert greedy_layers(target) == want, name


def test_loader_follows_the_plans_ids(family):
    """A plan's tier ids (not the even order: the highest ids cached) are where the loader puts the experts."""
    from offload import OffloadedCausalLM

    name, target, want = family
    e = 4
    layers = [i for i in range(3) if not (name == "qwen2_moe" and i == 1)]  # its layer 1 is a dense MLP
    order = [(i, x) for x in reversed(range(e)) for i in layers]
    ids = tier_ids(order, 3, gpu=len(layers), ram=len(layers))
    plan = SimpleNamespace(experts={"mode": "split", **{f"{t}_ids": v for t, v in ids.items()}}, embeddings="device")
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, memplan=plan)
    try:
        t = tiers(m)
        assert t["gpu"] == {(i, 3) for i in layers} and t["ram"] == {(i, 2) for i in layers}, t
        assert t["disk"] == {(i, x) for i in layers for x in (0, 1)}
        check_placement(m)
        assert _greedy(m) == want, name
    finally:
        m.close()


def test_tier_order_hottest_first_else_even():
    assert tier_order([0, 2], 3) == [(0, 0), (2, 0), (0, 1), (2, 1), (0, 2), (2, 2)]
    counts = [1, 9, 1, 5, 1, 9]  # layer 0: experts 0..2, then layer 2
    assert tier_order([0, 2], 3, counts)[:3] == [(0, 1), (2, 2), (2, 0)]
    ids = tier_ids(tier_order([0, 2], 3, counts), 3, gpu=2, ram=1)
    assert ids == {"gpu": [[1], [], [2]], "ram": [[], [], [0]], "disk": [[0, 2], [], [1]]}


def test_plan_chooses_the_split_and_says_it_runs(tmp_path):
    """A CUDA plan of Qwen3-30B-A3B (24 GB card, 64 GB of RAM) splits, runs, and places every expert once; with
    measured routing the cached ones are the hottest."""
    from dataclasses import replace

    from offload.planning.memplan import PlanRequest, plan_memory
    from tests.sparse_ckpt import read_checkpoint
    from tests.sparse_moe import write_sparse_moe

    ck = read_checkpoint(write_sparse_moe("qwen3-30b-a3b", tmp_path / "q"))
    e, layers = ck.config["num_experts"], ck.config["num_hidden_layers"]
    req = PlanRequest(device="cuda", dtype="bf16", draft_dtype=None, ram_free=64 * GB, max_gpu_memory=24 * GB)
    plan = plan_memory(ck, None, req)
    ex = plan.experts
    assert ex["mode"] == "split" and ex["runs"] is True
    for tier in ("gpu", "ram", "disk"):
        assert sum(map(len, ex[f"{tier}_ids"])) == ex[f"{tier}_experts"], tier
    homes = sorted((i, x) for t in ("gpu", "ram", "disk") for i, xs in enumerate(ex[f"{t}_ids"]) for x in xs)
    assert homes == [(i, x) for i in range(layers) for x in range(e)]
    note = next(n for n in plan.notes if "experts split" in n)
    assert "run" in note and "planned only" not in note, note
    counts = [1000 if x % 16 == 3 else 1 for x in range(e * layers)]
    hot = plan_memory(ck, None, replace(req, timings={"routing": counts})).experts
    cached = {(i, x) for i, xs in enumerate(hot["gpu_ids"]) for x in xs}
    hottest = {(i, x) for i in range(layers) for x in range(3, e, 16)}
    assert len(cached) > len(hottest) and hottest <= cached  # every hot expert cached, the rest evenly
    assert hottest - {(i, x) for i, xs in enumerate(ex["gpu_ids"]) for x in xs}  # the prior's cache misses some
