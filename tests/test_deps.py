"""Optional dependencies (specexec_cli/session/deps.py): a run that lacks one is refused before loading,
`--draft auto` skips the candidates it cannot build, and no summary is printed for a failed run.

The end-to-end checks run `specx` in a subprocess where the package is hidden the way a fresh venv
without the extra lacks it (`sys.modules[name] = None`: every import of it fails), on the embedded
demo target streamed from disk.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import tomllib

from specexec_cli.session import deps
from specexec_cli.session.options import require_for_run
from tests.conftest import ROOT

DEMO = ROOT / "specexec_cli" / "demo" / "target"
PROMPT = ROOT / "examples" / "prompt.txt"


def specx_without(hidden: list[str], *args, tmp_path) -> subprocess.CompletedProcess:
    """`specx ARGS` in a fresh interpreter in which each of `hidden` cannot be imported."""
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{m!r}] = None\n" for m in hidden)
        + "from specexec_cli.terminal.app import main\nsys.argv = ['specx'] + sys.argv[1:]\nmain()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )


STREAMED_NF4 = [
    "run",
    PROMPT,
    "--target",
    DEMO,
    "--dtype",
    "nf4",
    "--offload",
    "disk",
    "--device",
    "cpu",
    "--max-new-tokens",
    "24",
    "--temperature",
    "0",
    "--no-live",
]


@pytest.mark.slow
def test_no_draft_without_hqq_runs_like_ar(tmp_path):
    """The issue's must-hold: a streamed nf4 target, no --draft, hqq missing -> exit 0, --method ar's text."""
    auto = specx_without(["hqq"], *STREAMED_NF4, tmp_path=tmp_path)
    assert auto.returncode == 0, auto.stderr
    ar = specx_without(["hqq"], *STREAMED_NF4, "--method", "ar", tmp_path=tmp_path)
    assert ar.returncode == 0, ar.stderr
    assert auto.stdout == ar.stdout and auto.stdout.strip()
    line = next(x for x in auto.stderr.splitlines() if x.startswith("--draft auto"))
    assert "skipped 3-bit and 2-bit" in line and "pip install -e '.[lowbit]'" in line, line
    assert "Traceback" not in auto.stderr


@pytest.mark.slow
def test_no_draft_without_hqq_on_a_16bit_target_runs_like_ar(tmp_path):
    """A 16-bit streamed target keeps the 4-bit self-draft (bitsandbytes) as a candidate; the output is ar's."""
    fp32 = [a if a != "nf4" else "fp32" for a in STREAMED_NF4]
    auto = specx_without(["hqq"], *fp32, tmp_path=tmp_path)
    ar = specx_without(["hqq"], *fp32, "--method", "ar", tmp_path=tmp_path)
    assert auto.returncode == ar.returncode == 0, auto.stderr
    assert auto.stdout == ar.stdout and auto.stdout.strip()
    line = next(x for x in auto.stderr.splitlines() if x.startswith("--draft auto"))
    assert "3-bit" not in line.split("skipped")[0] and "2-bit" not in line.split("skipped")[0], line


@pytest.mark.slow
def test_explicit_lowbit_without_hqq_is_refused_before_loading(tmp_path):
    for extra in (["--draft", "self", "--draft-bits", "3"], ["--draft", "self"]):
        r = specx_without(["hqq"], *STREAMED_NF4, *extra, tmp_path=tmp_path)
        assert r.returncode == 2, (extra, r.stderr)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert lines[-1].startswith("error: ") and "hqq" in lines[-1] and "pip install -e '.[lowbit]'" in lines[-1]
        assert not any(x.startswith(("offload:", "specx:")) for x in lines), lines  # nothing loaded, no summary
        assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_4bit_substitutes_of_an_nf4_target_name_the_fixes_that_work(tmp_path):
    r = specx_without(["hqq"], *STREAMED_NF4, "--draft", "self", "--draft-bits", "4", tmp_path=tmp_path)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "already 4-bit" in last and "they need hqq: pip install -e '.[lowbit]'" in last and "--dtype bf16" in last
    fixed = [a if a != "nf4" else "fp32" for a in STREAMED_NF4]  # the 16-bit route the line names
    r = specx_without(["hqq"], *fixed, "--draft", "self", "--draft-bits", "4", tmp_path=tmp_path)
    ar = specx_without(["hqq"], *fixed, "--method", "ar", tmp_path=tmp_path)
    assert r.returncode == ar.returncode == 0, r.stderr
    assert r.stdout == ar.stdout


@pytest.mark.slow
def test_nf4_without_bitsandbytes_is_refused_before_loading(tmp_path):
    r = specx_without(["bitsandbytes"], *STREAMED_NF4, "--method", "ar", tmp_path=tmp_path)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --dtype nf4 needs bitsandbytes") and "pip install 'bitsandbytes>=" in last


def test_hidden_module_counts_as_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "hqq", None)
    assert not deps.installed("hqq") and not deps.usable_bits(3) and not deps.usable_bits(2)
    assert deps.installed("torch")


def test_gguf_target_without_gguf_is_refused(monkeypatch, tmp_path):
    from specexec_cli.session.loading import LoadOptions

    monkeypatch.setattr(deps, "installed", lambda m: m != "gguf")
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setattr("specexec_cli.session.loading.is_gguf", lambda p: str(p).endswith(".gguf"))
    with pytest.raises(deps.SpecxError, match=r"--target .*m\.gguf: a GGUF checkpoint needs gguf.*\.\[gguf\]"):
        require_for_run(LoadOptions(target=str(path), draft=None))


def test_prequantized_checkpoint_without_bitsandbytes_is_refused(monkeypatch, tmp_path):
    import json

    from specexec_cli.session.loading import LoadOptions

    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}
        )
    )
    monkeypatch.setattr(deps, "installed", lambda m: m != "bitsandbytes")
    with pytest.raises(
        deps.SpecxError, match=r"--target .*: a pre-quantized bitsandbytes checkpoint needs bitsandbytes"
    ):
        require_for_run(LoadOptions(target=str(tmp_path), draft=None))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    require_for_run(LoadOptions(target=str(tmp_path), draft=None))  # a 16-bit one needs nothing optional


def test_version_ranges_match_pyproject():
    """The hints name the tested ranges, which pyproject.toml declares."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for spec in meta["dependencies"] + [s for v in meta["optional-dependencies"].values() for s in v]:
        name, rng = re.match(r"([A-Za-z0-9_-]+)(.*)", spec).groups()
        declared.setdefault(name, rng.replace(" ", ""))
    for module, (extra, rng, _) in deps.OPTIONAL.items():
        assert declared[module] == rng, module
        if extra is not None:
            assert any(s.startswith(module) for s in meta["optional-dependencies"][extra]), (module, extra)


def test_no_summary_for_a_failed_or_empty_run(capsys):
    from specexec_cli.core.stats import RunStats
    from specexec_cli.terminal.display import LiveView

    stats = RunStats(config={"method": "ar"})
    with LiveView(False) as view:
        view.update(stats)
    assert "tokens in" not in capsys.readouterr().err  # nothing produced: no line
    stats.token_ids.append(5)
    with pytest.raises(RuntimeError), LiveView(False) as view:
        view.update(stats)
        raise RuntimeError("boom")
    assert "tokens in" not in capsys.readouterr().err  # failed: the error stands alone
    with LiveView(False) as view:
        view.update(stats)
    assert "specx: 1 tokens in" in capsys.readouterr().err  # the control: a run that produced a token
