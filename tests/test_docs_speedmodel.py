"""The speed-model tables of CONTRIBUTING.md, and docs/performance.md's bigger-than-RAM table, are what their
benchmarks' JSON says (bench/selfdraft_width.py, bench/speedmodel.py, bench/bigger_than_ram.py: `--table` writes them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("bench/selfdraft_width.py", "selfdraft_width.json", "CONTRIBUTING.md", "selfdraft-width"),
    ("bench/speedmodel.py", "speedmodel.json", "CONTRIBUTING.md", "speedmodel"),
    ("bench/bigger_than_ram.py", "bigger_than_ram.json", "docs/performance.md", "bigger-than-ram"),
]


@pytest.mark.parametrize("script,result,page,block", CASES)
def test_the_doc_table_is_the_benchmarks_json(script, result, page, block):
    tool = load_script(script)
    data = json.loads((ROOT / "bench" / "results" / result).read_text())
    text = (ROOT / page).read_text()
    start, end = f"<!-- bench:{block} -->\n", f"<!-- /bench:{block} -->"
    assert text.count(start) == 1 and text.count(end) == 1
    assert text.split(start, 1)[1].split(end, 1)[0] == tool.table(data) + "\n"


def test_the_width_benchmark_meets_issue_41():
    """Automatic width >= 0.9x the best explicit width's tokens/s in every cell, and lossless at T = 0."""
    data = json.loads((ROOT / "bench" / "results" / "selfdraft_width.json").read_text())
    auto = [r for r in data["summary"] if r["config"] == "auto"]
    assert {(r["budget"], r["temperature"]) for r in auto} == {(64, 0.0), (64, 0.7), (256, 0.0), (256, 0.7)}
    assert all(r["lossless"] in (True, None) for r in data["summary"])
    assert [r["vs_best"] >= 0.9 for r in auto] == [True] * len(auto), auto


def test_the_cpu_forward_floor_is_the_measured_one():
    """The speed model's CPU per-forward floor is the floor bench/pass_breakdown.py measured on the real
    model (a plain decoding pass beyond its matmuls, the GGUF kernel on), within 10%."""
    import json

    from offload.planning.passcost import PRIORS
    from tests.conftest import ROOT

    measured = json.loads((ROOT / "bench" / "results" / "pass_breakdown.json").read_text())["kernel"]["floor_s"]
    assert abs(PRIORS["cpu"]["forward_floor_s"] - measured) <= 0.1 * measured, measured


def test_the_cpu_stack_floor_is_the_measured_one():
    """The one-call stack's floor (passcost.STACK_FLOOR_CPU) is what bench/pass_breakdown.py measured
    for a pass on the stack (its "stack" mode), within 25% (a 2 ms figure on a shared machine)."""
    from offload.planning.passcost import PRIORS

    run = json.loads((ROOT / "bench" / "results" / "pass_breakdown.json").read_text())["stack"]
    assert run["stack"], "the stack mode did not run on the stack"
    assert abs(PRIORS["cpu"]["stack_floor_s"] - run["floor_s"]) <= 0.25 * run["floor_s"], run["floor_s"]
