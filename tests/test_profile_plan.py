"""A profile's measured figures in the plan: used only for this machine, this target and this placement
(each other case says in one line why not), an unparsable profile is a one-line error (exit 2), and the
dry run's candidate tables fit 80 columns."""

from __future__ import annotations

import json
import math
import socket

import pytest
from typer.testing import CliRunner

from specexec_cli.terminal.app import app

POINTS = {"1": 0.01, "2": 0.011, "4": 0.012, "8": 0.02, "16": 0.04}


@pytest.fixture(autouse=True)
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))  # no profile of this machine leaks in


def dry(target, tmp_path, *extra, name="plan"):
    stats = tmp_path / f"{name}.json"
    res = CliRunner(env={"COLUMNS": "80"}).invoke(
        app,
        [
            "run",
            "-p",
            "x",
            "--target",
            str(target),
            "--draft",
            "self",
            "--draft-bits",
            "4",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--offload",
            "disk",
            "--budget",
            "8",
            "--temperature",
            "0",
            "--dry-run",
            "--stats-json",
            str(stats),
            *extra,
        ],
    )
    assert res.exit_code == 0, res.output
    return json.loads(stats.read_text())["plan"], res


def profile_for(target, placement, tmp_path, **over) -> str:
    models = dict(
        target=str(target),
        target_resolved=str(target.resolve()),
        plan_dtype="fp32",
        placement=placement,
        target_seconds=POINTS,
        draft_timings={"self-4": {"step_seconds": 0.005, "grow_seconds": {"16": 0.3}, "max_beams": 32}},
    )
    models.update(over.pop("models", {}))
    prof = dict(
        schema="specx-profile",
        version=1,
        hostname=socket.gethostname(),
        created="now",
        cpu={},
        memory={},
        gpus=[],
        disk={},
        matmul={},
        models=models,
        recommended=None,
    )
    prof.update(over)
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(prof))
    return str(path)


def loglog(points: dict, x: float) -> float:
    xs = sorted(int(k) for k in points)
    x0, x1 = max(v for v in xs if v <= x), min(v for v in xs if v >= x)
    y0, y1 = points[str(x0)], points[str(x1)]
    return y0 * (y1 / y0) ** (math.log(x / x0) / math.log(x1 / x0))


def test_a_matching_profile_replaces_the_modelled_pass_and_draft(tiny_pair, tmp_path):
    base, _ = dry(tiny_pair[0], tmp_path, name="base")
    placement = [base["resident_layers"], base["streamed_layers"]["ram"], base["streamed_layers"]["disk"]]
    plan, res = dry(tiny_pair[0], tmp_path, "--profile", profile_for(tiny_pair[0], placement, tmp_path))
    (four,) = [c for c in plan["candidates"] if c["draft"] == "self"]
    assert four["sources"] == {"pass": "measured", "draft": "measured"}
    assert four["pass_seconds"] == pytest.approx(loglog(POINTS, 9), rel=1e-4)  # n = budget 8 + the root
    assert four["draft_seconds"] == pytest.approx(0.3)  # below the one measured tree: flat
    plain = plan["candidates"][-1]
    assert plain["draft"] == "none" and plain["pass_seconds"] == pytest.approx(0.01)
    assert all(len(line) <= 80 for line in res.stdout.splitlines()), res.stdout


def test_another_placement_falls_back_to_the_model(tiny_pair, tmp_path):
    plan, _ = dry(tiny_pair[0], tmp_path, "--profile", profile_for(tiny_pair[0], [9, 9, 9], tmp_path))
    assert all(c["sources"]["pass"] == "modelled" for c in plan["candidates"])


@pytest.mark.parametrize(
    "over,why",
    [
        (dict(hostname="elsewhere"), "was measured on 'elsewhere', not this machine: its figures are not used"),
        (dict(models=dict(target_resolved="/nowhere/model")), "timed another target"),
        (dict(models=dict(plan_dtype="bf16")), "timed this target at --dtype bf16, not fp32"),
    ],
)
def test_a_profile_for_another_machine_target_or_dtype_is_not_used(tiny_pair, tmp_path, over, why):
    plan, _res = dry(tiny_pair[0], tmp_path, "--profile", profile_for(tiny_pair[0], [0, 0, 3], tmp_path, **over))
    notes = [n for n in plan["notes"] if why in n]
    assert len(notes) == 1 and "prof.json" in notes[0]
    assert all(c["sources"]["pass"] == "modelled" for c in plan["candidates"])


def test_an_unparsable_profile_is_one_line_naming_it_exit_2(tiny_pair, tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    res = CliRunner().invoke(
        app, ["run", "-p", "x", "--target", str(tiny_pair[0]), "--device", "cpu", "--dry-run", "--profile", str(bad)]
    )
    assert res.exit_code == 2 and "Traceback" not in res.output
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and "specx profile" in err


def test_no_timed_size_carries_the_cold_start(monkeypatch):
    """modeltimes.median_time runs WARMUP untimed calls first: a first call 100x slower than the rest
    (a cold start: page cache, allocator, threads) is not in the figure."""
    from specexec_cli.tools import modeltimes

    clock = {"t": 0.0, "calls": 0}

    def fake_call():
        clock["calls"] += 1
        clock["t"] += 1.0 if clock["calls"] == 1 else 0.01

    monkeypatch.setattr(modeltimes.time, "perf_counter", lambda: clock["t"])
    assert modeltimes.median_time(fake_call, min_seconds=0.05) == pytest.approx(0.01)
    assert clock["calls"] >= modeltimes.WARMUP + 3


def test_profile_times_every_draft_a_run_could_take(monkeypatch):
    from specexec_cli.session import deps
    from specexec_cli.tools import modeltimes

    monkeypatch.setattr(deps, "installed", lambda m: m != "hqq")
    assert modeltimes.draft_configs("self") == [("self", 4, "self-4")]  # 3/2 bits need hqq
    monkeypatch.setattr(deps, "installed", lambda m: True)
    assert [k for _, _, k in modeltimes.draft_configs("self")] == ["self-4", "self-3", "self-2"]
    assert modeltimes.draft_configs("/d") == [("/d", None, "small")] and modeltimes.draft_configs(None) == [
        (None, None, "")
    ]
