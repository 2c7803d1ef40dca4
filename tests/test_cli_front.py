"""The CLI front end: start-up imports, --version, -p, help text, escaped messages, early path checks."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from specexec_cli.terminal.output import DRAFT_SGR, TextSink, use_color

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

# Runs the CLI in a fresh interpreter and reports which heavy modules it imported.
PROBE = """
import sys
from specexec_cli.terminal.app import main
sys.argv = ["specx", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code
print("HEAVY", sorted(m for m in ("torch", "transformers") if m in sys.modules), "CODE", code, file=sys.stderr)
"""


def probe(*args: str, tmp_path: Path) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CONFIG_HOME=str(tmp_path), SPECX_DEBUG="")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    return out.stdout, out.stderr


@pytest.mark.parametrize(
    "args, code",
    [
        (["--help"], 0),
        (["run", "--help"], 0),
        (["chat", "--help"], 0),
        (["--version"], 0),
        (["run", "--no-such-flag"], 2),
        (["run", "x.txt", "--max-new-tokens", "lots"], 2),
        (["run", "--stats-json", "/nonexistent-dir/s.json", "-p", "hi"], 2),
        (["run", "-p", "x", "--budget", "lots"], 2),
        (["run", "-p", "x", "--max-depth", "0"], 2),
    ],
)
def test_help_version_and_argument_errors_import_no_torch(args, code, tmp_path):
    _, err = probe(*args, tmp_path=tmp_path)
    assert f"HEAVY [] CODE {code}" in err, err


def test_version():
    from specexec_cli import __version__

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"specx {__version__}"


def test_help_is_grouped_and_free_of_type_noise():
    r = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "120"})
    assert r.exit_code == 0
    for panel in ("Models", "Decoding", "Offload", "Output"):
        assert f"─ {panel} " in r.stdout, panel
    assert "<bool>" not in r.stdout and "<str>" not in r.stdout and "{" not in r.stdout
    assert "[default: 256]" in r.stdout  # defaults are shown
    for short in ("-m ", "-md ", "-p ", "-n ", "-s "):
        assert short in r.stdout, short


def test_stats_json_into_missing_dir_fails_before_loading(tmp_path):
    # a model path that does not exist: if the path check came after loading, the error would be the model's
    r = runner.invoke(
        app,
        [
            "run",
            "-p",
            "x",
            "--target",
            str(tmp_path / "nomodel"),
            "--draft",
            str(tmp_path / "nd"),
            "--stats-json",
            str(tmp_path / "missing" / "s.json"),
        ],
    )
    assert r.exit_code == 2
    assert "missing" in r.stderr and "does not exist" in r.stderr and "nomodel" not in r.stderr


def test_chat_stats_json_and_bench_out_checked_first(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("")
    r = runner.invoke(
        app,
        ["chat", "--target", str(tmp_path / "nomodel"), "--draft", str(tmp_path / "nd"), "--stats-json", str(tmp_path)],
    )
    assert r.exit_code == 2 and "is a directory" in r.stderr
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    r = runner.invoke(
        app,
        [
            "bench",
            "--prompts",
            str(prompts),
            "--out",
            str(afile / "sub"),
            "--target",
            str(tmp_path / "nomodel"),
            "--draft",
            str(tmp_path / "nd"),
        ],
    )
    assert r.exit_code == 2 and "a_file is a file" in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["[/x].txt", "notes [v2].txt", "[bold]b[/bold].txt"])
def test_markup_like_file_names_are_reported_verbatim(name, tmp_path):
    r = runner.invoke(app, ["run", name])  # as typed: relative, and missing
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and "internal error" not in r.stderr
    assert name in r.stderr and "not found" in r.stderr, r.stderr
    if "/" in name:
        return
    (tmp_path / name).write_text("")  # now it exists but is empty: still named verbatim
    r = runner.invoke(app, ["run", str(tmp_path / name)])
    assert r.exit_code == 2 and name in r.stderr and "empty" in r.stderr, r.stderr


def test_prompt_flag_and_file_are_exclusive(tmp_path):
    (tmp_path / "p.txt").write_text("x")
    r = runner.invoke(app, ["run", str(tmp_path / "p.txt"), "-p", "y"])
    assert r.exit_code == 2 and "not both" in r.stderr
    r = runner.invoke(app, ["run"])
    assert r.exit_code == 2 and "-p" in r.stderr


def test_prompt_flag_runs(tiny_pair):
    r = runner.invoke(
        app,
        [
            "run",
            "-p",
            "def f(x):",
            "-m",
            tiny_pair[0],
            "-md",
            tiny_pair[1],
            "-n",
            "6",
            "-s",
            "1",
            "--budget",
            "4",
            "--device",
            "cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() and "tok/s" in r.stderr


def test_gen_flags_help_does_not_touch_the_flags_page():
    readme = ROOT / "docs" / "flags.md"
    before = readme.stat().st_mtime_ns, readme.read_bytes()
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_flags.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--check" in out.stdout
    assert (readme.stat().st_mtime_ns, readme.read_bytes()) == before


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_color_defaults(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color(None, FakeTTY()) and not use_color(False, FakeTTY())
    assert not use_color(True, io.StringIO())  # piped stdout never gets escape codes
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(None, FakeTTY()) and use_color(True, FakeTTY())


def test_text_sink_colours_only_the_draft_prefix_and_never_changes_text():
    from specexec_cli.core.text import TextChunk

    chunk = TextChunk("ab\ncd[/b]e")
    chunk.draft_chars = 5  # "ab\ncd" came from the draft's tree, "[/b]e" from the target
    out = io.StringIO()
    TextSink(color=True, stream=out)(chunk)
    assert out.getvalue() == f"{DRAFT_SGR}ab\x1b[0m\n{DRAFT_SGR}cd\x1b[0m[/b]e"
    plain = io.StringIO()
    sink = TextSink(color=False, stream=plain)
    sink(chunk)
    sink.end_line()
    sink("\n")  # the caller's own end-of-reply newline is the one end_line() wrote
    assert plain.getvalue() == "ab\ncd[/b]e\n"


def test_chat_save_to_a_missing_dir_is_one_clean_line(tiny_pair, tmp_path):
    r = runner.invoke(
        app,
        ["chat", "-m", tiny_pair[0], "-md", tiny_pair[1], "--device", "cpu"],
        input=f"/save {tmp_path}/missing/[v2].json\n/save {tmp_path}/ok.json\n",
    )
    assert r.exit_code == 0, r.output
    assert "error: /save: cannot write" in r.stderr and "[v2].json" in r.stderr, r.stderr
    assert json.loads((tmp_path / "ok.json").read_text())["schema"] == "specx-chat"
