"""The rule of when a layer's routed experts are read whole (offload/stream/expertbulk.worth_whole), on the
shapes bench/moe_apart.py measures, and its price in planning/expertcost.apart_seconds."""

from __future__ import annotations

from offload.planning.expertcost import apart_seconds, compute_seconds, read_seconds
from offload.planning.passcost import device_of
from offload.planning.request import PlanRequest
from offload.stream.expertbulk import REQUEST_BYTES, worth_whole


def first_whole(reads: int, nbytes: int, experts: int) -> int:
    return next(
        d for d in range(1, experts + 1) if worth_whole(d, reads, nbytes, reads, experts * nbytes, REQUEST_BYTES)
    )


def test_whole_reads_start_where_many_experts_route():
    # gpt-oss's MXFP4 expert: six spans of 0.32 MB in all; 24 a layer: one token (2 experts) reads them apart
    assert first_whole(6, 315904, 24) == 4  # the store, its file merging the six spans into two: 3
    # the Qwen3-MoE fp32 expert: one span of 2.36 MB: only a pass missing nearly every expert reads it whole
    assert first_whole(1, 2359296, 24) == 20
    # gpt-oss-120b: 128 experts of 13 MB, six spans each
    assert 96 < first_whole(6, 13 << 20, 128) < 112


def _ex(cache: int) -> dict:
    return dict(
        experts=24, top_k=2, expert_bytes=[315904], expert_weights=[3 * 512 * 384], expert_reads=[6],
        cache_experts=cache, hit=0.0, kernel="none", cpu_bps=None,
    )  # fmt: skip


def test_apart_price_reads_whole_only_where_the_rule_does():
    dev = device_of(PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34))
    ex = _ex(24)
    r, t1 = read_seconds(ex, 0, dev), compute_seconds(ex, 0, 1, dev, 4)
    d1 = 24 * (1 - (22 / 24) ** 1)
    assert abs(apart_seconds(ex, 0, 1, dev, 4) - (r + (d1 - 1) * max(r, t1) + t1)) < 1e-12  # 2 misses: one by one
    n = 32
    d = 24 * (1 - (22 / 24) ** n)
    t = compute_seconds(ex, 0, n, dev, 4)
    w = 6 * dev.disk_read_s + 24 * 315904 / dev.disk_bps
    want = max(w, d * t) + d * 2 * 315904 / dev.memory_bps
    assert abs(apart_seconds(ex, 0, n, dev, 4) - want) < 1e-12
    assert apart_seconds(ex, 0, n, dev, 4) < r + (d - 1) * max(r, t) + t  # cheaper than one by one
    assert apart_seconds(_ex(1), 0, n, dev, 4) == d * r + d * t  # a one-expert cache reads one at a time


def test_one_token_prices_its_routed_reads_even_where_a_whole_read_would_pay():
    """Plain decoding keeps its routed reads (the store reads whole only past one token's top-k): 2 of 4 experts
    of 1 MB in six requests each would be worth a whole read by the rule, and a one-token pass is still priced
    one by one."""
    dev = device_of(PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34))
    ex = {**_ex(4), "experts": 4, "expert_bytes": [1 << 20], "expert_weights": [1 << 18]}
    assert worth_whole(2, 6, 1 << 20, 6, 4 << 20, REQUEST_BYTES)
    r, t = read_seconds(ex, 0, dev), compute_seconds(ex, 0, 1, dev, 4)
    assert abs(apart_seconds(ex, 0, 1, dev, 4) - (r + max(r, t) + t)) < 1e-12
    w = 6 * dev.disk_read_s + 4 * (1 << 20) / dev.disk_bps
    assert apart_seconds(ex, 0, 2, dev, 4) >= w  # two tokens: read whole
