"""Regenerate the flags reference, docs/flags.md, from `specx <command> --help`.

Contract: replaces the block `<!-- bench:flags -->` ... `<!-- /bench:flags -->` on the page
bench/manifest.py lists for it (docs/flags.md) with `reference()`: one fenced block per command of
the typer app, in the order the app declares them. Run after changing any option: `python tools/gen_flags.py`; `--check` only reports
(exit 1) when the page is out of date, and `--help` prints usage without touching anything.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
import manifest  # noqa: E402  (bench/manifest.py)
from docblock import replace_block  # noqa: E402  (bench/docblock.py)

NAME = "flags"


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


def reference() -> str:
    """The block's body: every command's `--help` as a fenced block under its heading."""
    blocks = []
    for command in COMMANDS:
        text = help_text(command)
        if text is not None:
            blocks.append(f"### `specx {command}`\n\n```text\n{text}\n```\n")
    return "\n".join(blocks).removesuffix("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Regenerate the flags reference in docs/flags.md from `specx <command> --help`."
    )
    parser.add_argument("--check", action="store_true", help="only check: exit 1 if docs/flags.md is out of date")
    args = parser.parse_args(argv)
    body = reference()
    stale = []
    for page in manifest.BLOCKS[NAME].pages:
        text = (ROOT / page).read_text()
        try:
            new = replace_block(text, NAME, body)
        except ValueError as exc:
            print(f"{page}: {exc}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(page)
            if not args.check:
                (ROOT / page).write_text(new)
    if args.check:
        print(
            "the flags reference is up to date"
            if not stale
            else f"{', '.join(stale)} is out of date; run python tools/gen_flags.py"
        )
        return int(bool(stale))
    print(f"updated {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
