"""Every help string of `specx` renders as written: rich markup never eats a bracketed part.

typer renders help through rich, which reads `pip install -e '.[lowbit]'` as markup and shows
`pip install -e '.'` unless the bracket is escaped. A help text that means a literal `[` writes it escaped (`\\[`). Here every
declared help text (the app's, each command's, each option's and argument's), with `\\[` read as
`[`, must appear verbatim in that command's `--help`, rendered wide enough that nothing wraps.
The last test proves the check fails on an unescaped bracket.
"""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from specexec_cli.terminal.app import app

WIDE = {"COLUMNS": "2000", "TERMINAL_WIDTH": "2000", "NO_COLOR": "1"}


def literal(help_text: str) -> str:
    """What a help text says once rendered: `\\[` is rich's escape for a literal `[`."""
    return " ".join(help_text.replace("\\[", "[").split())


def declared(command) -> list[str]:
    """The command's own help text and every parameter's, as declared."""
    texts = [(command.help or "").split("\n\n")[0]]
    texts += [p.help for p in command.params if getattr(p, "help", None)]
    return [t for t in texts if t.strip()]


def missing(typer_app: typer.Typer, args: list[str], command) -> list[str]:
    """Declared help texts of `command` that `typer_app <args> --help` does not show verbatim."""
    r = CliRunner().invoke(typer_app, [*args, "--help"], env=WIDE)
    assert r.exit_code == 0, r.output
    shown = " ".join(r.output.replace("│", " ").split())
    return [t for t in map(literal, declared(command)) if t not in shown]


COMMANDS = list(typer.main.get_command(app).commands)


def test_the_command_list_is_complete():
    assert {"run", "chat", "serve", "profile", "bench", "quantize"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_help_string_renders_as_written(name):
    group = typer.main.get_command(app)
    assert missing(app, [name], group.commands[name]) == []


def test_the_app_help_renders_as_written():
    group = typer.main.get_command(app)
    r = CliRunner().invoke(app, ["--help"], env=WIDE)
    assert r.exit_code == 0 and literal(group.help) in " ".join(r.output.replace("│", " ").split())


def test_the_lowbit_extra_is_shown_with_its_brackets():
    r = CliRunner().invoke(app, ["run", "--help"], env=WIDE)
    assert "pip install -e '.[lowbit]'" in r.output


def test_an_unescaped_bracket_is_caught():
    demo = typer.Typer(add_completion=False)

    @demo.command()
    def go(
        x: int = typer.Option(0, help="Unescaped: pip install -e '.[lowbit]'."),
        y: int = typer.Option(0, help="Escaped: pip install -e '.\\[lowbit]'."),
    ) -> None:
        """Demo."""

    @demo.command()
    def other() -> None:
        """Other."""

    cmd = typer.main.get_command(demo).commands["go"]
    assert missing(demo, ["go"], cmd) == ["Unescaped: pip install -e '.[lowbit]'."]
