"""Tokens per target pass of `--method specexec` vs budget, on the shared trained pair.

Run by hand (not a test): `python bench/accept.py [--prompts N] [--max-new-tokens 48] [--out FILE]`.
For each budget in {1, 16, 64, 256, 1024, 2048} and temperature in {0, 0.7} it decodes every prompt
from ../shared/bench/prompts.jsonl with the engine and reports tokens per target pass (total
emitted by target passes / passes; the prefill token is excluded), and the tok/s measured in the
same run. At T=0 it also checks the ids against the target's HF greedy `generate`. Writes JSON and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

from specexec_cli.draft import TreeShape  # noqa: E402
from specexec_cli.engine import DecodeState, GenerationConfig, generate  # noqa: E402
from specexec_cli.loading import LoadOptions, load_models  # noqa: E402
from specexec_cli.sampling import SamplingParams  # noqa: E402
from specexec_cli.stats import RunStats  # noqa: E402


def load_prompts(n: int) -> list[str]:
    lines = (SHARED / "bench" / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def run_cell(models, prompts, budget, temperature, args) -> dict:
    shape = TreeShape(budget, args.max_depth, args.max_beams, args.max_branch)
    cfg = GenerationConfig(shape=shape, sampling=SamplingParams(temperature), max_new_tokens=args.max_new_tokens)
    total = RunStats()
    lossless = True if temperature == 0 else None
    for i, prompt in enumerate(prompts):
        ids = models.tokenizer(prompt)["input_ids"]
        stats = RunStats()
        for ev in generate(models, DecodeState(), ids, GenerationConfig(**{**cfg.__dict__, "seed": i})):
            stats.add(ev)
        if temperature == 0 and args.check:
            ref = models.target.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)
            lossless = lossless and stats.token_ids == ref[0, len(ids) :].tolist()
        total.pass_tokens += stats.pass_tokens
        total.target_passes += stats.target_passes
        total.decode_seconds += stats.decode_seconds
        total.draft_seconds += stats.draft_seconds
        total.target_seconds += stats.target_seconds
        total.token_ids += stats.token_ids
    return dict(
        budget=budget, temperature=temperature, prompts=len(prompts), tokens_per_pass=round(total.tokens_per_pass, 3),
        tokens_per_second=round(total.tokens_per_second, 2), target_passes=total.target_passes,
        draft_seconds=round(total.draft_seconds, 2), target_seconds=round(total.target_seconds, 2),
        accept_histogram={str(k): v for k, v in total.accept_histogram.items()}, lossless=lossless,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--budgets", default="1,16,64,256,1024,2048")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-depth", type=int, default=64)
    ap.add_argument("--max-beams", type=int, default=32)
    ap.add_argument("--max-branch", type=int, default=32)
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the HF greedy comparison")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "accept.json"))
    args = ap.parse_args()
    if not (SHARED / "models" / "target").exists():
        sys.exit("bench/accept.py needs ../shared/models (the trained pair); it is not present")
    models = load_models(LoadOptions(str(SHARED / "models/target"), str(SHARED / "models/draft"), dtype="fp32", device="cpu"))
    prompts = load_prompts(args.prompts)
    rows = []
    t0 = time.time()
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        for budget in [int(b) for b in args.budgets.split(",")]:
            rows.append(run_cell(models, prompts, budget, temperature, args))
            r = rows[-1]
            print(f"T={temperature:<4} budget={budget:<5} tokens/pass={r['tokens_per_pass']:<6} "
                  f"tok/s={r['tokens_per_second']:<7} lossless={r['lossless']}  [{time.time() - t0:.0f}s]", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(max_new_tokens=args.max_new_tokens, max_depth=args.max_depth, max_beams=args.max_beams,
                max_branch=args.max_branch, dtype="fp32", device="cpu", torch=torch.__version__)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n| T | budget | tokens/pass | tok/s | lossless |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['temperature']} | {r['budget']} | {r['tokens_per_pass']} | {r['tokens_per_second']} | {r['lossless']} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
