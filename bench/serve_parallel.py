"""Many requests, one weight stream: `specx serve --parallel N` against one request at a time.  Run by hand.

Contract: loads the pair once (target streamed from disk by default: `--offload disk --max-ram 0`)
and, for each concurrency k in --concurrency (1, 2, 4), submits k requests AT ONCE (the first k
bench prompts, greedy, exactly --max-new-tokens each: EOS is ignored so every configuration does
the same work) to the serve worker in-process (serve/worker.py, no HTTP: the forest and the
scheduler are what is measured) under --parallel 1 (one at a time, FIFO) and every --parallel p
of --parallel-list up to k (one target pass for up to p of them each step), the order rotating
per round. `--budget auto` gives the worker the tuner `specx serve --budget auto` builds (the
memory plan's model; no profile), whose split gives each request its tree; a number is the whole
pass's budget, split evenly. Per configuration: the wall time from submission to the last reply,
aggregate tokens/s (all completion tokens / that wall time), each request's time to first text
(from submission to its first streamed text, as a client sees it), the target passes the loaded
target counted (`stats.passes`: each streams every offloaded layer once), seconds per pass, and
under auto the budgets the requests ran. `ratio` = wall / the one-at-a-time wall; `longest_share`
= the longest request's passes over all requests' passes one at a time (the forest's floor: it
ends with its longest reply); `same_text`: every reply equals the one-at-a-time reply (T = 0).
Writes --out (JSON) and prints a markdown table. Timings: wrap in `flock /tmp/bench.lock`.

    flock /tmp/bench.lock python bench/serve_parallel.py --out bench/results/serve/parallel.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the repository's packages, not bench/offload.py
SHARED = ROOT.parent / "shared"


def prompts(n: int, chars: int) -> list[str]:
    lines = (SHARED / "bench" / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"][-chars:] if chars else json.loads(line)["prompt"] for line in lines[:n]]


def load(args):
    from specexec_cli.session.loading import LoadOptions, load_models
    from offload.sizes import parse_size

    opts = LoadOptions(args.target, args.draft, dtype=args.dtype, device="cpu", offload=args.offload,
                       max_ram=parse_size(args.max_ram) if args.max_ram is not None else None, ctx=args.ctx)
    models = load_models(opts)
    models.eos_ids = frozenset()   # every reply runs --max-new-tokens: the configurations do equal work
    return models


def tuner(models, cfg, budget: str):
    """--budget auto: the tuner `specx serve` builds (from the memory plan's model: no profile is read,
    XDG_CONFIG_HOME points at an empty folder); a fresh one per configuration. None: explicit budget."""
    import os
    import tempfile

    from specexec_cli.session.options import hardware_fit

    if budget != "auto":
        return None
    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="specx-bench-")
    return hardware_fit("auto", cfg, None, models, "disk")[0]


def run_config(models, texts: list[str], parallel: int, args) -> dict:
    """Submit every prompt at once to a worker with `parallel`; wall, TTFTs, tokens, passes, texts."""
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import GenerationConfig
    from specexec_cli.serve.metrics import Metrics
    from specexec_cli.serve.models import Work
    from specexec_cli.serve.jobs import Delta, Done, Failed, Job
    from specexec_cli.serve.worker import Worker
    from specexec_cli.session.chat import ChatSession
    from specexec_cli.session.gendefaults import GREEDY

    budget = 64 if args.budget == "auto" else int(args.budget)
    cfg = GenerationConfig(shape=TreeShape(budget, args.max_depth), max_new_tokens=args.max_new_tokens)
    session = ChatSession(models, cfg, code=True, tuner=tuner(models, cfg, args.budget))
    worker = Worker(lambda: (session, GREEDY), max_queue=len(texts), metrics=Metrics(), parallel=parallel)
    worker.start()
    while worker.state == "loading":
        time.sleep(0.01)

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [Job(Work(prompt=t, max_tokens=args.max_new_tokens, temperature=0), loop, "completions") for t in texts]
        t0 = time.perf_counter()
        for job in jobs:
            worker.submit(job)

        async def one(job):
            first, items = None, []
            while not items or not isinstance(items[-1], (Done, Failed)):
                items.append(await job.events.get())
                if first is None and isinstance(items[-1], (Delta, Done)):
                    first = time.perf_counter() - t0
            if isinstance(items[-1], Failed):
                raise SystemExit(f"a request failed: {items[-1].error}")
            return first, time.perf_counter() - t0, items[-1]

        return t0, await asyncio.gather(*(one(j) for j in jobs))

    passes0 = models.target.stats.passes
    try:
        _, results = asyncio.run(go())
    finally:
        worker.shutdown()
        worker.thread.join()
    wall = max(end for _, end, _ in results)
    tokens = sum(done.usage["completion_tokens"] for _, _, done in results)
    auto = dict(budgets_run=sorted(session.tuner.by_budget)) if session.tuner is not None else {}
    passes = models.target.stats.passes - passes0
    return dict(parallel=parallel, **auto, wall_s=round(wall, 3), completion_tokens=tokens,
                tokens_per_s=round(tokens / wall, 2), ttft_s=[round(f, 3) for f, _, _ in results],
                target_passes=passes, seconds_per_pass=round(wall / max(passes, 1), 3),
                passes_each=[d.specx.get("target_passes", 0) + 1 for _, _, d in results],   # +1: its prefill pass
                texts=[d.text for _, _, d in results])


def measure(models, k: int, args) -> dict:
    """k requests at once under --parallel 1 (one at a time) and each --parallel p in --parallel-list
    up to k, the order rotating per round; each p's wall over --parallel 1's, and the longest
    request's share of the one-at-a-time passes (the forest's floor: it ends with its longest reply)."""
    texts = prompts(k, args.prompt_chars)
    ps = [1] + [p for p in map(int, args.parallel_list.split(",")) if 1 < p <= k]
    runs = {p: [] for p in ps}
    for r in range(args.rounds):
        for p in ps[r % len(ps):] + ps[: r % len(ps)]:
            runs[p].append(run_config(models, texts, p, args))
    seq = runs[1]
    each = seq[0]["passes_each"]
    by = [dict(parallel=p, runs=runs[p], ratio=round(sum(f["wall_s"] for f in runs[p]) / sum(x["wall_s"] for x in seq), 3),
               same_text=all(f["texts"] == x["texts"] for f in runs[p] for x in seq)) for p in ps]  # fmt: skip
    return dict(concurrency=k, longest_share=round(max(each) / sum(each), 3), by_parallel=by)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(SHARED / "models" / "target"))
    ap.add_argument("--draft", default=str(SHARED / "models" / "draft"))
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--offload", default="disk")
    ap.add_argument("--max-ram", default="0")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--budget", default="64", help="a tree budget, or auto (the speed model's budget and split)")
    ap.add_argument("--max-depth", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-chars", type=int, default=0, help="the last N characters of each bench prompt (0: whole)")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--parallel-list", default="2,4", help="--parallel values tried beside 1 (each up to k)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import torch

    models = load(args)
    rows = []
    for k in [int(x) for x in args.concurrency.split(",")]:
        row = measure(models, k, args)
        rows.append(row)
        print(json.dumps({**row, "by_parallel": [{x: v for x, v in b.items() if x != "runs"} for b in row["by_parallel"]]}),
              flush=True)  # fmt: skip
    plan = models.target.plan
    record = dict(
        command="python bench/serve_parallel.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        machine=dict(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(), device="cpu"),
        target=args.target, draft=args.draft, dtype=args.dtype, offload=args.offload, max_ram=args.max_ram,
        streamed_layers=dict(ram=len(plan.ram_layers), disk=len(plan.disk_layers)), budget=args.budget,
        budget_split="speed model (core/budget.py BudgetTuner.split; --budget auto)" if args.budget == "auto"
        else "even (each of k decoding requests gets budget // k per pass)",
        max_new_tokens=args.max_new_tokens, eos="ignored (every reply runs max_new_tokens)", rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(record))


def by_parallel(row: dict) -> list[dict]:
    """A row's runs per --parallel value (JSON written before --parallel-list: one_at_a_time/forest)."""
    if "by_parallel" in row:
        return row["by_parallel"]
    out = [dict(parallel=1, runs=row["one_at_a_time"], ratio=1.0, same_text=True)]
    if row.get("forest"):
        out.append(dict(parallel=row["concurrency"], runs=row["forest"], ratio=row["ratio"], same_text=row["same_text"]))
    return out


def table(record: dict) -> str:
    out = ["| requests at once | `--parallel` | wall s | aggregate tok/s | time to first text, mean / max | target passes | "
           "s / pass | wall ÷ one at a time | floor | same replies |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in record["rows"]:
        floor = f"{row['longest_share']:.2f}" if "longest_share" in row else ""
        ref = by_parallel(row)[0]["runs"][0]["texts"]   # the first one-at-a-time run's replies
        for b in by_parallel(row):
            for run in b["runs"]:
                ttft, p = run["ttft_s"], b["parallel"]
                ran = f" (budgets {', '.join(map(str, run['budgets_run']))})" if run.get("budgets_run") else ""
                spp = run.get("seconds_per_pass", run["wall_s"] / max(run["target_passes"], 1))
                same = sum(x == y for x, y in zip(run["texts"], ref))
                same = "yes" if same == len(ref) else f"{same} of {len(ref)}"
                extra = (f"{b['ratio']:.2f}", floor, same) if p > 1 else ("", "", "")
                out.append(f"| {row['concurrency']} | {p}{ran} | {run['wall_s']:.2f} | {run['tokens_per_s']:.1f} | "
                           f"{sum(ttft) / len(ttft):.2f} s / {max(ttft):.2f} s | {run['target_passes']} | {spp:.2f} | "
                           f"{' | '.join(extra)} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
