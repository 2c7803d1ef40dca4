"""Regenerate docs/architecture.md's module tables from the modules' own docstrings.

Contract: every folder of `specexec_cli/` and `offload/` that holds a .py module has one block
`<!-- bench:arch-FOLDER -->` on docs/architecture.md (written by bench/docblock.py): FOLDER is the
folder's path without the leading `specexec_cli/`, `/` spelled `-` (`core`, `core-methods`,
`offload-stream`; the two package roots are `specexec_cli` and `offload`). Its body is a
`| module | responsibility |` table of the folder's modules, sorted by name, each with its summary:
the docstring's first sentence (its first paragraph up to a period followed by a capital or a
backtick), on one line, without the trailing period, inline code as written. An `__init__.py` is
listed only when it defines a public function, class or constant of its own (a registry, a reader
list), not when it only describes its package or re-exports. A module without a docstring is an
error. Nothing is imported: the docstrings are read with `ast`.
`python tools/arch_tables.py` writes every block; `--check` writes nothing and exits 1 naming the
blocks that are stale, missing from the page, or on the page for no folder.
tests/test_arch_tables.py holds the page to it.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = Path("docs/architecture.md")
PACKAGES = ("specexec_cli", "offload")
PREFIX = "arch-"
sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
from docblock import block_names, md_table, read_body, replace_block  # noqa: E402  (bench/docblock.py)

SENTENCE_END = re.compile(r"\.\s+(?=[A-Z`])")


def folders(root: Path = ROOT) -> list[Path]:
    """Every product folder holding a .py module, relative to `root`, sorted."""
    found = {p.parent.relative_to(root) for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    return sorted(f for f in found if "__pycache__" not in f.parts)


def block_name(folder: Path) -> str:
    """The block of `folder`: `arch-core`, `arch-core-methods`, `arch-offload-stream`, `arch-specexec_cli`."""
    parts = folder.parts[1:] if folder.parts[0] == "specexec_cli" and len(folder.parts) > 1 else folder.parts
    return PREFIX + "-".join(parts)


def summary(path: Path) -> str:
    """The first sentence of `path`'s module docstring, on one line, without its trailing period."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise SystemExit(f"{path}: no module docstring; its first line states the module's contract")
    paragraph = " ".join(doc.split("\n\n")[0].split())
    end = SENTENCE_END.search(paragraph)
    sentence = paragraph[: end.start()] if end else paragraph.removesuffix(".")
    return sentence.replace("|", "\\|")


def _public(target: ast.expr) -> bool:
    return isinstance(target, ast.Name) and not target.id.startswith("_")


def has_contract(init: Path) -> bool:
    """Whether a package's `__init__.py` defines a public function, class or constant of its own."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            return True
        if isinstance(node, ast.Assign) and any(_public(t) for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and _public(node.target):
            return True
    return False


def modules(folder: Path, root: Path = ROOT) -> list[Path]:
    """The modules `folder`'s table lists, sorted by name."""
    found = sorted((root / folder).glob("*.py"))
    return [p for p in found if p.name != "__init__.py" or has_contract(p)]


def table(folder: Path, root: Path = ROOT) -> str:
    """The body of `folder`'s block."""
    return md_table(["module", "responsibility"], [(f"`{p.name}`", summary(p)) for p in modules(folder, root)])


def bodies(root: Path = ROOT) -> dict[str, str]:
    """Every block's name -> its body, in folder order."""
    return {block_name(f): table(f, root) for f in folders(root)}


def stale(root: Path = ROOT) -> list[str]:
    """The blocks whose page text is not what the docstrings make, missing ones and ones of no folder."""
    text = (root / PAGE).read_text()
    on_page = [n for n in block_names(text) if n.startswith(PREFIX)]
    wanted = bodies(root)
    bad = [n for n in on_page if n not in wanted]
    for name, body in wanted.items():
        if name not in on_page:
            bad.append(f"{name} (missing)")
        elif read_body(text, name) != body:
            bad.append(name)
    return bad


def write(root: Path = ROOT) -> None:
    """Write every block into the page; exit with one line naming a block the page lacks."""
    text = (root / PAGE).read_text()
    for name, body in bodies(root).items():
        try:
            text = replace_block(text, name, body)
        except ValueError as exc:
            raise SystemExit(f"{PAGE}: {exc}; add the block where the folder's table belongs") from None
    (root / PAGE).write_text(text)


def main(argv: list[str] | None = None, root: Path = ROOT) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the stale blocks")
    args = parser.parse_args(argv)
    if not args.check:
        write(root)
    elif bad := stale(root):
        raise SystemExit(f"{PAGE}: stale module tables: {', '.join(bad)}; run python tools/arch_tables.py")


if __name__ == "__main__":
    main()
