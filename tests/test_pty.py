"""What a user sees in a real terminal: specx under a pty, its bytes rendered by pyte.

The rendered screen must hold exactly the text that `--no-live` writes to stdout (same greedy run),
as consecutive rows, with the live panel drawn (scroll region) and colour on — for `run` and for
`chat`. The demo pair is used; the prompt is chosen so the continuation has brackets (Rich markup
syntax) and indentation, and the tests check that it does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("pyte")
if sys.platform == "win32":  # pragma: no cover
    pytest.skip("needs a POSIX pty", allow_module_level=True)

from specexec_cli.session.names import DEMO_DIR
from tests.ptyterm import ROOT, PtyRun, find_block

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEMO_DIR / "target" / "config.json").exists(), reason="demo pair not installed"),
]

PROMPT = "def f(self):\n    return self.data["
DECODE = ["-n", "48", "--budget", "8"]
ROWS, COLS = 60, 160
DECSTBM = re.compile(rb"\x1b\[1;\d+r")  # the scroll region that keeps the panel below the text


def plain_stdout(args: list[str], stdin: str | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "specexec_cli", *args, "--no-live"],
        input=stdin,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def screen_rows(text: str) -> list[str]:
    """How `text` shows on the screen: tabs expanded, long lines wrapped at COLS, no trailing blanks."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    rows = []
    for line in (line.expandtabs(8) for line in lines):
        rows += [line[i : i + COLS].rstrip() for i in range(0, max(len(line), 1), COLS)]
    return rows


@pytest.fixture(scope="module")
def run_text() -> str:
    text = plain_stdout(["run", "-p", PROMPT, *DECODE])
    assert re.search(r"[\[\]]", text) and re.search(r"\n {4,}\S", text), f"pick another PROMPT: {text!r}"
    return text


def test_run_screen_shows_exactly_the_generated_text(run_text):
    term = PtyRun(["run", "-p", PROMPT, *DECODE], rows=ROWS, cols=COLS)
    assert term.finish() == 0, term.text()
    assert DECSTBM.search(term.raw), "the live panel was not drawn"
    assert b"\x1b[36m" in term.raw, "colour is on by default in a terminal"
    screen, want = term.lines(), screen_rows(run_text)
    at = find_block(screen, want)
    assert at >= 0, f"screen:\n{term.text()}\n--- expected rows:\n" + "\n".join(want)
    assert any("tokens/pass" in row for row in screen[at + len(want) :]), "the final panel sits below the text"
    # notices printed while the load bar is shown sit on their own rows, not in the bar's line
    assert any(row.startswith("offload: ") for row in screen), term.text()
    assert not any("loading" in row for row in screen), "the transient load bar was left on screen"


def test_no_live_summary_starts_on_its_own_line(run_text):
    term = PtyRun(["run", "-p", PROMPT, *DECODE, "--no-live", "--no-color"], rows=ROWS, cols=COLS)
    assert term.finish() == 0, term.text()
    assert b"\x1b[36m" not in term.raw
    screen, want = term.lines(), screen_rows(run_text)
    at = find_block(screen, want)
    assert at >= 0, term.text()
    assert screen[at + len(want)].startswith("specx: "), term.text()


def test_chat_screen_shows_the_reply_and_history_recalls_it(tmp_path):
    message = "def f(self):"
    reply = plain_stdout(["chat", *DECODE], stdin=message + "\n")
    term = PtyRun(["chat", *DECODE], env={"XDG_STATE_HOME": str(tmp_path)}, rows=ROWS, cols=COLS)
    term.wait_for("you>")
    term.send(message + "\r")
    term.wait_for("tokens/pass")  # the one-line summary after the reply
    term.wait_for("you>", count=2)
    screen = term.lines()
    asked = screen.index(f"you> {message}")
    want = screen_rows(reply)
    assert screen[asked + 1 : asked + 1 + len(want)] == want, term.text()
    assert "tok/s" in screen[asked + 1 + len(want)], term.text()
    assert DECSTBM.search(term.raw), "the live panel was not drawn"

    term.send("\x1b[A")  # Up recalls the last message
    term.wait_for(f"you> {message}", count=2, timeout=30)
    term.send("\x03")  # Ctrl-C at the prompt clears the line and prompts again, it does not exit
    term.wait_for("you>", count=3, timeout=30)
    term.send("\x04")  # Ctrl-D leaves
    assert term.finish() == 0, term.text()
    assert "chat: 1 turns" in term.text()
    assert message in (tmp_path / "specx" / "chat_history").read_text()
