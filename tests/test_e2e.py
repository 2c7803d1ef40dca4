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
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    stats = tmp_path / "stats.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [str(env_dir / "bin" / "specx"), "run", str(ROOT / "examples" / "prompt.txt"), "--max-new-tokens", "32",
         "--stats-json", str(stats)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip(), "no generated text on stdout"
    assert "demo pair" in run.stderr
    rec = json.loads(stats.read_text())
    assert rec["new_tokens"] > 0
    # the draft's tokens are accepted (speculation runs). How many per pass is the budget tuner's
    # timing-driven choice on this machine (tests/test_budget.py): on two loaded cores it sometimes
    # settles on budget 1 (~1.35 tokens/pass), so a higher bar here was flaky, at d51eef8 as well.
    assert rec["tokens_per_pass"] > 1.0 and rec["accept_histogram"].keys() - {"1"}, rec
