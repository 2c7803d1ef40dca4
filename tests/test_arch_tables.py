"""docs/architecture.md's module tables against the modules: tools/arch_tables.py's `--check` passes
on the page, every product module is a row of exactly one `arch-` block (its folder's), and a stale
page fails: a module docstring changed in a temporary copy of the tree, a block edited by hand, a
folder with no block, a block of no folder.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, load_script

ROW = re.compile(r"^\| `([^`]+)` \| ", re.M)


@pytest.fixture(scope="module")
def arch():
    return load_script("tools/arch_tables.py")


@pytest.fixture(scope="module")
def docblock():
    return load_script("bench/docblock.py")


def rows(docblock, text: str) -> dict[str, list[str]]:
    """Each `arch-` block of a page -> the module names of its rows."""
    names = [n for n in docblock.block_names(text) if n.startswith("arch-")]
    return {n: ROW.findall(docblock.read_body(text, n)) for n in names}


def tree_copy(tmp_path: Path) -> Path:
    """The packages' .py files and the page, copied under `tmp_path`."""

    def skip(folder, names):
        return [n for n in names if n == "__pycache__" or (Path(folder, n).is_file() and not n.endswith(".py"))]

    for pkg in ("specexec_cli", "offload"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=skip)
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs/architecture.md", tmp_path / "docs/architecture.md")
    return tmp_path


def test_the_page_is_up_to_date():
    done = subprocess.run([sys.executable, "tools/arch_tables.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_product_module_is_a_row_of_exactly_one_block(arch, docblock):
    on_page = rows(docblock, (ROOT / "docs/architecture.md").read_text())
    listed = [(block, name) for block, names in on_page.items() for name in names]
    assert len(listed) == len(set(listed)), "a module listed twice in its block"
    found = [p.relative_to(ROOT) for pkg in ("specexec_cli", "offload") for p in (ROOT / pkg).rglob("*.py")]
    found = [p for p in found if "__pycache__" not in p.parts]
    modules = {(arch.block_name(p.parent), p.name) for p in found if p.name != "__init__.py"}
    inits = {(arch.block_name(p.parent), p.name) for p in found if p.name == "__init__.py"}
    assert modules - set(listed) == set(), "modules missing from their folder's block"
    assert set(listed) - modules - inits == set(), "rows that name no module of that folder"
    assert ("arch-core-methods", "__init__.py") in listed  # the method registry: a contract of its own
    assert ("arch-offload-planning", "__init__.py") not in listed  # a facade: re-exports only
    assert len(on_page) == len({p.parent for p in found}), "one block per folder"


def test_a_changed_docstring_makes_its_block_stale(arch, tmp_path):
    root = tree_copy(tmp_path)
    assert arch.stale(root) == []
    tree = root / "specexec_cli/core/tree.py"
    tree.write_text(tree.read_text().replace('"""Token-tree tensors:', '"""Token trees as tensors:', 1))
    assert arch.stale(root) == ["arch-core"]
    with pytest.raises(SystemExit, match="stale module tables: arch-core;"):
        arch.main(["--check"], root=root)
    arch.main([], root=root)
    assert arch.stale(root) == []
    assert "| `tree.py` | Token trees as tensors: node storage," in (root / arch.PAGE).read_text()


def test_a_hand_edit_a_missing_block_and_a_block_of_no_folder_are_named(arch, tmp_path):
    root = tree_copy(tmp_path)
    page = root / arch.PAGE
    text = page.read_text()
    page.write_text(text.replace("| `timing.py` | Wall time", "| `timing.py` | Time", 1))
    assert arch.stale(root) == ["arch-offload-stream"]
    page.write_text(text + "\n<!-- bench:arch-gone -->\n<!-- /bench:arch-gone -->\n")
    (root / "offload/newpart").mkdir()
    (root / "offload/newpart/thing.py").write_text('"""A thing."""\n')
    assert arch.stale(root) == ["arch-gone", "arch-offload-newpart (missing)"]
    with pytest.raises(SystemExit, match="bench:arch-offload-newpart"):
        arch.main([], root=root)


def test_the_summary_is_the_first_sentence_on_one_line(arch, tmp_path):
    cases = {
        '"""Wrapped over\ntwo lines.\n\nContract: more."""': "Wrapped over two lines",
        '"""One `x.y` thing. Second sentence."""': "One `x.y` thing",
        '"""Pipes a | b (et al. 2023)."""\nX = 1\n': "Pipes a \\| b (et al. 2023)",
    }
    for source, summary in cases.items():
        (tmp_path / "m.py").write_text(source)
        assert arch.summary(tmp_path / "m.py") == summary
    (tmp_path / "m.py").write_text("X = 1\n")
    with pytest.raises(SystemExit, match="no module docstring"):
        arch.summary(tmp_path / "m.py")
    assert arch.has_contract(tmp_path / "m.py")
    (tmp_path / "m.py").write_text('"""Facade."""\nfrom a import b\n__all__ = ["b"]\n_LAZY = {}\n')
    assert not arch.has_contract(tmp_path / "m.py")
