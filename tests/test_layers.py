"""The package keeps its layers: `lint-imports` (import-linter) finds every contract of
pyproject.toml KEPT, and the display libraries stay in the terminal front end.

pyproject's `[tool.importlinter]` states the layers (terminal > serve > tools > session > core >
errors; `offload` never imports specexec_cli; offload's own groups planning > selfdraft > stream >
quant > formats > arch; docs/architecture.md explains them). Here
`lint-imports` runs on the real tree and must report every contract kept, and on a contract that
inverts two layers it must report one broken, so the check can fail. specexec_cli reaches offload
through `offload` and three facades only (the fourth contract); here every name it imports from
them must be in the facade's `__all__`, and every such name must resolve. Two rules import-linter does
not state are checked by reading every module's imports (function-level ones too): rich is imported
only by terminal/display.py and terminal/candidates.py (the dry run's tables), typer only by terminal/app.py and terminal/flags.py.
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.conftest import ROOT

CONTRACTS = [
    c["name"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
]


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    exe = str(exe) if exe.exists() else shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[test]' (import-linter)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run(
        [exe, "--no-cache", "--no-logo", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def test_every_import_linter_contract_is_kept():
    assert len(CONTRACTS) == 4
    r = lint_imports()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    for name in CONTRACTS:
        assert f"{name} KEPT" in r.stdout, r.stdout[-3000:]
    assert "4 kept, 0 broken" in r.stdout


def test_an_inverted_layer_is_reported_broken(tmp_path):
    cfg = tmp_path / "inverted.toml"
    cfg.write_text(
        '[tool.importlinter]\nroot_packages = ["specexec_cli"]\n\n[[tool.importlinter.contracts]]\n'
        'name = "core over terminal (false)"\ntype = "layers"\n'
        'layers = ["specexec_cli.core", "specexec_cli.terminal"]\n'
    )
    r = lint_imports(str(cfg))
    assert r.returncode != 0 and "core over terminal (false) BROKEN" in r.stdout, r.stdout[-3000:] + r.stderr


def importers(package: Path, library: str) -> set[str]:
    """Modules under `package` (paths relative to ROOT) that import `library`, at any depth of the code."""
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            )
            if any(n == library or n.startswith(library + ".") for n in names):
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_rich_is_imported_only_by_the_display():
    # the display, and the dry run's candidate tables it renders (split out of display.py for size)
    assert importers(ROOT / "specexec_cli", "rich") == {
        "specexec_cli/terminal/display.py",
        "specexec_cli/terminal/candidates.py",
    }
    assert importers(ROOT / "offload", "rich") == set()


def test_typer_is_imported_only_by_the_app_and_its_flags():
    assert importers(ROOT / "specexec_cli", "typer") == {
        "specexec_cli/terminal/app.py",
        "specexec_cli/terminal/flags.py",
    }
    assert importers(ROOT / "offload", "typer") == set()


def test_the_import_scan_sees_imports_inside_functions(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from rich.console import Console\n    return Console\n")
    (pkg / "b.py").write_text("import richer\nfrom . import rich\n")  # neither is the rich library
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert importers(pkg, "rich") == {"pkg/a.py"}


FACADES = ("offload", "offload.formats", "offload.planning", "offload.selfdraft")


def offload_imports(package: Path) -> dict[str, set[str]]:
    """{offload module: names imported from it} over every module under `package` (functions too)."""
    found: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "offload" or a.name.startswith("offload."):
                        found.setdefault(a.name, set())
            elif (
                isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "offload"
            ):
                found.setdefault(node.module or "", set()).update(a.name for a in node.names)
    return found


def test_specexec_cli_imports_only_the_public_names_of_offloads_facades():
    used = offload_imports(ROOT / "specexec_cli")
    assert set(used) <= set(FACADES), sorted(set(used) - set(FACADES))
    for facade, names in used.items():
        public = importlib.import_module(facade).__all__
        assert names <= set(public), (facade, sorted(names - set(public)))
    for facade in FACADES:
        module = importlib.import_module(facade)
        for name in module.__all__:
            assert getattr(module, name) is not None, (facade, name)


def test_a_lazy_facade_name_is_looked_up_in_its_module_at_each_use(monkeypatch):
    import offload
    import offload.quant.quant_cache as qc
    from offload import formats

    monkeypatch.setattr(qc, "write_quantized", marker := object())
    assert offload.write_quantized is marker  # a test patching the module patches what callers get
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        formats.missing  # noqa: B018
