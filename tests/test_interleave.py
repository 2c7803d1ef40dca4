"""Resident layers spread through the stack (offload/planning/memplan.resident_ids), streamed between them.

The plan keeps r of n layers resident at evenly spaced indices, so the stream reads the next streamed
layer while resident ones compute; layers still run in index order, so greedy ids equal the all-resident
run's, and the disk tier's --stats-json reports link_busy_fraction. (How busy the link gets is a timing:
bench/interleave.py measures it against a resident prefix.)
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from offload.planning.memplan import resident_ids
from specexec_cli.terminal.app import app
from tests.conftest import make_model


@pytest.mark.parametrize("n,r", [(8, 0), (8, 8), (8, 1), (8, 3), (80, 26), (80, 79)])
def test_resident_ids_are_spread(n, r):
    ids = resident_ids(n, r)
    assert len(ids) == r and ids == sorted(set(ids)) and all(0 <= i < n for i in ids)
    if 0 < r < n:
        gaps = [b - a for a, b in zip([-1] + ids, ids + [n])]
        assert max(gaps) - min(gaps) <= 2  # even spacing: no long resident run, no long streamed run
        assert ids != list(range(r)) or r == n - 1


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("il")
    return make_model(root / "t", seed=1, layers=6), make_model(root / "d", seed=2, layers=2)


def _run(pair, tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    res = CliRunner().invoke(
        app,
        [
            "run",
            "-p",
            "def f(x):",
            "--target",
            str(pair[0]),
            "--draft",
            str(pair[1]),
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--max-new-tokens",
            "24",
            "--no-live",
            "--stats-json",
            str(out),
            *flags,
        ],
    )
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text()), res.stderr


def test_spread_placement_decodes_the_same_ids(pair, tmp_path):
    ref, _ = _run(pair, tmp_path, "resident", "--offload", "none")
    got, _err = _run(pair, tmp_path, "spread", "--offload", "auto", "--max-ram", "400KB")
    assert "2 layers resident, 4 streamed from disk" in got["offload"], got["offload"]
    assert got["token_ids"] == ref["token_ids"]
    assert 0.0 <= got["link_busy_fraction"] <= 1.0 and len(got["link_busy_per_pass"]) == got["target_passes"]
