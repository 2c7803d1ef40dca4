"""The memory plan chooses how a disk layer's routed experts run by modelled speed (planning/experts.py,
planning/expertcost.py), and the loader follows its choice (stream/expertstore.held_experts).

Checked: the experts-apart cost model's arithmetic against figures worked out by hand here (reads per
expert x the disk's per-read latency plus bytes over its rate; the read-ahead overlap; an MXFP4 expert's
dequantization); on a tiny seeded Qwen3-MoE with every layer on disk, a disk whose reads are slow per request
(a per-read latency of 50 ms) makes the plan pick whole layers, and a fast one experts apart, both modelled
figures kept and named in the dry run's notes; a plan that picks whole layers sizes its staging slots as
whole layers, and the loader given it streams whole layers (no expert store) with those bytes, as it
holds the experts apart for a plan that picked that; a profile's per-read latency reaches the plan's Device.
"""

from __future__ import annotations

import pytest
import torch

from offload.planning import device_for
from offload.planning.expertcost import apart_seconds, compute_seconds, read_seconds, transfer_seconds
from tests.test_moe_families import make_moe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _ex(**kw) -> dict:
    """plan.experts of one sparse layer: 4 experts of 1 MB (250k weights), top-2, six reads each."""
    ex = dict(
        experts=4,
        top_k=2,
        expert_bytes=[1_000_000],
        expert_weights=[250_000],
        expert_reads=[6],
        cpu_bps=1e10,
        kernel="none",
        hit=0.0,
        cache_experts=4,
    )
    return {**ex, **kw}


def test_apart_cost_is_reads_latency_bytes_and_the_overlap():
    dev = device_for("cpu", disk_bps=1e9, disk_read_s=1e-4, flops32=1e12)
    ex = _ex()
    # one expert read: 6 requests x 0.1 ms + 1 MB at 1 GB/s = 1.6 ms
    assert read_seconds(ex, 0, dev) == pytest.approx(1.6e-3)
    # one token: d = 4 x (1 - (1 - 2/4)) = 2 distinct experts, each 1 MB at 10 GB/s = 0.1 ms (FLOPs: 0.5 us)
    assert compute_seconds(ex, 0, 1, dev, 4) == pytest.approx(1e-4)
    # read-ahead: the first read waits (1.6), the second read hides the first compute (max 1.6), the last compute 0.1
    assert apart_seconds(ex, 0, 1, dev, 4) == pytest.approx(1.6e-3 + 1.6e-3 + 1e-4)
    # a one-expert cache reads one at a time: 2 x 1.6 + 2 x 0.1
    assert apart_seconds(_ex(cache_experts=1), 0, 1, dev, 4) == pytest.approx(3.4e-3)
    # half the experts cached: 1 miss read (1.6), both compute (0.2)
    assert apart_seconds(_ex(hit=0.5), 0, 1, dev, 4) == pytest.approx(1.6e-3 + 2e-4)
    # MXFP4 on a CPU: + 250k weights x 4 bytes x 2 elements (the kernel writes the transposed weight, the matmul
    # reads it) at the measured 1 GB/s = 2 ms per expert, which now hides reads
    mx = _ex(kernel="mxfp4")
    dq = device_for("cpu", {"dequant": "measured"}, {"mxfp4": 1e9}, disk_bps=1e9, disk_read_s=1e-4, flops32=1e12)
    assert compute_seconds(mx, 0, 1, dq, 4) == pytest.approx(1e-4 + 2e-3)
    assert apart_seconds(mx, 0, 1, dq, 4) == pytest.approx(1.6e-3 + 2.1e-3 + 2.1e-3)
    # a whole layer of 24 MB in 2 reads from disk; over the link no request latency
    assert transfer_seconds(24e6, 2, 1e9, dev, True) == pytest.approx(0.024 + 2e-4)
    assert transfer_seconds(24e6, 2, 1e10, dev, False) == pytest.approx(2.4e-3)


def _plan(target, read_s: float):
    from offload.planning.memplan import PlanRequest, plan_memory
    from tests.sparse_ckpt import read_checkpoint

    dev = device_for("cpu", disk_bps=2e9, disk_read_s=read_s)
    req = PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34, offload="disk", cost_device=dev)
    return plan_memory(read_checkpoint(target), None, req)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_moe("qwen3_moe", tmp_path_factory.mktemp("choice") / "target", seed=3)


def test_plan_picks_by_modelled_speed_and_the_loader_follows(qwen3):
    from offload import OffloadedCausalLM

    slow, fast = _plan(qwen3, 0.05), _plan(qwen3, 1e-5)
    for plan, mode in ((slow, "layers"), (fast, "on-demand")):
        ex = plan.experts
        apart, whole = ex["on_demand_tokens_per_second"], ex["layers_tokens_per_second"]
        assert ex["mode"] == mode and (apart > whole) == (mode == "on-demand"), ex
        note = next(n for n in plan.notes if "chosen" in n)
        assert f"{apart:.2f}" in note and f"{whole:.2f}" in note, note
    assert slow.disk_layers == fast.disk_layers and slow.disk_layers
    # whole layers chosen: staging slots of whole layers, no expert cache
    assert "expert_cache" not in slow.device_bytes
    assert slow.device_bytes["staging_slots"] > fast.device_bytes["staging_slots"]
    for plan in (slow, fast):
        m = OffloadedCausalLM.from_pretrained(qwen3, dtype=torch.float32, offload="disk", memplan=plan)
        try:
            assert (m.experts is not None) == (plan.experts["mode"] == "on-demand")
            assert m.pool.by_component["staging_slots"] == plan.device_bytes["staging_slots"]
            assert m.pool.by_component.get("expert_cache", 0) == plan.device_bytes.get("expert_cache", 0)
        finally:
            m.close()


def test_explicit_modes_override_the_plan(qwen3):
    from offload import OffloadedCausalLM
    from offload.errors import OffloadError

    m = OffloadedCausalLM.from_pretrained(qwen3, dtype=torch.float32, offload="disk", experts="on-demand")
    try:
        assert m.experts is not None
    finally:
        m.close()
    with pytest.raises(OffloadError, match="auto, on-demand or layers"):
        OffloadedCausalLM.from_pretrained(qwen3, dtype=torch.float32, offload="disk", experts="apart")


def test_a_profiled_read_latency_reaches_the_plan_device():
    from specexec_cli.session import profiles

    prof = {"hostname": "h", "disk": {"read_gbps": 1.5, "read_latency_s": 6e-5, "method": "o_direct"}}
    dev = profiles.cost_device_for("cpu", None, prof)
    assert dev.disk_read_s == 6e-5 and dev.sources["disk_read_s"] == "measured (h)"
    old = profiles.cost_device_for("cpu", None, {"hostname": "h", "disk": {"read_gbps": 1.5, "method": "o_direct"}})
    assert old.disk_read_s == 1e-4 and old.sources["disk_read_s"] == "prior"
