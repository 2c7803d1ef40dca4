"""Many requests, one weight stream: `specx serve --parallel N` against one request at a time.  Run by hand.

Contract: loads the pair once (target streamed from disk by default: `--offload disk --max-ram 0`)
and, for each concurrency k in --concurrency (1, 2, 4), submits k requests AT ONCE (the first k
bench prompts, greedy, exactly --max-new-tokens each: EOS is ignored so every configuration does
the same work) to the serve worker in-process (serve/worker.py, no
HTTP: the forest and the scheduler are what is measured), twice per round in alternating order:
- `one at a time`: a worker with --parallel 1, which runs them FIFO (today's specx serve);
- `forest`: a worker with --parallel k, one target pass for all of them each step.
Per configuration: the wall time from submission to the last reply, aggregate tokens/s (all
completion tokens / that wall time), each request's time to first text (from submission to its
first streamed text, as a client sees it; leading text the reply filter holds back counts) and the
target passes the loaded target counted (`stats.passes`: each streams every offloaded layer once).
`ratio` = forest wall / one-at-a-time wall (the latter is the sum of the requests' sequential
times); `same_text` checks every forest reply equals the one-at-a-time reply (T = 0). Writes
--out (JSON) and prints a markdown table. Timings: wrap in `flock /tmp/bench.lock`.

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


def run_config(models, texts: list[str], parallel: int, args) -> dict:
    """Submit every prompt at once to a worker with `parallel`; wall, TTFTs, tokens, passes, texts."""
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import GenerationConfig
    from specexec_cli.serve.metrics import Metrics
    from specexec_cli.serve.models import Work
    from specexec_cli.serve.worker import Delta, Done, Failed, Job, Worker
    from specexec_cli.session.chat import ChatSession
    from specexec_cli.session.gendefaults import GREEDY

    cfg = GenerationConfig(shape=TreeShape(args.budget, args.max_depth), max_new_tokens=args.max_new_tokens)
    session = ChatSession(models, cfg, code=True)
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
    return dict(parallel=parallel, wall_s=round(wall, 3), completion_tokens=tokens,
                tokens_per_s=round(tokens / wall, 2), ttft_s=[round(f, 3) for f, _, _ in results],
                target_passes=models.target.stats.passes - passes0, texts=[d.text for _, _, d in results])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(SHARED / "models" / "target"))
    ap.add_argument("--draft", default=str(SHARED / "models" / "draft"))
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--offload", default="disk")
    ap.add_argument("--max-ram", default="0")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--max-depth", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-chars", type=int, default=0, help="the last N characters of each bench prompt (0: whole)")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import torch

    models = load(args)
    rows = []
    for k in [int(x) for x in args.concurrency.split(",")]:
        texts = prompts(k, args.prompt_chars)
        runs = {"one at a time": [], "forest": []}
        for r in range(args.rounds):
            order = ["one at a time", "forest"] if r % 2 == 0 else ["forest", "one at a time"]
            for mode in order:
                if k == 1 and mode == "forest":
                    continue
                runs[mode].append(run_config(models, texts, 1 if mode == "one at a time" else k, args))
        seq = runs["one at a time"]
        row = dict(concurrency=k, one_at_a_time=seq)
        if runs["forest"]:
            fo = runs["forest"]
            row.update(forest=fo, ratio=round(sum(f["wall_s"] for f in fo) / sum(s["wall_s"] for s in seq), 3),
                       same_text=all(f["texts"] == s["texts"] for f in fo for s in seq))
        rows.append(row)
        print(json.dumps({k2: v for k2, v in row.items() if k2 not in ("one_at_a_time", "forest")}), flush=True)
    plan = models.target.plan
    record = dict(
        command="python bench/serve_parallel.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        machine=dict(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(), device="cpu"),
        target=args.target, draft=args.draft, dtype=args.dtype, offload=args.offload, max_ram=args.max_ram,
        streamed_layers=dict(ram=len(plan.ram_layers), disk=len(plan.disk_layers)), budget=args.budget,
        budget_split="even (each of k decoding requests gets budget // k per pass)",
        max_new_tokens=args.max_new_tokens, eos="ignored (every reply runs max_new_tokens)", rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(record))


def table(record: dict) -> str:
    out = ["| concurrent requests | mode | wall s | aggregate tok/s | TTFT s (mean / max) | target passes | "
           "forest ÷ one at a time | same text |", "|---|---|---|---|---|---|---|---|"]
    for row in record["rows"]:
        for mode, key in (("one at a time", "one_at_a_time"), ("forest", "forest")):
            for run in row.get(key, []):
                ttft = run["ttft_s"]
                extra = (f"{row['ratio']:.2f}", "yes" if row["same_text"] else "NO") if key == "forest" else ("", "")
                out.append(f"| {row['concurrency']} | {mode} | {run['wall_s']:.2f} | {run['tokens_per_s']:.1f} | "
                           f"{sum(ttft) / len(ttft):.2f} / {max(ttft):.2f} | {run['target_passes']} | {extra[0]} | {extra[1]} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
