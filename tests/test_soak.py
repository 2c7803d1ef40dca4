"""Long sessions and failing outputs: a 200-turn piped chat keeps host RSS flat (measured from
outside the process), every per-turn record carries `host_rss_bytes`, and a full disk or an
unwritable file on `/save` or `--stats-json` is one clean error while the conversation goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.conftest import make_model

ROOT = Path(__file__).resolve().parents[1]
TURNS, EARLY = 200, 20
FLAT_BYTES = 64 * 1024 * 1024
runner = CliRunner()


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """Tiny pair with room for 200 short turns (char-level tokens: ~25 per turn)."""
    root = tmp_path_factory.mktemp("soak")
    return (
        make_model(root / "t", seed=1, layers=2, max_pos=8192),
        make_model(root / "d", seed=2, layers=2, max_pos=8192),
    )


def lines_in(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def test_200_turn_piped_chat_keeps_rss_flat(long_pair, tmp_path):
    log = tmp_path / "turns.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("SPECX_DEBUG", None)
    cmd = [
        sys.executable,
        "-m",
        "specexec_cli",
        "chat",
        "--target",
        str(long_pair[0]),
        "--draft",
        str(long_pair[1]),
        "--device",
        "cpu",
        "--no-live",
        "--max-new-tokens",
        "4",
        "--budget",
        "8",
        "--offload",
        "none",
        "--stats-json",
        str(log),
    ]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True
    )
    outside = {}
    try:
        for turn in range(1, TURNS + 1):
            proc.stdin.write(f"say {turn % 10}\n")
            proc.stdin.flush()
            deadline = time.time() + 60
            while lines_in(log) < turn:  # one JSON line per finished turn
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
                time.sleep(0.005)
            if turn in (EARLY, TURNS):
                outside[turn] = psutil.Process(proc.pid).memory_info().rss
        proc.stdin.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 0, err
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert "Traceback" not in err and f"chat: {TURNS} turns" in err
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(records) == TURNS and all(r["host_rss_bytes"] > 0 for r in records)
    assert all(r["finish_reason"] != "context" for r in records)  # the context never filled up
    grew = outside[TURNS] - outside[EARLY]
    print(
        f"soak RSS (outside): turn {EARLY} {outside[EARLY] / 2**20:.1f} MiB, turn {TURNS} "
        f"{outside[TURNS] / 2**20:.1f} MiB, grew {grew / 2**20:.1f} MiB"
    )
    assert grew < FLAT_BYTES, f"RSS grew {grew / 2**20:.1f} MiB between turn {EARLY} and {TURNS}"
    inside = records[TURNS - 1]["host_rss_bytes"] - records[EARLY - 1]["host_rss_bytes"]
    assert inside < FLAT_BYTES


def chat_args(pair, *extra):
    return [
        "chat",
        "--target",
        str(pair[0]),
        "--draft",
        str(pair[1]),
        "--device",
        "cpu",
        "--no-live",
        "--max-new-tokens",
        "4",
        "--budget",
        "4",
        "--offload",
        "none",
        *extra,
    ]


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("outs")
    return make_model(root / "t", seed=1, layers=2), make_model(root / "d", seed=2, layers=2)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to simulate a full disk")
def test_save_to_full_disk_and_unwritable_file_keep_the_conversation(small_pair, tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    good = tmp_path / "conv.json"
    script = f"hello\n/save /dev/full\n/save {locked}/c.json\nagain\n/save {good}\n"
    r = runner.invoke(app, chat_args(small_pair), input=script)
    locked.chmod(0o700)
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert any("/save: cannot write /dev/full" in e and "No space left" in e for e in errors), r.stderr
    if os.geteuid() != 0:  # root ignores directory permissions
        assert any(f"{locked}/c.json" in e for e in errors), r.stderr
        assert not list(locked.iterdir())  # no half-written file left behind
    saved = json.loads(good.read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to simulate a full disk")
def test_stats_json_on_full_disk(small_pair, tmp_path):
    """run: the text is printed, then one error line and a non-zero exit; chat: every turn goes on."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):")
    r = runner.invoke(
        app,
        [
            "run",
            str(prompt),
            "--target",
            str(small_pair[0]),
            "--method",
            "ar",
            "--device",
            "cpu",
            "--no-live",
            "--max-new-tokens",
            "4",
            "--offload",
            "none",
            "--stats-json",
            "/dev/full",
        ],
    )
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert "--stats-json: cannot write /dev/full" in r.stderr and "No space left" in r.stderr
    c = runner.invoke(app, chat_args(small_pair, "--stats-json", "/dev/full"), input="one\ntwo\n")
    assert c.exit_code == 0, c.output
    assert c.stderr.count("error:") == 2 and "chat: 2 turns" in c.stderr, c.stderr
