"""The trained pair's self-draft table in CONTRIBUTING.md is exactly what bench/selfdraft.py's JSON results
hold (tools/selfdraft_table.py, from the runs bench/manifest.py lists; written by tools/perf_tables.py):
a result added or changed without `python tools/perf_tables.py` fails here. The second test proves
the check can fail (one figure changed must not be found)."""

from __future__ import annotations

import copy

import pytest

from tests.conftest import ROOT, load_script


@pytest.fixture(scope="module")
def tool():
    return load_script("tools/selfdraft_table.py")


@pytest.fixture(scope="module")
def runs():
    manifest = load_script("bench/manifest.py")
    return manifest.load(manifest.BLOCKS["selfdraft"])


PAGE, BEGIN, END = "CONTRIBUTING.md", "<!-- bench:selfdraft -->", "<!-- /bench:selfdraft -->"


def test_the_page_table_is_the_bench_json(tool, runs):
    page = (ROOT / PAGE).read_text()
    block = page[page.index(BEGIN) + len(BEGIN) : page.index(END)]
    assert block.strip() == tool.table(runs)
    rows = tool.rows(runs)
    assert any(r["draft"] == "shared-2.9M" for r in rows) and any(r["draft"] == "self-nf4" for r in rows)


def test_a_changed_figure_is_caught(tool, runs):
    changed = copy.deepcopy(runs)
    changed[0]["rows"][1]["tokens_per_pass"] += 1.0
    page = (ROOT / PAGE).read_text()
    assert tool.table(runs) in page and tool.table(changed) not in page
