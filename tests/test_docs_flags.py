"""docs/flags.md is exactly what `specx <command> --help` prints (tools/gen_flags.py).

`gen_flags.main(["--check"])` renders every command's help and compares it with docs/flags.md's
`<!-- bench:flags -->` block (bench/docblock.py's one marker), without writing. A stale reference fails here;
the fix is `python tools/gen_flags.py`. The second test proves the check can fail: one command's
help text changed by a single option must be reported as out of date.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import ROOT, load_script


@pytest.fixture(scope="module")
def gen_flags():
    return load_script("tools/gen_flags.py")


@pytest.fixture(scope="module")
def helps(gen_flags):
    """Each command's rendered help, computed once (one subprocess per command)."""
    env = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), env]).rstrip(os.pathsep)
    try:
        return {cmd: gen_flags.help_text(cmd) for cmd in gen_flags.COMMANDS}
    finally:
        os.environ["PYTHONPATH"] = env


def test_flags_page_matches_help(gen_flags, helps, monkeypatch, capsys):
    assert helps["run"] and "--max-new-tokens" in helps["run"]
    monkeypatch.setattr(gen_flags, "help_text", helps.get)
    rc = gen_flags.main(["--check"])
    assert rc == 0, capsys.readouterr().out + "\nrun: python tools/gen_flags.py"


def test_check_reports_a_stale_reference(gen_flags, helps, monkeypatch, capsys):
    stale = dict(helps, run=helps["run"].replace("--max-new-tokens", "--max-tokens"))
    monkeypatch.setattr(gen_flags, "help_text", stale.get)
    assert gen_flags.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().out
