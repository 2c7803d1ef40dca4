"""The mixture-of-experts plan tables (tools/plan_moe.py): the quoted runs' machines go into the model as
stated, the read rate the table says a quoted figure needs is the one at which the model reaches it, and
the at/above/below word follows the figures. Sparse checkpoints with real headers (tests/sparse_moe.py)."""

from __future__ import annotations

import pytest

from tests.conftest import load_script
from tests.sparse_ckpt import read_checkpoint
from tests.sparse_moe import write_sparse_moe

GB = 10**9


@pytest.fixture(scope="module")
def moe():
    load_script("tools/plan_tables.py")  # puts bench/ (docblock) on the path, as the generator runs
    import tools.plan_moe

    return tools.plan_moe


@pytest.fixture(scope="module")
def qwen30(tmp_path_factory):
    return read_checkpoint(write_sparse_moe("qwen3-30b-a3b", tmp_path_factory.mktemp("moe") / "q"))


def test_the_quoted_card_and_read_rate_reach_the_model(moe):
    pub = next(p for p in moe.PUBLISHED if p.card == "RTX 2080")
    dev, row = moe.machine_device(pub, 33e9)
    assert row["memory_gib"] == 8 and dev.memory_bps == 448e9 and dev.link_bps == pytest.approx(0.75 * 16e9)
    assert dev.dequant_bps == {"cpu-experts": 33e9} and "assumed" in dev.sources["dequant"]


def test_the_needed_rate_is_where_the_model_reaches_the_figure(moe, qwen30):
    pub = next(p for p in moe.PUBLISHED if p.name == "qwen3-30b-a3b")
    ram, at = moe.machine_plans(pub, qwen30)
    ex = at(40e9)
    assert ex["cpu_bps"] == 40e9 and ex["mode"] == "split" and ex["fits"]
    assert ex["gpu_experts"] * ex["expert_bytes"][0] <= 8 * GB  # the 8 GB card's cache
    assert ex["ram_experts"] + ex["gpu_experts"] == 128 * 48  # RAM not stated: room for every expert
    assert ram * GB * 0.8 >= ex["host_bytes"]["experts_ram"]
    assert at(80e9)["tokens_per_second"] > ex["tokens_per_second"]  # a faster CPU read models faster
    target = ex["tokens_per_second"] * 1.1
    need, cap = moe.needed_rate(at, target)
    assert need > 40e9 and cap >= target
    assert at(need)["tokens_per_second"] >= target > at(need * 0.97)["tokens_per_second"]
    none, cap = moe.needed_rate(at, 1e6)  # beyond what any read rate models
    assert none is None and cap < 1e6


def test_the_verdict_follows_the_figures(moe):
    pub = moe.Published("gpt-oss-120b", 37, 44, "", "RTX 5090", 64, "bf16")
    assert [moe.verdict(t, pub) for t in (36.9, 37, 44, 44.1)] == ["below", "at", "at", "above"]
    row = moe.machine_table([(pub, 64, _split(), None, 30.5)]).splitlines()[2]
    assert "| below (0.76x of 37) |" in row and "at most 30.5 tok/s" in row


def _split() -> dict:
    return dict(
        mode="split",
        tokens_per_second=28.1,
        cpu_bps=40e9,
        gpu_experts=2,
        ram_experts=3,
        disk_experts=0,
        device_bytes={"attention_shared": 1.9e9, "expert_cache": 26e9},
        host_bytes={"experts_ram": 35e9},
        disk_bytes=0,
    )
