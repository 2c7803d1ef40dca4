"""`--draft self` without `--draft-bits` (the automatic width) against each explicit width (issue 41).

Run by hand (not a test): `python bench/selfdraft_width.py --profile P [--prompts 1:3] [--budgets 64,256]
[--temperatures 0,0.7] [-n 64] [--out bench/results/selfdraft_width.json]`, then
`python bench/selfdraft_width.py --table bench/results/selfdraft_width.json` writes CONTRIBUTING.md's
table. Every cell is one `specx run` as a user types it: the shared target (../shared/models/target)
with every layer streamed from disk (`--offload disk --max-ram 0`), `--draft self`, the cell's
`--budget` and `--temperature`, `-n` new tokens, `--no-chat-template`, and `--profile P` (a profile
`specx profile --target ../shared/models/target --draft self --offload disk --max-ram 0` wrote on this
machine); once with `--dry-run --stats-json` and no `--draft-bits` (the plan's modelled figures: the
width it chooses and each width's modelled draft seconds and tokens/s), then each configuration for
real (`--stats-json`: measured draft seconds per pass and tokens/s). The configurations of a (prompt, budget, temperature) run
back to back in a rotating order (interleaved, so machine load drifts over all alike): auto, 4, 3, 2.
At T = 0 the texts of every width and of `--method ar` must be equal (lossless). Each run is wrapped in
`flock /tmp/bench.lock` (or, with `--locked`, the whole script runs under it) so that no other
benchmark times at once. Writes JSON; prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CONFIGS = ("auto", "4", "3", "2")
LOCK = ["flock", "/tmp/bench.lock"]  # emptied by --locked: the caller holds the lock for the whole run


def run_specx(args: list[str], stats: Path) -> tuple[str, dict]:
    """(stdout, the --stats-json record) of one `specx` invocation under the bench lock."""
    cmd = [*LOCK, "specx", *args, "--stats-json", str(stats)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return res.stdout, json.loads(stats.read_text())


def cell(
    prompt: Path, config: str, budget: int, temperature: float, n: int, profile: str, tmp: Path, plan: dict
) -> dict:
    """One configuration's run, with the modelled figures of the width it runs from `plan` (the automatic
    width's dry run: every width is planned there on its own, as an explicit --draft-bits plans it)."""
    base = [
        "run",
        str(prompt),
        "--target",
        str(SHARED / "models" / "target"),
        "--draft",
        "self",
        "--budget",
        str(budget),
        "--offload",
        "disk",
        "--max-ram",
        "0",
        "--temperature",
        str(temperature),
        "-n",
        str(n),
        "--no-chat-template",
        "--no-live",
        "--profile",
        profile,
    ]
    if config != "auto":
        base += ["--draft-bits", config]
    text, rec = run_specx(base, tmp / "run.json")
    passes = max(1, rec["target_passes"])
    cands = {c["bits"]: c for c in plan["candidates"] if c["draft"] == "self"}
    chosen = plan["substitute_bits"] if config == "auto" else int(config)
    return dict(
        config=config,
        bits=chosen,
        text=text,
        modelled_draft_seconds=cands[chosen]["draft_seconds"],
        modelled_tokens_per_second=cands[chosen]["tokens_per_second"],
        draft_source=cands[chosen].get("sources", {}).get("draft", "modelled"),
        measured_draft_seconds=rec["draft_seconds"] / passes,
        tokens_per_pass=rec["tokens_per_pass"],
        tokens_per_second=rec["tokens_per_second"],
        passes=rec["target_passes"],
        new_tokens=rec["new_tokens"],
        modelled=[{k: c.get(k) for k in ("bits", "draft_seconds", "tokens_per_second")} for c in cands.values()],
    )


def dry_plan(prompt: Path, budget: int, temperature: float, n: int, profile: str, tmp: Path) -> dict:
    """The automatic width's `--dry-run` plan (every width's modelled candidate and the choice)."""
    _, dry = run_specx(
        [
            "run",
            str(prompt),
            "--target",
            str(SHARED / "models" / "target"),
            "--draft",
            "self",
            "--budget",
            str(budget),
            "--offload",
            "disk",
            "--max-ram",
            "0",
            "--temperature",
            str(temperature),
            "-n",
            str(n),
            "--no-chat-template",
            "--no-live",
            "--profile",
            profile,
            "--dry-run",
        ],
        tmp / "dry.json",
    )
    return dry["plan"]


def reference(prompt: Path, n: int, tmp: Path) -> str:
    text, _ = run_specx(
        [
            "run",
            str(prompt),
            "--target",
            str(SHARED / "models" / "target"),
            "--method",
            "ar",
            "--offload",
            "disk",
            "--max-ram",
            "0",
            "--temperature",
            "0",
            "-n",
            str(n),
            "--no-chat-template",
            "--no-live",
        ],
        tmp / "ar.json",
    )
    return text


def measure(args) -> dict:
    lines = (SHARED / "bench" / "prompts.jsonl").read_text().splitlines()
    lo, hi = (int(x) for x in args.prompts.split(":"))
    out = dict(command=" ".join(sys.argv), profile=args.profile, n=args.n, cells=[])
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for k, i in enumerate(range(lo, hi)):
            prompt = tmp / f"p{i}.txt"
            prompt.write_text(json.loads(lines[i])["prompt"])
            ref = reference(prompt, args.n, tmp)
            for budget in (int(b) for b in args.budgets.split(",")):
                for temperature in (float(t) for t in args.temperatures.split(",")):
                    shift = k + len(out["cells"])
                    order = CONFIGS[shift % 4 :] + CONFIGS[: shift % 4]  # rotate: interleaved over cells
                    plan = dry_plan(prompt, budget, temperature, args.n, args.profile, tmp)
                    runs = [cell(prompt, c, budget, temperature, args.n, args.profile, tmp, plan) for c in order]
                    for r in runs:
                        r["lossless"] = r["text"] == ref if temperature == 0 else None
                        del r["text"]
                    out["cells"].append(dict(prompt=i, budget=budget, temperature=temperature, runs=runs))
                    print(json.dumps(out["cells"][-1]), flush=True)
    return out


def summary(data: dict) -> list[dict]:
    """Per (budget, temperature, config): medians over prompts; auto's tokens/s over the best explicit width's."""
    rows = []
    keys = sorted({(c["budget"], c["temperature"]) for c in data["cells"]})
    for budget, temp in keys:
        cells = [c for c in data["cells"] if (c["budget"], c["temperature"]) == (budget, temp)]
        by = {cfg: [r for c in cells for r in c["runs"] if r["config"] == cfg] for cfg in CONFIGS}
        tps = {
            cfg: sum(r["new_tokens"] for r in rs) / sum(r["new_tokens"] / r["tokens_per_second"] for r in rs)
            for cfg, rs in by.items()
        }
        best = max(tps[c] for c in CONFIGS[1:])
        for cfg in CONFIGS:
            rs = by[cfg]
            rows.append(
                dict(
                    budget=budget,
                    temperature=temp,
                    config=cfg,
                    bits=sorted({r["bits"] for r in rs}),
                    modelled_draft_seconds=statistics.median(r["modelled_draft_seconds"] for r in rs),
                    measured_draft_seconds=statistics.median(r["measured_draft_seconds"] for r in rs),
                    modelled_tokens_per_second=statistics.median(r["modelled_tokens_per_second"] for r in rs),
                    tokens_per_pass=statistics.median(r["tokens_per_pass"] for r in rs),
                    tokens_per_second=tps[cfg],
                    vs_best=tps[cfg] / best,
                    lossless=None if temp else all(r["lossless"] for r in rs),
                )
            )
    return rows


def table(data: dict) -> str:
    head = (
        "| budget | T | `--draft-bits` | width used | draft s/pass modelled | draft s/pass measured | "
        "tokens/pass | tokens/s modelled | tokens/s measured | x best explicit | T = 0 text = `--method ar` |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in summary(data):
        lines.append(
            f"| {r['budget']} | {r['temperature']:g} | {r['config']} | {'/'.join(map(str, r['bits']))} | "
            f"{r['modelled_draft_seconds']:.3f} | {r['measured_draft_seconds']:.3f} | {r['tokens_per_pass']:.1f} | "
            f"{r['modelled_tokens_per_second']:.1f} | {r['tokens_per_second']:.1f} | {r['vs_best']:.2f}x | "
            f"{'-' if r['lossless'] is None else 'yes' if r['lossless'] else 'NO'} |"
        )
    return "\n".join(lines)


def write_doc(data: dict, page: Path | None = None) -> None:
    """The `selfdraft-width` block on its pages (bench/manifest.py), or on `page`."""
    sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
    import manifest

    manifest.write("selfdraft-width", table(data), page)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="profile file specx profile wrote on this machine")
    ap.add_argument("--prompts", default="1:3")
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "selfdraft_width.json"))
    ap.add_argument("--table", metavar="JSON", help="write CONTRIBUTING.md's table from this result instead")
    ap.add_argument(
        "--locked",
        action="store_true",
        help="the caller already holds /tmp/bench.lock (flock /tmp/bench.lock python ...)",
    )
    args = ap.parse_args(argv)
    if args.locked:
        LOCK.clear()
    if args.table:
        write_doc(json.loads(Path(args.table).read_text()))
        return 0
    if not args.profile:
        ap.error("--profile is required to measure")
    data = measure(args)
    data["summary"] = summary(data)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
