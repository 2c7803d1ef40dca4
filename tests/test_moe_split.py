"""The "split" expert placement runs (offload/stream/splitexperts.py): every layer's dense part resident, each routed
expert cached on the device, held in RAM or read from disk, and computed where it lives.

On this CPU-only machine the device is the CPU (the moves are no-ops): the same code path as on a card. The tiny
seeded checkpoints of tests/test_moe_families.py (Mixtral, Qwen2-MoE with a shared expert and a dense MLP layer,
Qwen3-MoE) and tests/test_gpt_oss.py (fp32, its MXFP4 copy, bf16), and the GGUF files of tests/test_gguf_moe_apart.py
(Q8_0 and Q4_K_M) and tests/test_gguf_gpt_oss.py (F32, MXFP4_MOE, a converted MXFP4 checkpoint; slow, skipped
without llama.cpp). Checked, with every tier non-empty: greedy ids equal transformers' generate and whole-layer
streaming's (`experts="layers"`; gpt-oss bf16: whole layers' only); no layer streams (the plan streams
none, and a pass's streamed bytes are exactly the disk-tier experts' spans the store read); the device-cached
experts' weights lie in the device pool's "expert_cache" buffers and on the model's device, the others' on the
CPU; rows move to the CPU once per layer; a memory plan's tier ids are what the loader places; `ar` and specexec
with a draft, through the engine, give transformers' ids. The planner (a CUDA request planned on this machine,
tests/test_moe_plan.py's sparse Qwen3-30B-A3B) chooses the split with `runs` true, its ids one home per expert
(the hottest first with measured routing), and the dry-run notes say it runs. gpt-oss and the GGUF files:
tests/test_moe_split_formats.py.
"""

from __future__ import annotations

from contextlib import contextmanager
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


def hf_ids(hf) -> list[int]:
    """Transformers model `hf`'s greedy ids for PROMPT: N_NEW of them, no EOS stop."""
    ids = make_tokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def family(request, tmp_path_factory):
    """(name, target dir, transformers' greedy ids)."""
    target = make_moe(request.param, tmp_path_factory.mktemp(request.param) / "target", seed=3)
    return request.param, target, hf_ids(transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32))


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


def check_passes(m, ids=None) -> None:
    """A pass's streamed bytes are the disk experts' spans the store read, nothing of any layer's dense part."""
    ids = ids or make_tokenizer()(PROMPT)["input_ids"]
    for n in (6, 1, 7):
        before = m.experts.bytes_read
        m(input_ids=torch.tensor([ids[:n]]))
        assert m.stats.streamed_bytes_per_pass == m.experts.bytes_read - before, n


@contextmanager
def split_model(target, **kw):
    """load(target, **kw), its placement checked (check_placement); closed on leaving."""
    m = load(target, **kw)
    try:
        check_placement(m)
        yield m
    finally:
        m.close()


def check_split(target, want: list[int], decode=_greedy, ids=None) -> None:
    """The split decodes `want` (`decode`: greedy ids), reads disk experts and streams nothing else
    (check_passes over `ids`); whole-layer streaming decodes `want` too."""
    with split_model(target) as m:
        assert decode(m) == want
        assert m.experts.reads > 0
        check_passes(m, ids)
    assert greedy_layers(target, decode=decode) == want


def greedy_layers(target, dtype=torch.float32, decode=_greedy) -> list[int]:
    from offload import OffloadedCausalLM

    m = OffloadedCausalLM.from_pretrained(target, dtype=dtype, offload="disk", experts="layers")
    try:
        assert m.plan.tier == "disk" and m.split is None
        return decode(m)
    finally:
        m.close()


def test_split_equals_hf_and_whole_layers(family):
    check_split(family[1], family[2])


def test_disk_tier_decoding_reads_only_its_routed_experts(family):
    """The split's disk tier knows the model's top-k: a one-token pass (top-k routed experts a layer) reads only
    its routed experts, never a layer's experts whole; the prompt's prefill may."""
    name, target, _ = family
    m = load(target, cache=1, ram=0)
    try:
        assert m.experts.top_k > 1, name
        ids = torch.tensor([[5, 9, 2, 7, 11, 3, 8, 4]])
        out = m(input_ids=ids, use_cache=True)
        before = m.experts.layers_read_whole
        for _ in range(3):  # one token at a time, as plain decoding runs
            nxt = out.logits[:, -1:].argmax(-1)
            out = m(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        assert m.experts.layers_read_whole == before, name
    finally:
        m.close()


def test_rows_move_once_per_layer(family, monkeypatch):
    """Per sparse block and pass the inner experts run twice at most: once on the device over the pass's rows (the
    cached experts' pairs), once on the CPU over exactly the rows routed to some RAM or disk expert."""
    name, target, _ = family
    calls, forward = [], ExpertList.forward

    def recording(self, hidden, top_k_index, top_k_weights):
        calls.append((id(self), hidden.shape[0], top_k_index.clone()))
        return forward(self, hidden, top_k_index, top_k_weights)

    monkeypatch.setattr(ExpertList, "forward", recording)
    m = load(target)
    try:
        blocks = {id(layer.mlp.experts.inner): layer.mlp.experts for layer in m.layers if hasattr(layer.mlp, "experts")}
        n = 7
        m(input_ids=torch.tensor([make_tokenizer()(PROMPT)["input_ids"][:n]]))
        for key, block in blocks.items():
            mine = [(rows, idx) for k, rows, idx in calls if k == key]
            assert len(mine) == 2 and mine[0][0] == n, (name, [r for r, _ in mine])  # the device's, then the CPU's
            device_idx, cpu_idx = mine[0][1], mine[1][1]
            e = block.num_experts
            cached = block.on_device[:e].nonzero()[:, 0].tolist()
            assert set(device_idx[device_idx < e].tolist()) <= set(cached)  # the device computes cached experts only
            assert not set(cpu_idx[cpu_idx < e].tolist()) & set(cached)  # the CPU everything else
            away = (device_idx == e).any(-1)  # rows with a slot marked for elsewhere (E: never a routed id)
            assert mine[1][0] == int(away.sum()) and (cpu_idx < e).any(-1).all(), name
            # each slot computes on exactly one side
            assert torch.equal((cpu_idx < e), (device_idx[away] == e)), name
    finally:
        m.close()


def check_streamed(target, want: list[int], monkeypatch) -> None:
    """split_model() under a plan whose threshold streams passes of 8 tokens or more (the prompt's prefill):
    greedy ids `want`, uncached experts copied into the staging area and read from disk (check_staged)."""
    plan = SimpleNamespace(experts={"mode": "split", "stream_from": [8] * 64}, embeddings="device")
    with split_model(target, memplan=plan) as m:
        assert _greedy(m) == want
        assert m.split.staging.copies > 0 and m.experts.reads > 0
        check_staged(m, monkeypatch)


def check_staged(m, monkeypatch) -> None:
    """A 9-token pass copies exactly its routed uncached experts into the staging area (their layout bytes, each
    once per layer, no cached one); a 1-token pass copies none."""
    seen, forward = [], SplitBlock.forward

    def recording(self, hidden, top_k_index, top_k_weights):
        seen.append((self, top_k_index.unique().tolist()))
        return forward(self, hidden, top_k_index, top_k_weights)

    monkeypatch.setattr(SplitBlock, "forward", recording)
    ids, st = make_tokenizer()(PROMPT)["input_ids"], m.split.staging
    index = {id(layer.mlp.experts): i for i, layer in enumerate(m.layers) if hasattr(layer.mlp, "experts")}
    for n in (9, 1):
        seen.clear()
        before = (st.copies, st.bytes)
        m(input_ids=torch.tensor([ids[:n]]))
        want = [(index[id(b)], e) for b, es in seen for e in es if e not in b.cached]
        size = {(i, e): d.packed.nbytes for i, by_e in m.split.held.items() for e, (_, d) in by_e.items()}
        size.update({k: d.layout.nbytes for k, d in (m.split.store.experts.items() if m.split.store else ())})
        copies, nbytes = (len(want), sum(size[k] for k in want)) if n >= 8 else (0, 0)
        assert (st.copies - before[0], st.bytes - before[1]) == (copies, nbytes), n
        assert n < 8 or copies > 0
    assert m.pool.by_component["expert_staging"] == st.slot * st.slots == st.buf.numel()


def test_large_pass_streams_its_experts_to_the_device(family, monkeypatch):
    """Passes of 8+ tokens (the prefill) compute every routed expert on the device, the uncached ones copied
    into the staging area; decoding's 1-token passes compute them on the CPU; greedy ids stay transformers'."""
    check_streamed(family[1], family[2], monkeypatch)


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

    from offload.planning.experts import routed_seconds
    from offload.planning.memplan import PlanRequest, plan_memory
    from offload.planning.passcost import device_of
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
    assert ex["device_bytes"]["expert_staging"] == 2 * ex["top_k"] * max(ex["expert_bytes"])  # two slots of top-k
    assert ex["cache_experts"] == 0  # nothing on disk, no cache
    dev, sparse = device_of(req), [i for i, b in enumerate(ex["expert_bytes"]) if b]
    assert len(ex["stream_from"]) == layers and all(1 < ex["stream_from"][i] <= 2048 for i in sparse)
    for i in sparse:  # the threshold is where the priced path changes
        at, below = (routed_seconds(ex, i, n, dev, 2)[1] for n in (ex["stream_from"][i], ex["stream_from"][i] - 1))
        assert (at, below) == ("stream", "cpu")
        assert [routed_seconds(ex, i, n, dev, 2)[1] for n in (1, 2048)] == ["cpu", "stream"]
    small = plan_memory(ck, None, replace(req, ram_free=16 * GB)).experts  # some experts on disk
    eb = ex["expert_bytes"][0]
    assert small["mode"] == "split" and small["disk_experts"] > 0 and small["cache_experts"] == e
    assert small["host_bytes"] == {"experts_ram": small["ram_experts"] * eb, "expert_cache": e * eb}
    assert sum(small["host_bytes"].values()) <= 0.8 * 16 * GB
    note = next(n for n in plan.notes if "experts split" in n)
    assert "run" in note and "planned only" not in note, note
    counts = [1000 if x % 16 == 3 else 1 for x in range(e * layers)]
    hot = plan_memory(ck, None, replace(req, timings={"routing": counts})).experts
    cached = {(i, x) for i, xs in enumerate(hot["gpu_ids"]) for x in xs}
    hottest = {(i, x) for i in range(layers) for x in range(3, e, 16)}
    assert len(cached) > len(hottest) and hottest <= cached  # every hot expert cached, the rest evenly
    assert hottest - {(i, x) for i, xs in enumerate(ex["gpu_ids"]) for x in xs}  # the prior's cache misses some


def test_split_of_a_dense_model_is_one_error(tiny_pair):
    """experts="split" names what it needs where the model has no routed experts."""
    from offload import OffloadedCausalLM
    from offload.errors import OffloadError

    with pytest.raises(OffloadError, match="mixture-of-experts"):
        OffloadedCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32, experts="split", expert_cache=2)


def test_engine_ar_and_specexec_with_the_split(family, tmp_path):
    """`ar` and specexec with a draft (a low-noise copy of the target), through the engine, the target split."""
    from specexec_cli.session.loading import LoadOptions, load_models
    from tests.test_moe_families import _decode

    name, target, want = family
    draft = make_moe(name, tmp_path / "draft", seed=4, noise_from=target, noise=0.05)
    m = load_models(LoadOptions(str(target), str(draft), dtype="fp32", device="cpu", offload="disk", ctx=256))
    m.target.close()
    m.target = load(target)
    try:
        m.eos_ids = frozenset()
        assert _decode(m, "ar")[0] == want, name
        got, per_pass = _decode(m, "specexec")
        assert got == want and max(per_pass) >= 3, (name, per_pass)
        assert m.target.experts.reads > 0
    finally:
        m.target.close()
