"""Regenerate the flags reference, docs/flags.md, from `specx <command> --help`.

Contract: replaces the text between `<!-- flags:begin -->` and `<!-- flags:end -->` in docs/flags.md
with one fenced block per command of the typer app, in the order the app declares them. Run after changing any option: `python tools/gen_flags.py`; `--check` only reports
(exit 1) when the page is out of date, and `--help` prints usage without touching anything.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/flags.md"
BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"


def commands() -> list[str]:
    """The app's commands, in declaration order (imports the app, not torch)."""
    sys.path.insert(0, str(ROOT))
    import typer

    from specexec_cli.terminal.app import app

    return list(typer.main.get_command(app).commands)


COMMANDS = commands()


def help_text(command: str) -> str | None:
    env = dict(os.environ, COLUMNS="110", TERM="dumb", NO_COLOR="1", _TYPER_FORCE_DISABLE_TERMINAL="1")
    out = subprocess.run(
        [sys.executable, "-m", "specexec_cli", command, "--help"], capture_output=True, text=True, env=env, cwd=ROOT
    )
    if out.returncode != 0:
        return None
    lines = (line.rstrip() for line in out.stdout.strip().splitlines())
    return "\n".join(lines).replace("python -m specexec_cli", "specx")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Regenerate the flags reference in docs/flags.md from `specx <command> --help`."
    )
    parser.add_argument("--check", action="store_true", help="only check: exit 1 if docs/flags.md is out of date")
    args = parser.parse_args(argv)
    blocks = []
    for command in COMMANDS:
        text = help_text(command)
        if text is not None:
            blocks.append(f"### `specx {command}`\n\n```text\n{text}\n```\n")
    page = ROOT / PAGE
    body = page.read_text()
    if BEGIN not in body:
        print(f"{PAGE} has no {BEGIN} marker", file=sys.stderr)
        return 2
    new = re.sub(
        f"{re.escape(BEGIN)}.*?{re.escape(END)}", lambda _: f"{BEGIN}\n" + "\n".join(blocks) + END, body, flags=re.S
    )
    if args.check:
        print(f"{PAGE} is up to date" if new == body else f"{PAGE} is out of date; run python tools/gen_flags.py")
        return 0 if new == body else 1
    page.write_text(new)
    print(f"updated {len(blocks)} command(s) in {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
