"""The dry run's modelled seconds per pass against what the same `specx run` measures (issue 37).

Run by hand (not a test): `python bench/speedmodel.py [--budgets 16,64,256,1024] [--prompt 1] [-n 64]
[--out bench/results/speedmodel.json]`; `python bench/speedmodel.py --table bench/results/speedmodel.json`
writes CONTRIBUTING.md's table. For each setup -- the shared pair (../shared/models) with
everything resident (`--offload none`), and the target streamed from disk (`--offload disk --max-ram 0`)
-- it first writes a profile with `specx profile --target T --draft D` and the setup's flags (the same
plan a run makes), then per budget runs `specx run PROMPT --target T --draft D --budget B` with those
flags and `--profile` that file: once with `--dry-run --stats-json` (the plan's candidate for D:
modelled seconds per pass = pass + draft - hidden, each term measured by the profile where it
applies, else modelled), once for real (`--stats-json`: decode seconds / target passes). Budgets run
in a rotating order per setup (interleaved). Every `specx` call holds `flock /tmp/bench.lock` (or, with
`--locked`, the whole script runs under it). The
profile is written under a private XDG_CONFIG_HOME, so nothing else on this machine picks it up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
LOCK = ["flock", "/tmp/bench.lock"]  # emptied by --locked: the caller holds the lock for the whole run
SETUPS = {"resident": ["--offload", "none"], "disk": ["--offload", "disk", "--max-ram", "0"]}


def specx(args: list[str], env: dict) -> subprocess.CompletedProcess:
    res = subprocess.run([*LOCK, "specx", *args], capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"specx {' '.join(args)} failed:\n{res.stderr[-2000:]}")
    return res


def one(prompt: Path, setup: str, budget: int, n: int, profile: Path, env: dict, tmp: Path) -> dict:
    target, draft = SHARED / "models" / "target", SHARED / "models" / "draft"
    base = [
        "run",
        str(prompt),
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--budget",
        str(budget),
        "--temperature",
        "0",
        "-n",
        str(n),
        "--no-chat-template",
        "--no-live",
        "--profile",
        str(profile),
        *SETUPS[setup],
    ]
    specx([*base, "--dry-run", "--stats-json", str(tmp / "dry.json")], env)
    plan = json.loads((tmp / "dry.json").read_text())["plan"]
    (cand,) = [c for c in plan["candidates"] if c["draft"] == str(draft)]
    specx([*base, "--stats-json", str(tmp / "run.json")], env)
    rec = json.loads((tmp / "run.json").read_text())
    modelled = cand["pass_seconds"] + cand["draft_seconds"] - cand["hidden_seconds"]
    measured = rec["decode_seconds"] / max(1, rec["target_passes"])
    return dict(
        setup=setup,
        budget=budget,
        modelled_seconds_per_pass=modelled,
        measured_seconds_per_pass=measured,
        error=modelled / measured - 1,
        pass_seconds=cand["pass_seconds"],
        draft_seconds=cand["draft_seconds"],
        hidden_seconds=cand["hidden_seconds"],
        sources=cand.get("sources"),
        terms=cand.get("terms"),
        measured_target_seconds=rec["target_seconds"] / max(1, rec["target_passes"]),
        measured_draft_seconds=rec["draft_seconds"] / max(1, rec["target_passes"]),
        passes=rec["target_passes"],
        tokens_per_pass=rec["tokens_per_pass"],
        tokens_per_second=rec["tokens_per_second"],
        modelled_tokens_per_second=cand["tokens_per_second"],
        placement=[plan["resident_layers"], plan["streamed_layers"]["ram"], plan["streamed_layers"]["disk"]],
    )


def measure(args) -> dict:
    line = (SHARED / "bench" / "prompts.jsonl").read_text().splitlines()[args.prompt]
    budgets = [int(b) for b in args.budgets.split(",")]
    out = dict(command=" ".join(sys.argv), prompt=args.prompt, n=args.n, rows=[], profiles={})
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = dict(os.environ, XDG_CONFIG_HOME=str(tmp / "xdg"))
        prompt = tmp / "prompt.txt"
        prompt.write_text(json.loads(line)["prompt"])
        for k, setup in enumerate(SETUPS):
            profile = tmp / f"{setup}.json"
            specx(
                [
                    "profile",
                    "--target",
                    str(SHARED / "models" / "target"),
                    "--draft",
                    str(SHARED / "models" / "draft"),
                    "--max-tokens",
                    str(2 * (max(budgets) + 1)),
                    "--calibration-tokens",
                    "0",
                    "--no-live",
                    "--out",
                    str(profile),
                    *SETUPS[setup],
                ],
                env,
            )
            prof = json.loads(profile.read_text())
            out["profiles"][setup] = dict(models=prof["models"], matmul=prof["matmul"], dequant=prof.get("dequant"))
            order = budgets[k % len(budgets) :] + budgets[: k % len(budgets)]
            for budget in order:
                row = one(prompt, setup, budget, args.n, profile, env, tmp)
                out["rows"].append(row)
                print(json.dumps({k2: v for k2, v in row.items() if k2 != "terms"}), flush=True)
    return out


def table(data: dict) -> str:
    lines = [
        "| setup | budget | pass s (source) | draft s (source) | hidden s | modelled s/pass | measured s/pass "
        "| error | tokens/pass | tokens/s measured |",
        "|" + "---|" * 10,
    ]
    for r in sorted(data["rows"], key=lambda r: (r["setup"], r["budget"])):
        src = r.get("sources") or {}
        lines.append(
            f"| {r['setup']} | {r['budget']} | {r['pass_seconds']:.3f} ({src.get('pass', '?')}) | "
            f"{r['draft_seconds']:.3f} ({src.get('draft', '?')}) | {r['hidden_seconds']:.3f} | "
            f"{r['modelled_seconds_per_pass']:.3f} | {r['measured_seconds_per_pass']:.3f} | "
            f"{100 * r['error']:+.0f}% | {r['tokens_per_pass']:.2f} | {r['tokens_per_second']:.1f} |"
        )
    return "\n".join(lines)


def write_doc(data: dict, page: Path | None = None) -> None:
    """The `speedmodel` block on its pages (bench/manifest.py), or on `page`."""
    sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
    import manifest

    manifest.write("speedmodel", table(data), page)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="16,64,256,1024")
    ap.add_argument("--prompt", type=int, default=1)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "speedmodel.json"))
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
    data = measure(args)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
