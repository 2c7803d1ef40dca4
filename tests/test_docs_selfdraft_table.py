"""The trained pair's self-draft table in CONTRIBUTING.md is exactly what bench/selfdraft.py's JSON results
hold (tools/selfdraft_table.py, written by tools/perf_tables.py): a result added or changed without
`python tools/perf_tables.py` fails here. The second test proves the check can fail (one figure changed
must not be found)."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, load_script


@pytest.fixture(scope="module")
def tool():
    return load_script("tools/selfdraft_table.py")


PAGE, BEGIN, END = "CONTRIBUTING.md", "<!-- perf:selfdraft -->", "<!-- /perf:selfdraft -->"


def test_the_page_table_is_the_bench_json(tool):
    page = (ROOT / PAGE).read_text()
    block = page[page.index(BEGIN) + len(BEGIN) : page.index(END)]
    assert block.strip() == tool.table()
    assert any(r["draft"] == "shared-2.9M" for r in tool.rows()) and any(r["draft"] == "self-nf4" for r in tool.rows())


def test_a_changed_figure_is_caught(tool, monkeypatch):
    real = tool.rows()
    changed = [dict(r) for r in real]
    changed[1]["tokens_per_pass"] += 1.0
    monkeypatch.setattr(tool, "rows", lambda: changed)
    page = (ROOT / PAGE).read_text()
    assert tool.table() not in page
