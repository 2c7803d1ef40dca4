"""`specx profile` measures the per-forward floors passcost.Device prices (tools/modeltimes.floor_seconds):
the part of a 1-token target pass and of a draft step outside the device's work, written under the
profile's `floors` where the busy spans hold all the work, and read back by the plan as measured figures."""

from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

from specexec_cli.session import profiles
from specexec_cli.terminal.app import app
from specexec_cli.tools import profiler


@pytest.fixture(autouse=True)
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)


def profile(tmp_path, target, *extra) -> dict:
    out = tmp_path / "p.json"
    args = ["profile", "--target", str(target), "--dtype", "fp32", "--device", "cpu", "--max-tokens", "2"]
    args += ["--disk-mb", "4", "--calibration-tokens", "0", "--out", str(out), "--no-live", *extra]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())


def test_profile_of_a_resident_model_writes_its_floors(tiny_pair, tmp_path):
    prof = profile(tmp_path, tiny_pair[0], "--draft", str(tiny_pair[1]))
    assert prof["models"]["placement"][1:] == [0, 0] and "floors" not in prof["models"]
    cpu = prof["floors"]["cpu"]
    assert cpu["target"] == str(tiny_pair[0])
    for kind in ("forward", "step"):  # floor = the share of the wall outside the ops, busy = the rest
        floor, wall, busy = cpu[f"{kind}_floor_s"], cpu[f"{kind}_wall_s"], cpu[f"{kind}_busy_s"]
        assert 0 <= floor < wall and busy > 0


def test_cpu_disk_streamed_target_writes_no_forward_floor(tiny_pair, tmp_path):
    """Disk reads are no aten ops: their waits would land in the floor, double-counting the transfer term."""
    prof = profile(tmp_path, tiny_pair[0], "--offload", "disk")
    assert prof["models"]["placement"][2] > 0  # some layer streams from disk
    assert "forward_floor_s" not in (prof.get("floors") or {}).get("cpu", {})
    dev = profiles.cost_device_for("cpu", None, dict(prof, hostname=socket.gethostname()))
    assert dev.forward_floor_s == 0.01 and dev.sources["forward_floor_s"] == "prior"


def test_measured_floors_are_what_the_plan_prices(tiny_pair, tmp_path):
    """A profile's floors replace the priors, and the dry run's floor row names them measured."""
    hw = dict(cpu={}, memory={}, gpus=[], disk={}, matmul={})
    floors = {"cpu": {"forward_floor_s": 0.0042, "step_floor_s": 0.0031}}
    prof = profiler.build_profile(hw, dict(target="t", floors=floors), None)
    assert prof["floors"] == floors and "floors" not in prof["models"]
    dev = profiles.cost_device_for("cpu", None, prof)
    host = socket.gethostname()
    assert (dev.forward_floor_s, dev.step_floor_s) == (0.0042, 0.0031)
    assert dev.sources["forward_floor_s"] == dev.sources["step_floor_s"] == f"measured ({host})"
    path, stats = tmp_path / "prof.json", tmp_path / "stats.json"
    path.write_text(json.dumps(prof))
    args = ["run", "-p", "x", "--target", str(tiny_pair[0]), "--draft", "self", "--device", "cpu"]
    res = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, [*args, "--dry-run", "--profile", str(path), "--stats-json", str(stats)]
    )
    assert res.exit_code == 0, res.output
    plan = json.loads(stats.read_text())["plan"]
    assert plan["machine"]["sources"]["forward_floor_s"] == f"measured ({host})"
    assert plan["choice"]["terms"]["floor"] == 0.0042
    row = next(line for line in res.output.splitlines() if line.strip("│┃ ").startswith("floor"))
    assert "0.0042" in row and f"measured ({host})" in row


def test_cpu_gguf_kernel_target_writes_a_floor_only_with_the_kernel_off(tmp_path, monkeypatch):
    """specx's C kernels are ctypes calls, no aten ops: with them multiplying the GGUF blocks the busy spans
    miss the matmuls, and no floor is written; with SPECX_GGUF_KERNEL=off the layers' fp32 copies run as aten
    ops and it is. A plan whose pass runs on the one-call stack prices the stack's floor, and says its source."""
    pytest.importorskip("gguf")
    from offload.formats import ggml_kernel_enabled
    from tests.conftest import make_model
    from tests.gguf_build import write_gguf

    if not ggml_kernel_enabled():
        pytest.skip("the GGUF CPU kernel is not built here")
    f = write_gguf(make_model(tmp_path / "hf", seed=3, layers=2, hidden=256), tmp_path / "m" / "t-Q4_1.gguf", "Q4_1")
    assert "floors" not in profile(tmp_path, f)
    monkeypatch.setenv("SPECX_GGUF_KERNEL", "off")
    prof = profile(tmp_path, f)
    assert 0 <= prof["floors"]["cpu"]["forward_floor_s"] < prof["floors"]["cpu"]["forward_wall_s"]
    monkeypatch.setenv("SPECX_GGUF_KERNEL", "auto")
    path, stats = tmp_path / "prof.json", tmp_path / "stats.json"
    path.write_text(json.dumps(dict(prof, hostname=socket.gethostname())))
    args = ["run", "-p", "x", "--target", str(f), "--device", "cpu", "--dry-run", "--profile", str(path)]
    res = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--stats-json", str(stats)])
    assert res.exit_code == 0, res.output
    plan = json.loads(stats.read_text())["plan"]
    assert plan["kernel"]["stack"] and plan["choice"]["terms"]["floor"] == plan["machine"]["stack_floor_s"]
    row = next(line for line in res.output.splitlines() if line.strip("│┃ ").startswith("floor"))
    assert "measured" not in row and "prior" in row
