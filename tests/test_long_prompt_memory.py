"""Long prompts on this CPU: peak memory beyond a short run stays within the plan's terms.

A tiny pair with a 16k window (a 2-layer target, a 1-layer draft, character tokens) runs `specx run`
with a ~12k-token prompt at --ctx 16384, and `specx chat` with a ~6k-token first turn and a second
turn over that cache. Each run is its own process, started by a wrapper that reports the child's
peak RSS (getrusage RUSAGE_CHILDREN: ru_maxrss, kB on Linux). The extra peak over the same command
with a short prompt must stay within 1.25 x (activations + kv_target + kv_draft) of the plan that
`--dry-run --stats-json` prints for the same flags; every run exits 0. Under a folded additive mask
(G = 2: 2 x T x S x 4 bytes, 1.1 GB at T = S = 12k) or eager scores (4 heads x T x S x 4: 2.3 GB)
the bound fails. A prompt longer than --ctx and a --ctx beyond the window are one line, exit 2.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tests.conftest import make_model

pytestmark = pytest.mark.slow
SPECX = [sys.executable, "-c", "from specexec_cli.terminal.app import main; main()"]
LETTERS = "abcdefghijklmnopqrstuvwxyz .,"
WRAPPER = (
    "import resource, subprocess, sys\n"
    "r = subprocess.run(sys.argv[1:], stdin=sys.stdin, capture_output=True, text=True)\n"
    "sys.stderr.write(r.stderr)\n"
    "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    return (
        make_model(root / "t", seed=1, layers=2, max_pos=16384),
        make_model(root / "d", seed=2, layers=1, max_pos=16384),
        root,
    )


def _flags(pair, ctx: int = 16384) -> list[str]:
    return [
        "--target",
        str(pair[0]),
        "--draft",
        str(pair[1]),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--ctx",
        str(ctx),
        "--max-new-tokens",
        "8",
    ]


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(LETTERS) for _ in range(n))


def _peak(args: list[str], stdin: str = "") -> int:
    """Peak RSS in bytes of `args` run as a child; asserts it exited 0."""
    res = subprocess.run(
        [sys.executable, "-c", WRAPPER, *args], input=stdin, capture_output=True, text=True, timeout=600
    )
    code, kb = res.stdout.split()[-2:]
    assert code == "0", res.stderr[-500:]
    return int(kb) * 1024


def _planned(pair) -> int:
    path = pair[2] / "plan.json"
    res = subprocess.run(
        SPECX + ["run", "-p", "x", *_flags(pair), "--dry-run", "--stats-json", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    dev = json.loads(path.read_text())["plan"]["device_bytes"]
    return dev["activations"] + dev["kv_target"] + dev["kv_draft"]


def test_long_prefill_and_chat_turn_within_plan(pair):
    planned = _planned(pair)
    prompt = pair[2] / "long.txt"
    prompt.write_text(_text(12000, 0))
    short = _peak(SPECX + ["run", "-p", "def f(x):", "--no-live", *_flags(pair)])
    long = _peak(SPECX + ["run", str(prompt), "--no-live", *_flags(pair)])
    assert long - short <= 1.25 * planned, (long, short, planned)
    chat_short = _peak(SPECX + ["chat", *_flags(pair)], "def f(x):\nclass a:\n")
    chat_long = _peak(SPECX + ["chat", *_flags(pair)], _text(6000, 1) + "\nclass a:\n")
    assert chat_long - chat_short <= 1.25 * planned, (chat_long, chat_short, planned)


def test_prompt_longer_than_ctx_and_ctx_beyond_window_are_one_line(pair):
    prompt = pair[2] / "over.txt"
    prompt.write_text(_text(3000, 2))
    res = subprocess.run(
        SPECX + ["run", str(prompt), "--no-live", *_flags(pair, ctx=2048)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "3000 tokens" in res.stderr and "2048" in res.stderr
    res = subprocess.run(
        SPECX + ["run", "-p", "x", "--no-live", *_flags(pair, ctx=20000)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: --ctx 20000 is beyond the --target model's window of 16384 positions (max_position_embeddings "
        "in its config.json); fix: --ctx 16384 or less"
    ], res.stderr
