"""The measured tables of README.md, CONTRIBUTING.md and docs/ are exactly what bench/results/ JSON
holds (tools/perf_tables.py regenerates every block bench/manifest.py can render from its JSON). A
result changed without `python tools/perf_tables.py` fails here; the other tests prove the check can
fail (a changed figure, an unknown block name, an unclosed block) and pin what the headline tables show.
"""

from __future__ import annotations

import copy

import pytest

from tests.conftest import ROOT, load_script


@pytest.fixture(scope="module")
def tool():
    return load_script("tools/perf_tables.py")


def test_every_table_matches_its_json(tool, capsys):
    assert tool.main(["--check"]) == 0, capsys.readouterr().out


def test_the_readme_and_the_performance_page_carry_the_headline(tool):
    block = tool.manifest.BLOCKS["headline"]
    assert block.pages == ("README.md", "docs/performance.md") and block in tool.generated()
    for page in block.pages:
        assert "<!-- bench:headline -->" in (ROOT / page).read_text()


def test_the_pair_headline_is_the_budget_1024_cells(tool):
    runs = tool.manifest.load(tool.manifest.BLOCKS["pair-headline"])
    rows = [r for run in runs for r in run["rows"] if r["budget"] == 1024 and r["draft"] == "self-nf4"]
    assert len(rows) == 2 and {r["temperature"] for r in rows} == {0.0, 0.7}
    t0 = next(r for r in rows if r["temperature"] == 0.0)
    assert f"| {t0['tokens_per_pass']:.2f} |" in tool.pair_headline(runs).splitlines()[3]


def test_the_headline_is_the_real_model_from_disk(tool):
    data = tool.manifest.load(tool.manifest.BLOCKS["headline"])
    assert data["target"].startswith("SmolLM2") and {r["tier"] for r in data["rows"]} >= {"disk"}
    disk = [r for r in data["rows"] if r["tier"] == "disk"]
    head = tool.headline(data).splitlines()
    assert head[2].startswith("| `--method ar` |") and "| 1.00x | - |" in head[2]
    configs = list(dict.fromkeys(r["config"] for r in disk))
    assert len(head) == 2 + len(configs)
    first = [r for r in disk if r["config"] == configs[1]]
    tpp = sum(r["tokens_per_pass"] for r in first) / len(first)
    assert f"| {tpp:.2f} |" in head[3]


def test_a_changed_figure_is_caught(tool, monkeypatch, capsys):
    real = tool.manifest.load

    def changed(block):
        data = real(block)
        if block.name == "serve":
            data = copy.deepcopy(data)
            data["summary"]["ratio"] += 0.01
        return data

    monkeypatch.setattr(tool.manifest, "load", changed)
    assert tool.main(["--check", "serve"]) == 1
    assert "CONTRIBUTING.md" in capsys.readouterr().out


def test_unknown_and_unclosed_blocks_are_errors(tool):
    with pytest.raises(ValueError, match="not regenerated from JSON"):
        tool.generated(["nope"])
    serve = tool.generated(["serve"])
    with pytest.raises(ValueError, match="exactly one"):
        tool.rendered({"CONTRIBUTING.md": "<!-- bench:serve -->\nx\n"}, serve)
    got = tool.rendered({"CONTRIBUTING.md": "<!-- bench:serve -->\nold\n<!-- /bench:serve -->"}, serve)
    body = tool.serve(tool.manifest.load(serve[0]))
    assert got == {"CONTRIBUTING.md": f"<!-- bench:serve -->\n{body}\n<!-- /bench:serve -->"}
