"""specx profile: probes, model timings, the versioned JSON and where it is stored/found."""

from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

from specexec_cli.core.budget import candidate_budgets, make_tuner
from specexec_cli.core.draft import TreeShape
from specexec_cli.errors import SpecxError
from specexec_cli.session import profiles
from specexec_cli.terminal.app import app
from specexec_cli.tools import profiler

REQUIRED = {
    "schema",
    "version",
    "created",
    "hostname",
    "cpu",
    "memory",
    "gpus",
    "disk",
    "matmul",
    "models",
    "recommended",
}


@pytest.fixture(autouse=True)
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "xdg"


def test_profile_with_models_writes_a_valid_profile(tiny_pair, tmp_path, xdg):
    out = tmp_path / "p.json"
    args = [
        "profile",
        "--target",
        str(tiny_pair[0]),
        "--draft",
        str(tiny_pair[1]),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--max-tokens",
        "8",
        "--disk-mb",
        "4",
        "--out",
        str(out),
        "--no-live",
        "--calibration-tokens",
        "12",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.stderr
    prof = json.loads(out.read_text())
    assert set(prof) >= REQUIRED and prof["schema"] == "specx-profile" and prof["version"] == profiler.VERSION
    assert prof["cpu"]["logical_cores"] >= 1 and prof["memory"]["total_bytes"] > 0
    assert prof["disk"]["read_gbps"] > 0 and prof["disk"]["method"] in ("o_direct", "buffered")
    assert prof["matmul"]["fp32_gflops"] > 0 and prof["matmul"]["bf16_gflops"] > 0
    m = prof["models"]
    assert sorted(map(int, m["target_seconds"])) == [1, 2, 4, 8]
    assert all(v > 0 for v in m["target_seconds"].values()) and m["draft_step_seconds"] > 0
    assert prof["recommended"]["budget"] in candidate_budgets(7)
    assert "recommended" in res.stderr and "--budget" in res.stderr  # the table
    # the last profile written on this machine is what run/chat pick up without --profile
    assert json.loads((xdg / "specx" / "profiles" / "last.json").read_text())[socket.gethostname()] == str(out)
    assert profiles.find_profile(None)["created"] == prof["created"]
    assert make_tuner(prof, TreeShape(64, 64), False).timing.source == "profile"


def test_hardware_only_profile_goes_to_the_per_machine_path(xdg):
    res = CliRunner().invoke(app, ["profile", "--disk-mb", "4", "--no-live"])
    assert res.exit_code == 0, res.stderr
    path = xdg / "specx" / "profiles" / f"{socket.gethostname()}.json"
    prof = profiles.read_profile(path)
    assert prof["models"] is None and prof["recommended"]["timing"] == "prior"
    mem = prof["device_memory"]["cpu"]  # one large host copy: read + write bytes over its time
    assert mem["gbps"] > 0 and mem["bytes"] > 0 and mem["method"] == "copy_ read + write"
    assert not list(xdg.parent.glob(".specx-probe-*"))  # the disk probe's temp file is gone


def test_bad_profiles_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "specx-profile", "version": 99}))
    with pytest.raises(SpecxError, match="re-run `specx profile`"):
        profiles.read_profile(bad)
    with pytest.raises(SpecxError, match="not found"):
        profiles.read_profile(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(SpecxError, match="unreadable"):
        profiles.read_profile(tmp_path / "junk.json")
    res = CliRunner().invoke(app, ["profile", "--draft", "x"])
    assert res.exit_code == 2 and "--draft given without --target" in res.stderr and "Traceback" not in res.stderr


def test_reference_profile_is_valid():
    from pathlib import Path

    ref = Path(__file__).resolve().parents[1] / "profiles" / "reference-cpu.json"
    prof = profiles.read_profile(ref)
    assert set(prof) >= REQUIRED
    assert make_tuner(prof, TreeShape(64, 64), False).timing.source == "profile"


def test_profile_node_calibration_is_the_prior_of_later_runs(tiny_pair, tmp_path, xdg):
    """`specx profile --target --draft` stores what the calibration learned per sampling key; a
    later `specx run` with the same pair (found as this machine's last profile) starts from it."""
    import torch

    from specexec_cli.core import calibrate

    out = tmp_path / "p.json"
    base = ["--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--dtype", "fp32", "--device", "cpu"]
    res = CliRunner().invoke(
        app,
        [
            "profile",
            *base,
            "--max-tokens",
            "4",
            "--disk-mb",
            "4",
            "--out",
            str(out),
            "--no-live",
            "--calibration-tokens",
            "16",
        ],
    )
    assert res.exit_code == 0, res.stderr
    stored = json.loads(out.read_text())["node_calibration"]
    assert set(stored) == {"T=0,top_k=0,top_p=1,gap", "T=0.7,top_k=0,top_p=1,race"}
    for key, rates in stored.items():
        assert len(rates) == calibrate.N_FEATURES and all(0 < r < 1 for r in rates)
        prior = calibrate.builtin_prior(calibrate.gap_features(key))
        assert not torch.allclose(torch.tensor(rates), prior, atol=1e-3), "nothing was learned"
    calibrate._PAIRS.clear()
    res = CliRunner().invoke(
        app, ["run", "-p", "def f(x):", *base, "--budget", "8", "--max-new-tokens", "4", "--no-live"]
    )
    assert res.exit_code == 0, res.stderr
    (cal,) = [c for k, c in calibrate._PAIRS.items() if k[2] == "T=0,top_k=0,top_p=1,gap"]
    torch.testing.assert_close(cal.m0, torch.tensor(stored["T=0,top_k=0,top_p=1,gap"]).clamp(1e-4, 1 - 1e-4))
    calibrate._PAIRS.clear()
    other = tmp_path / "other"
    __import__("shutil").copytree(tiny_pair[1], other)  # another draft: the stored prior does not apply
    res = CliRunner().invoke(
        app,
        [
            "run",
            "-p",
            "def f(x):",
            *base[:2],
            "--draft",
            str(other),
            *base[4:],
            "--budget",
            "8",
            "--max-new-tokens",
            "4",
            "--no-live",
        ],
    )
    assert res.exit_code == 0, res.stderr
    (cal,) = [c for k, c in calibrate._PAIRS.items() if k[2] == "T=0,top_k=0,top_p=1,gap"]
    torch.testing.assert_close(cal.m0, calibrate.builtin_prior(coupled=True))


def test_measured_bandwidth_feeds_the_draft_cost_model(tiny_pair, tmp_path):
    """A profile's measured device memory bandwidth is what the dry run models the candidates with (and
    says so); without one the plan names its prior."""
    prof = profiler.build_profile(
        dict(
            cpu={},
            memory={},
            gpus=[],
            disk={},
            matmul={},
            device_memory={"cpu": {"name": "test cpu", "gbps": 12.5, "bytes": 1, "method": "copy_ read + write"}},
        ),
        None,
        None,
    )
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(prof))
    out = {}
    for name, extra in (("measured", ["--profile", str(path)]), ("prior", [])):
        stats = tmp_path / f"{name}.json"
        res = CliRunner().invoke(
            app,
            [
                "run",
                "-p",
                "x",
                "--target",
                str(tiny_pair[0]),
                "--draft",
                "self",
                "--device",
                "cpu",
                "--offload",
                "disk",
                "--dry-run",
                "--stats-json",
                str(stats),
                *extra,
            ],
        )
        assert res.exit_code == 0, res.output
        out[name] = json.loads(stats.read_text())["plan"]
    assert out["measured"]["machine"]["memory_bps"] == 12.5e9
    assert out["measured"]["machine"]["source"].startswith("measured: test cpu")
    assert out["prior"]["machine"]["source"] == "prior" and out["prior"]["machine"]["memory_bps"] == 20e9
    assert out["measured"]["machine"]["sources"]["memory_bps"].startswith("measured")
    assert out["prior"]["machine"]["sources"]["memory_bps"] == "prior"
    slow, fast = out["measured"]["choice"], out["prior"]["choice"]  # the slower memory: no faster a draft step
    assert slow["draft_seconds"] >= fast["draft_seconds"] and slow["terms"]["gemm"] >= fast["terms"]["gemm"]


def test_cpu_expert_probe_times_the_routed_experts_bytes_out_of_cache():
    """The profile's CPU expert rate (kernelprobes.probe_cpu_experts): its buffer holds span // one
    expert's fp32 bytes experts, the rate is the routed experts' bytes over the seconds, and a profile's
    rate reaches the plan's Device as dequant_bps["cpu-experts"], named as measured."""
    from specexec_cli.tools import kernelprobes

    got = kernelprobes.probe_cpu_experts(hidden=256, inter=128, top_k=2, repeats=2, span=8 << 20)
    one = 4 * 3 * 256 * 128
    assert got["experts"] == (8 << 20) // one and got["seconds"] > 0
    assert got["gbps"] == pytest.approx(2 * one / got["seconds"] / 1e9, rel=0.01, abs=1e-3)
    prof = {"hostname": "h", "dequant": {"device": "cpu", "shape": [1, 1], "cpu-experts": {**got, "gbps": 7.5}}}
    dev = profiles.cost_device_for("cpu", None, prof)
    assert dev.dequant_bps["cpu-experts"] == 7.5e9 and dev.sources["dequant"] == "measured (h)"
