"""The embedded demo pair: what a newcomer sees first must read as Python, and chat treats turns as code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specexec_cli.session.names import DEMO_DIR
from specexec_cli.terminal.app import app

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (DEMO_DIR / "target" / "config.json").exists(), reason="demo pair not installed")


def test_greedy_continuation_of_the_example_prompt_is_mostly_code():
    r = CliRunner().invoke(app, ["run", str(ROOT / "examples" / "prompt.txt"), "-n", "64", "--no-live"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.split("\n")
    if lines[-1] == "":
        lines.pop()
    nonblank = [line for line in lines if line.strip()]
    assert len(nonblank) >= 0.7 * len(lines), r.stdout
    assert "\n\n\n" not in r.stdout, "a run of blank lines"
    assert any(word in r.stdout for word in ("self", "def ", "return", "if ", "=")), r.stdout


def test_chat_with_the_demo_pair_continues_each_message_as_code(tmp_path):
    from transformers import AutoTokenizer

    stats = tmp_path / "turns.jsonl"
    message = "def area(width, height):"
    r = CliRunner().invoke(app, ["chat", "-n", "8", "--budget", "4", "--stats-json", str(stats)], input=message + "\n")
    assert r.exit_code == 0, r.output
    assert "each message is code" in r.stderr and "User:" not in r.stderr
    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    turn = json.loads(stats.read_text().splitlines()[0])
    # the prefill is the message and a newline, as code: no "User:/Assistant:" wrapper around it
    assert turn["prefill_tokens"] == len(tok(message + "\n")["input_ids"])
