"""The CPU's bf16 matmul prior: a CPU whose flags name native bf16 units (avx512_bf16, amx_bf16) is not
priced at the emulated-bf16 prior (5 GFLOP/s, which made `--draft` auto pick plain decoding and
`--budget auto` pick budget 1 on a disk-tier bf16 target, bench/auto_choices.py); a profile's measured
rate still wins, and the dry run's GEMM row shows the rate of the pass's own compute dtype."""

from __future__ import annotations

from offload.planning.passcost import PRIORS
from specexec_cli.session import profiles


def test_native_bf16_reads_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse2 avx2 avx512f avx512_bf16\n")
    assert profiles.native_bf16(info) == "avx512_bf16"
    info.write_text("flags : fpu sse2 avx2 amx_tile amx_bf16 avx512_bf16\n")
    assert profiles.native_bf16(info) == "amx_bf16"
    info.write_text("flags : fpu sse2 avx2\n")
    assert profiles.native_bf16(info) is None
    assert profiles.native_bf16(tmp_path / "missing") is None  # no /proc (macOS): the prior stays


def test_cpu_cost_device_takes_the_native_bf16_prior_unless_measured(monkeypatch):
    monkeypatch.setattr(profiles, "native_bf16", lambda: "avx512_bf16")
    dev = profiles.cost_device_for("cpu", None, None)
    assert dev.flops16 == 2 * PRIORS["cpu"]["flops32"] and "avx512_bf16" in dev.sources["flops16"]
    measured = {"matmul": {"device": "cpu", "bf16_gflops": 300.0, "fp32_gflops": 150.0}, "hostname": "h"}
    assert profiles.cost_device_for("cpu", None, measured).flops16 == 300e9
    monkeypatch.setattr(profiles, "native_bf16", lambda: None)
    assert profiles.cost_device_for("cpu", None, None).flops16 == PRIORS["cpu"]["flops16"]
    assert profiles.cost_device_for("cuda", None, None).flops16 == PRIORS["cuda"]["flops16"]  # CPU flags only


def test_the_pass_terms_carry_the_rate_of_their_compute_dtype():
    from types import SimpleNamespace

    from offload.planning.passcost import device_for, target_pass

    a = SimpleNamespace(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=48)
    plan = SimpleNamespace(ram_layers=[], disk_layers=[0, 1], layer_bytes=[10**6, 10**6])
    dev = device_for("cpu", flops16=200e9)
    assert target_pass(a, plan, dev, 16, 0, 2).flops == 200e9  # bf16 compute
    assert target_pass(a, plan, dev, 16, 0, 4).flops == PRIORS["cpu"]["flops32"]  # fp32 compute
