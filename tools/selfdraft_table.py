"""The trained pair's self-draft table (CONTRIBUTING.md `<!-- bench:selfdraft -->`, written by
tools/perf_tables.py) from bench/selfdraft.py's JSON results.

Contract: `rows(runs)` takes the loaded JSON of the runs bench/manifest.py lists for the block
(`selfdraft_t0_gap*.json` and `selfdraft_t07_gap*.json` of bench/results/: gap-featured node scores,
128 new tokens, the 8-layer target streamed from disk), keeps the drafts of `NAMES` and sorts them by
temperature, budget and draft; `table(runs)` is the markdown table. "x 2.9M draft" divides
by the 2.9M-parameter draft's (`shared-2.9M`) tokens per pass in the same (temperature, budget) cell;
"equals `--method ar`" is the run's own check (T = 0 only).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
from docblock import md_table  # noqa: E402  (bench/docblock.py)

NAMES = {
    "shared-2.9M": "2.9M-parameter draft",
    "self-nf4": "`--draft self --draft-bits 4` (nf4)",
    "self-nf4-ownkv": "nf4, own KV cache (not a mode)",
    "self-hqq3": "`--draft self --draft-bits 3` (HQQ)",
    "self-hqq2": "`--draft self --draft-bits 2` (HQQ)",
}


def rows(runs: list[dict]) -> list[dict]:
    out = [r for run in runs for r in run["rows"] if r["draft"] in NAMES]
    order = list(NAMES)
    return sorted(out, key=lambda r: (r["temperature"], r["budget"], order.index(r["draft"])))


def table(runs: list[dict]) -> str:
    rs = rows(runs)
    base = {(r["temperature"], r["budget"]): r["tokens_per_pass"] for r in rs if r["draft"] == "shared-2.9M"}
    lines = []
    for r in rs:
        b = base.get((r["temperature"], r["budget"]))
        lo, hi = r["ci95"]
        same = "-" if r["lossless"] is None else ("yes" if r["lossless"] else "NO")
        times = f"{r['tokens_per_pass'] / b:.2f}" if b else "-"
        tpp = f"{r['tokens_per_pass']:.2f} [{lo:.2f}, {hi:.2f}]"
        lines.append(
            [f"{r['temperature']:g}", r["budget"], NAMES[r["draft"]], tpp, times, r["tokens_per_second"], same]
        )
    head = ["T", "budget", "draft", "tokens per target pass [95%]", "x 2.9M draft", "tok/s (this CPU)"]
    return md_table(head + ["equals `--method ar`"], lines)
