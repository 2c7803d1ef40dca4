"""bench/manifest.py against the pages: every generated block of README.md, CONTRIBUTING.md and docs/
(the GPU day's tables aside: tools/gpuday writes them, docs/gpu-status.md's and CONTRIBUTING.md's
`gpuday-` blocks, tests/test_gpu_day.py checks them) is a `<!-- bench:NAME -->` block with a
manifest entry (docs/architecture.md's `arch-` module tables aside: tools/arch_tables.py makes them
from the modules' docstrings, tests/test_arch_tables.py checks them), and every entry's block is on
each of its pages; every entry's script, JSON and renderer exist; and every block the manifest calls
reproducible is exactly what its renderer makes of the saved JSON, so a table edited by hand or left
stale fails here. The last tests prove the checks can fail: a changed figure, a hand edit, an
unknown or unclosed block, a second dialect.
"""

from __future__ import annotations

import copy
import json
import re
import shlex

import pytest

from tests.conftest import ROOT, load_script

OTHER_DIALECT = re.compile(r"<!-- /?(?!bench:|example:)[a-z]+:[a-z0-9_-]*")


def owned_by_arch_tables(name: str, page: str) -> bool:
    """docs/architecture.md's module tables: tools/arch_tables.py's, from docstrings, no run or JSON."""
    return page == "docs/architecture.md" and name.startswith("arch-")


def owned_by_gpuday(name: str, page: str) -> bool:
    """The GPU day's tables on a page the manifest covers (CONTRIBUTING.md's CUDA tests): tools/gpuday's,
    from a GPU run's summary, kept nowhere in bench/results/."""
    from tools.gpuday import tables

    return name.startswith("gpuday-") and tables.PAGES.get(name.removeprefix("gpuday-")) == page


@pytest.fixture(scope="module")
def manifest():
    return load_script("bench/manifest.py")


@pytest.fixture(scope="module")
def docblock():
    return load_script("bench/docblock.py")


def page_blocks(manifest, docblock) -> dict[str, list[str]]:
    return {p: docblock.block_names((ROOT / p).read_text()) for p in manifest.PAGES}


def test_every_block_on_the_pages_has_an_entry_and_every_entry_its_blocks(manifest, docblock):
    on_pages = {
        (name, page)
        for page, names in page_blocks(manifest, docblock).items()
        for name in names
        if not owned_by_arch_tables(name, page) and not owned_by_gpuday(name, page)
    }
    listed = {(b.name, page) for b in manifest.BLOCKS.values() for page in b.pages}
    assert on_pages - listed == set(), "blocks with no manifest entry for that page"
    assert listed - on_pages == set(), "manifest entries whose page lacks the block"
    for page, names in page_blocks(manifest, docblock).items():
        assert len(names) == len(set(names)), f"{page} holds a block twice"


def test_the_pages_use_one_marker_dialect(manifest):
    assert "docs/gpu-status.md" not in manifest.PAGES and "docs/performance.md" in manifest.PAGES
    for page in manifest.PAGES:
        others = OTHER_DIALECT.findall((ROOT / page).read_text())
        assert others == [], f"{page}: markers of another dialect {others}"


def test_every_entry_names_a_script_its_json_and_a_renderer_that_exist(manifest):
    for b in manifest.BLOCKS.values():
        assert (ROOT / b.script).is_file(), b
        for run in b.runs:
            assert (manifest.RESULTS / run.json).is_file(), (b.name, run.json)
        if not b.runs:  # nothing kept to render from: computed by its tool, or said why not
            assert not b.pure or (not b.reproducible and b.why), b
        if not b.reproducible:
            assert b.why, b
        if b.render:
            assert callable(manifest.renderer(b)), b.render
        else:
            assert not b.reproducible and b.why, b


def test_the_arguments_are_the_ones_the_json_records(manifest):
    """Where a run's JSON records its command, the manifest's arguments are among its words (paths of
    /tmp and UPPERCASE placeholders stand for what the run had there)."""
    for b in manifest.BLOCKS.values():
        for run in b.runs:
            data = json.loads((manifest.RESULTS / run.json).read_text())
            command = data.get("command") or data.get("meta", {}).get("command")
            if not command:
                continue
            words = set(shlex.split(command))
            loose = [w for w in shlex.split(run.args) if not (w.startswith("/tmp/") or w.isupper())]
            assert [w for w in loose if w not in words] == [], (b.name, run.json, command)


REPRODUCIBLE = [name for name, b in load_script("bench/manifest.py").BLOCKS.items() if b.pure and b.reproducible]


@pytest.mark.parametrize("name", REPRODUCIBLE)
def test_the_page_block_is_what_the_json_renders(manifest, docblock, name):
    block = manifest.BLOCKS[name]
    body = manifest.render(block)
    for page in block.pages:
        assert docblock.read_block(ROOT / page, name) == body, f"{page}: {name} differs from its JSON"


def test_a_changed_figure_or_a_hand_edit_is_caught(manifest, docblock):
    block = manifest.BLOCKS["speedmodel"]
    data = manifest.load(block)
    changed = copy.deepcopy(data)
    changed["rows"][0]["measured_seconds_per_pass"] += 0.01
    page = docblock.read_block(ROOT / "CONTRIBUTING.md", "speedmodel")
    assert manifest.renderer(block)(data) == page
    assert manifest.renderer(block)(changed) != page
    edited = (ROOT / "CONTRIBUTING.md").read_text().replace("| disk | 16 |", "| disk | 17 |", 1)
    assert docblock.read_body(edited, "speedmodel") != page


def test_blocks_are_read_and_written_in_one_form(docblock, tmp_path):
    page = tmp_path / "p.md"
    page.write_text("a\n<!-- bench:x -->\nold\n<!-- /bench:x -->\nb\n")
    docblock.write_block(page, "x", "| t |\n|---|")
    assert page.read_text() == "a\n<!-- bench:x -->\n| t |\n|---|\n<!-- /bench:x -->\nb\n"
    assert docblock.read_block(page, "x") == "| t |\n|---|"
    with pytest.raises(SystemExit, match="bench:y"):
        docblock.write_block(page, "y", "z")
    with pytest.raises(ValueError, match="unclosed"):
        docblock.block_names("<!-- bench:x -->\nx\n")
    with pytest.raises(ValueError, match="exactly one"):
        docblock.replace_block("<!-- bench:x -->\n<!-- /bench:x -->\n" * 2, "x", "y")
    assert docblock.md_table(["a", "b"], [[1, ""]]) == "| a | b |\n|---|---|\n| 1 |  |"


def test_another_dialect_is_found():
    assert OTHER_DIALECT.findall("<!-- perf:headline -->\n<!-- /plan:pair -->\n<!-- flags:begin -->") == [
        "<!-- perf:headline",
        "<!-- /plan:pair",
        "<!-- flags:begin",
    ]
    assert OTHER_DIALECT.findall("<!-- bench:x -->\n<!-- example: not run (a server) -->") == []


def test_the_acceptance_block_is_a_function_of_its_runs_json(manifest):
    """bench/accept.py's block (not reproducible on the page: its JSON was not kept) still renders from
    JSON alone: every run's command, one merged table, the T = 0 losslessness."""
    block = manifest.renderer(manifest.BLOCKS["accept"])

    def run(args: str, temperature: float, method: str, tpp: float) -> dict:
        row = dict(temperature=temperature, budget=16, method=method, tokens_per_pass=tpp, ci95=[1.0, 2.0])
        return dict(meta=dict(command=f"bench/accept.py {args}"), rows=[dict(row, lossless=True)])

    text = block([run("--budgets 16 --temperatures 0.7", 0.7, "chain", 2.5), run("--budgets 16", 0.0, "specexec", 3.0)])
    assert (
        "from `python bench/accept.py --budgets 16 --temperatures 0.7`; `python bench/accept.py --budgets 16`." in text
    )
    assert text.endswith("| 0 | 16 | 3.00 [1.00, 2.00] |  |\n| 0.7 | 16 |  | 2.50 [1.00, 2.00] |")
    assert "| T | budget | specexec | chain |" in text and "`generate`: True." in text
