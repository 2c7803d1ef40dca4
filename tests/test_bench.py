"""`specx bench` end to end on tiny models (CliRunner): valid results.json, PNG plots, lossless at T=0."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from typer.testing import CliRunner

from specexec_cli.terminal.app import app

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
KEYS = {
    "method",
    "budget",
    "temperature",
    "tokens_per_pass",
    "accept_histogram",
    "tokens_per_second",
    "draft_seconds",
    "target_seconds",
    "lossless",
}


@pytest.fixture()
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_bench_end_to_end(tiny_pair, tmp_path, one_thread):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):\n    return x", "a = b + c\n", "unused"])
    )
    out = tmp_path / "out"
    args = [
        "bench",
        "--target",
        str(tiny_pair[0]),
        "--draft",
        str(tiny_pair[1]),
        "--prompts",
        str(prompts),
        "--methods",
        "ar,chain,specinfer,sequoia,specexec,staged",
        "--budgets",
        "4,8",
        "--temperatures",
        "0,1",
        "--max-new-tokens",
        "6",
        "--num-prompts",
        "2",
        "--gamma",
        "2",
        "--out",
        str(out),
        "--no-live",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    records = json.loads((out / "results.json").read_text())
    assert len(records) == 6 * 2 * 2  # methods × budgets × temperatures (ar/chain repeated per budget)
    for r in records:
        assert set(r) >= KEYS
        assert r["tokens_per_pass"] >= 1.0
        assert r["lossless"] is (True if r["temperature"] == 0 else None)
    assert {r["budget"] for r in records if r["method"] == "chain"} == {4, 8}
    rows = [line for line in result.output.splitlines() if re.match(r"\s*[0-9.]+\s+\d+\*?\s+[a-z]+\s", line)]
    assert len(rows) == len(records), result.output  # the table: one row per record
    for method in ("ar", "chain", "specinfer", "sequoia", "specexec", "staged"):
        assert sum(f" {method} " in row for row in rows) == 4, method  # uncut (tests/test_bench_table.py)
    pngs = ("tokens_per_pass.png", "tokens_per_second.png")
    if importlib.util.find_spec("matplotlib") is None:  # the plots need the `plot` extra
        assert "matplotlib is missing" in result.output and not any((out / n).exists() for n in pngs)
        pytest.skip("matplotlib is not installed: results.json and the table checked, PNG plots not")
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_unknown_method(tiny_pair, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--target",
            str(tiny_pair[0]),
            "--draft",
            str(tiny_pair[1]),
            "--prompts",
            str(prompts),
            "--methods",
            "ar,nope",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 2
    assert "nope" in result.output
