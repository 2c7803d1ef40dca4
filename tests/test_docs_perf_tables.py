"""The measured tables between `<!-- perf:NAME -->` markers in README.md and docs/ are exactly what
bench/results/ JSON holds (tools/perf_tables.py). A result changed without
`python tools/perf_tables.py` fails here; the other tests prove the check can fail (a changed figure,
an unknown table name, an unclosed block) and that every table is used somewhere.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, load_script


@pytest.fixture(scope="module")
def tool():
    return load_script("tools/perf_tables.py")


def test_every_perf_table_matches_its_json(tool, capsys):
    assert tool.main(["--check"]) == 0, capsys.readouterr().out


def test_every_table_is_placed_and_the_readme_has_the_headline(tool):
    pages = "".join((ROOT / f).read_text() for f in tool.FILES)
    assert {name for name in tool.OPEN.findall(pages)} == set(tool.TABLES)
    assert "<!-- perf:headline -->" in (ROOT / "README.md").read_text()


def test_the_pair_headline_is_the_budget_1024_cells(tool):
    rows = [
        r
        for f in sorted((ROOT / "bench" / "results").glob("selfdraft_t0_gap*.json"))
        for r in json.loads(f.read_text())["rows"]
        if r["budget"] == 1024 and r["draft"] == "self-nf4"
    ]
    assert len(rows) == 1
    assert f"| {rows[0]['tokens_per_pass']:.2f} |" in tool.pair_headline().splitlines()[3]


def test_the_headline_is_the_real_model_from_disk(tool):
    data = json.loads((ROOT / "bench" / "results" / "spec_pass.json").read_text())
    assert data["target"].startswith("SmolLM2") and {r["tier"] for r in data["rows"]} >= {"disk"}
    disk = [r for r in data["rows"] if r["tier"] == "disk"]
    head = tool.headline().splitlines()
    assert head[2].startswith("| `--method ar` |") and "| 1.00x | - |" in head[2]
    configs = list(dict.fromkeys(r["config"] for r in disk))
    assert len(head) == 2 + len(configs)
    first = [r for r in disk if r["config"] == configs[1]]
    tpp = sum(r["tokens_per_pass"] for r in first) / len(first)
    assert f"| {tpp:.2f} |" in head[3]


def test_a_changed_figure_is_caught(tool, monkeypatch, capsys):
    real = tool.load

    def changed(name):
        data = real(name)
        if name == "serve/serve.json":
            data["summary"]["ratio"] += 0.01
        return data

    monkeypatch.setattr(tool, "load", changed)
    assert tool.main(["--check"]) == 1
    assert "CONTRIBUTING.md" in capsys.readouterr().out


def test_unknown_and_unclosed_blocks_are_errors(tool):
    with pytest.raises(ValueError, match="unknown perf table"):
        tool.render("<!-- perf:nope -->\nx\n<!-- /perf:nope -->\n")
    with pytest.raises(ValueError, match="unclosed"):
        tool.render("<!-- perf:serve -->\nx\n")
    assert tool.render("<!-- perf:serve -->\nold\n<!-- /perf:serve -->") == (
        f"<!-- perf:serve -->\n{tool.serve()}\n<!-- /perf:serve -->"
    )
