"""End to end: install specx into a fresh venv and run the embedded demo pair, as a newcomer would."""

from __future__ import annotations

import json
import os
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fresh_venv_install_and_demo_run(tmp_path):
    if not (ROOT / "specexec_cli" / "demo" / "target" / "config.json").exists():
        pytest.fail("the embedded demo pair is missing from specexec_cli/demo")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    # the README's install step, from a copy so the checkout is untouched (non-editable install)
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "torch==2.13.0", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    stats = tmp_path / "stats.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [
            str(env_dir / "bin" / "specx"),
            "run",
            str(ROOT / "examples" / "prompt.txt"),
            "--max-new-tokens",
            "32",
            "--stats-json",
            str(stats),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip(), "no generated text on stdout"
    assert "demo pair" in run.stderr
    rec = json.loads(stats.read_text())
    assert rec["new_tokens"] > 0
    # the draft's tokens are accepted (speculation runs). How many per pass is the budget tuner's
    # timing-driven choice on this machine (tests/test_budget.py): on two loaded cores it sometimes
    # settles on budget 1 (~1.35 tokens/pass), so a higher bar here was flaky, at d51eef8 as well.
    assert rec["tokens_per_pass"] > 1.0 and rec["accept_histogram"].keys() - {"1"}, rec


def test_no_draft_flag_drafts_with_the_plans_choice_and_matches_ar(shared_pair, tmp_path):
    """`specx run -p ... --target T --offload disk --max-ram 0` with no --draft: a streamed target gets the
    draft the plan models fastest (named in one stderr line), and at T = 0 the text equals --method ar's."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    common = [
        "run",
        "-p",
        "def fib(n):",
        "--target",
        str(shared_pair[0]),
        "--offload",
        "disk",
        "--max-ram",
        "0",
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        "--budget",
        "16",
        "--no-live",
    ]
    out = {}
    for name, extra in (("auto", []), ("ar", ["--method", "ar"])):
        stats = tmp_path / f"{name}.json"
        res = CliRunner().invoke(app, common + extra + ["--stats-json", str(stats)])
        assert res.exit_code == 0, res.output
        out[name] = (res, json.loads(stats.read_text()))
    res, rec = out["auto"]
    chosen = [line for line in res.stderr.splitlines() if line.startswith("--draft auto:")]
    assert len(chosen) == 1 and "the self-draft at" in chosen[0] and "bits" in chosen[0], res.stderr
    assert rec["method"] == "specexec" and rec["tokens_per_pass"] > 1.0
    assert res.stdout == out["ar"][0].stdout and rec["token_ids"] == out["ar"][1]["token_ids"]


def test_no_draft_flag_with_everything_resident_weighs_the_layer_skip_draft(shared_pair, tmp_path):
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    res = CliRunner().invoke(
        app,
        [
            "run",
            "-p",
            "def f():",
            "--target",
            str(shared_pair[0]),
            "--offload",
            "none",
            "--temperature",
            "0",
            "--max-new-tokens",
            "4",
            "--no-live",
        ],
    )
    assert res.exit_code == 0, res.output
    chosen = [line for line in res.stderr.splitlines() if line.startswith("--draft auto:")]
    assert len(chosen) == 1 and (
        "the layer-skip self-draft" in chosen[0] or "plain decoding is modelled faster" in chosen[0]
    )
