#!/usr/bin/env python3
"""The GPU day on an offline box with a fixed image, in four verbs (CONTRIBUTING.md, "The GPU day"; results in docs/gpu-status.md).

Contract:
- `pack [--python 3.12] [--dest .whl]`: the wheels the image lacks (tools/gpuday/pack.py) into the
  git-ignored --dest; prints what a device call would carry; exit 1 above 62 MiB.
- `run [--smoke] [--out DIR] [--phase NAME] [--budget-s S] [--resume-from JSON] [--summary FILE]`: the
  measurements, phase by phase (tools/gpuday/run.py), each phase's JSON in --out; a phase already
  done is skipped, so a second command resumes a cut one. Runs from the repo root with nothing
  installed (PYTHONPATH=. and the pack's --target folder). `--smoke`: every phase tiny, on the CPU.
- `rehearse`: on a CPU machine, a venv shaped like the image, the pack for this Python installed with
  the box's install line, then `run --smoke` (tools/gpuday/rehearse.py).
- `tables --out DIR [--write [PAGE ...]]`: the day's tables from a run's JSON (tools/gpuday/tables.py),
  printed, or written into their pages: the measurements into docs/gpu-status.md, the CUDA tests'
  table into CONTRIBUTING.md (every page, or only the pages named).
- `trace`: on a CPU machine with ../shared, record the acceptance trace the `step` phase replays
  (tools/gpuday/trace.py) into tools/gpuday/step_trace.json (it travels with the repository).
Exit 2 on usage errors, one line each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpu_day.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="fetch the wheels the image lacks; print the travel size")
    p.add_argument("--python", default=None, help="the box's Python (default: the image's, 3.12)")
    p.add_argument("--dest", type=Path, default=ROOT / ".whl")
    r = sub.add_parser("run", help="the measurements, phase by phase, JSON in --out")
    r.add_argument("--smoke", action="store_true", help="every phase tiny, on the CPU")
    r.add_argument("--out", type=Path, default=Path("gpu-day-out"))
    r.add_argument("--phase", action="append", default=None, help="run only this phase (repeatable); again if done")
    r.add_argument("--budget-s", type=float, default=540.0, help="stop starting phases after this many seconds")
    r.add_argument("--resume-from", type=Path, default=None, help="an earlier command's summary.json: skip its phases")
    r.add_argument("--summary", type=Path, default=None, help="also write summary.json here after every phase")
    h = sub.add_parser("rehearse", help="a venv shaped like the image, the pack installed, run --smoke")
    h.add_argument("--venv", type=Path, default=None)
    h.add_argument("--out", type=Path, default=None)
    c = sub.add_parser("trace", help="record the step phase's acceptance trace (CPU, the shared dev pair)")
    c.add_argument("--to", type=Path, default=None, help="where to write it (default: the shipped file)")
    t = sub.add_parser("tables", help="the day's tables from a run's --out (docs/gpu-status.md, CONTRIBUTING.md)")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument(
        "--write",
        type=Path,
        nargs="*",
        default=None,
        metavar="PAGE",
        help="rewrite the tables in their pages (docs/gpu-status.md; the tests table in CONTRIBUTING.md), "
        "or only in the pages named",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.verb == "pack":
        from tools.gpuday import image, pack

        return pack.main(ROOT, args.dest.resolve(), args.python or image.PYTHON)
    if args.verb == "run":
        from tools.gpuday import run

        return run.main(args.out.resolve(), args.smoke, args.phase, args.budget_s, args.resume_from, args.summary)
    if args.verb == "rehearse":
        from tools.gpuday import rehearse

        return rehearse.main(ROOT, args.venv, args.out)
    if args.verb == "trace":
        from tools.gpuday import trace

        rec = trace.record(args.to or trace.TRACE)
        print(
            {
                b: f"{trace.mean(r['accepted']):.2f} accepted over {len(r['accepted'])} passes"
                for b, r in rec["budgets"].items()
            }
        )
        return 0
    from tools.gpuday import tables

    return tables.main(args.out, args.write)


if __name__ == "__main__":
    sys.exit(main())
