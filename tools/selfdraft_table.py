"""Regenerate the self-draft table of docs/self-draft.md from bench/selfdraft.py's JSON results.

Contract: reads every `bench/results/selfdraft_t0_gap*.json` and `selfdraft_t07_gap*.json` (the
runs with gap-featured node scores, 128 new tokens, the 8-layer target streamed from disk), sorts
the rows by temperature, budget and draft, and replaces the text between `<!-- selfdraft table -->`
and `<!-- /selfdraft table -->` in docs/self-draft.md (tools/perf_tables.py puts the same table
in CONTRIBUTING.md). "x 2.9M draft" divides by the 2.9M-parameter draft's (`shared-2.9M`) tokens per
pass in the same (temperature, budget) cell; "equals `--method ar`" is the run's own check (T = 0
only). `--check` only reports (exit 1) when the page is out of date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/self-draft.md"
BEGIN, END = "<!-- selfdraft table -->", "<!-- /selfdraft table -->"
NAMES = {"shared-2.9M": "2.9M-parameter draft", "self-nf4": "`--draft self --draft-bits 4` (nf4)",
         "self-nf4-ownkv": "nf4, own KV cache (not a mode)", "self-hqq3": "`--draft self --draft-bits 3` (HQQ)",
         "self-hqq2": "`--draft self --draft-bits 2` (HQQ)"}


def rows() -> list[dict]:
    files = sorted((ROOT / "bench" / "results").glob("selfdraft_t0_gap*.json"))
    files += sorted((ROOT / "bench" / "results").glob("selfdraft_t07_gap*.json"))
    out = [r for f in files for r in json.loads(f.read_text())["rows"] if r["draft"] in NAMES]
    order = list(NAMES)
    return sorted(out, key=lambda r: (r["temperature"], r["budget"], order.index(r["draft"])))


def table() -> str:
    rs = rows()
    base = {(r["temperature"], r["budget"]): r["tokens_per_pass"] for r in rs if r["draft"] == "shared-2.9M"}
    lines = ["| T | budget | draft | tokens per target pass [95%] | x 2.9M draft | tok/s (this CPU) | equals `--method ar` |",
             "|---|---|---|---|---|---|---|"]
    for r in rs:
        b = base.get((r["temperature"], r["budget"]))
        lo, hi = r["ci95"]
        same = "-" if r["lossless"] is None else ("yes" if r["lossless"] else "NO")
        times = f"{r['tokens_per_pass'] / b:.2f}" if b else "-"
        lines.append(f"| {r['temperature']:g} | {r['budget']} | {NAMES[r['draft']]} | {r['tokens_per_pass']:.2f} "
                     f"[{lo:.2f}, {hi:.2f}] | {times} | {r['tokens_per_second']} | {same} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the table in docs/self-draft.md is out of date")
    args = ap.parse_args()
    page = ROOT / PAGE
    text = page.read_text()
    i, j = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:i] + "\n" + table() + "\n" + text[j:]
    if args.check:
        return int(new != text)
    page.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
