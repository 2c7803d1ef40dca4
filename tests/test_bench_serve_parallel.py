"""bench/serve_parallel.py on a tiny model: any target but the trained pair runs chat prompts with
plain decoding, and `auto` in --parallel-list runs the --parallel `specx serve` resolves without the
flag (scheduler.parallel_fit), with auto's tokens/s over the best explicit one's per round."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


def test_auto_row_runs_the_servers_default_parallel(tiny_pair, tmp_path):
    from specexec_cli.serve.scheduler import DEFAULT_PARALLEL

    mod = load_script("bench/serve_parallel.py")
    out = tmp_path / "p.json"
    mod.main(
        [
            "--target",
            str(tiny_pair[0]),
            "--concurrency",
            "2",
            "--parallel-list",
            "1,auto",
            "--max-new-tokens",
            "3",
            "--out",
            str(out),
        ]
    )
    record = json.loads(out.read_text())
    assert record["method"] == "ar" and record["prompts"].startswith("bench/prompts_chat.jsonl")
    assert record["parallel_auto"] == DEFAULT_PARALLEL  # a tiny model's plan fits every default sequence
    (row,) = record["rows"]
    one, auto = row["by_parallel"]
    assert one["parallel"] == 1 and auto["parallel"] == "auto" and auto["resolved"] == DEFAULT_PARALLEL
    assert auto["runs"][0]["parallel"] == DEFAULT_PARALLEL and auto["same_text"] is True
    assert all(run["completion_tokens"] == 2 * 3 for b in row["by_parallel"] for run in b["runs"])
    vs = row["auto_over_best"]
    assert vs["best_parallel"] == [1]  # the only explicit one
    assert vs["per_round"] == [round(auto["runs"][0]["tokens_per_s"] / one["runs"][0]["tokens_per_s"], 3)]
    assert f"| 2 | auto (= {DEFAULT_PARALLEL}) |" in mod.table(record)


def test_parallel_list_and_old_tables():
    mod = load_script("bench/serve_parallel.py")
    assert mod.parallels("8,2,auto,4", 4) == [1, 2, 4, "auto"]
    with pytest.raises(SystemExit, match="--parallel-list: 'x'"):
        mod.parallels("2,x", 4)
    run = dict(wall_s=1.0, tokens_per_s=8.0, ttft_s=[0.5], target_passes=4, texts=["a"])
    by = [dict(parallel=p, runs=[run], ratio=1.0, same_text=True) for p in (1, 2)]
    old = dict(rows=[dict(concurrency=2, longest_share=0.5, by_parallel=by)])
    assert "auto" not in mod.table(old)  # a result without auto keeps its columns
