"""Resident layers spread through the stack vs a resident prefix: link busy fraction and tok/s, disk tier.

Usage: `flock /tmp/bench.lock python bench/interleave.py [--max-ram 14MB] [--rounds 3] [--prompt 1]
[--out bench/results/interleave.json]`.

The shared pair (../shared/models; target 8 layers), CPU, fp32, `--offload auto --max-ram SIZE` (the
resident layers take SIZE, the rest stream from disk with O_DIRECT), greedy, 64 new tokens. "spread"
is the plan's placement (offload/planning/memplan.resident_ids); "prefix" replaces resident_ids by
the first r layers, in this process only. Rounds alternate the two; each run's `link_busy_fraction`
(the stream's busy time over the pass wall time, mean over passes), tokens/s and stall seconds come
from its --stats-json record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))  # `offload` is the package, not bench/offload.py beside this script


def one(mode: str, args) -> dict:
    from typer.testing import CliRunner

    import offload.planning.memplan as mp
    from specexec_cli.terminal.app import app

    real = mp.resident_ids
    if mode == "prefix":
        mp.resident_ids = lambda n, r: list(range(max(0, min(r, n))))
    prompts = [json.loads(line) for line in (SHARED / "bench" / "prompts.jsonl").read_text().splitlines()]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "s.json"
            res = CliRunner().invoke(
                app,
                [
                    "run",
                    "-p",
                    prompts[args.prompt]["prompt"],
                    "--target",
                    str(SHARED / "models" / "target"),
                    "--draft",
                    str(SHARED / "models" / "draft"),
                    "--device",
                    "cpu",
                    "--dtype",
                    "fp32",
                    "--offload",
                    "auto",
                    "--max-ram",
                    args.max_ram,
                    "--max-new-tokens",
                    "64",
                    "--no-live",
                    "--temperature",
                    "0",
                    "--stats-json",
                    str(out),
                ],
            )
            if res.exit_code:
                sys.exit(f"specx run failed: {res.output[-300:]}")
            rec = json.loads(out.read_text())
    finally:
        mp.resident_ids = real
    return dict(
        mode=mode,
        placement=rec.get("offload"),
        link_busy_fraction=rec.get("link_busy_fraction"),
        tokens_per_second=rec.get("tokens_per_second"),
        stall_seconds=rec.get("stall_seconds"),
        target_passes=rec.get("target_passes"),
        token_ids=rec.get("token_ids"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-ram", default="14MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=1)
    ap.add_argument("--out", default="bench/results/interleave.json")
    args = ap.parse_args()
    runs = [one(mode, args) for _ in range(args.rounds) for mode in ("prefix", "spread")]
    summary = {}
    for mode in ("prefix", "spread"):
        rows = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            k: statistics.median(r[k] for r in rows)
            for k in ("link_busy_fraction", "tokens_per_second", "stall_seconds")
        }
        print(mode, rows[0]["placement"], summary[mode])
    same = all(r["token_ids"] == runs[0]["token_ids"] for r in runs)
    result = dict(
        command="python bench/interleave.py " + " ".join(sys.argv[1:]),
        load_average=list(os.getloadavg()),
        same_token_ids=same,
        summary=summary,
        runs=[{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
    )
    (ROOT / args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("token ids equal across runs:", same)


if __name__ == "__main__":
    main()
