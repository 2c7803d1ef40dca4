"""`--draft self` against the shared trained draft: tokens per target pass and tokens/s, one run.

Run by hand (not a test): `python bench/selfdraft.py [--prompts 0:40] [--budgets 64,256]
[--temperatures 0] [--seeds 3] [--target DIR --dtype bf16]`. The target (../shared/models/target, or
an inflated copy from ../shared/tools/inflate_llama.py: the same function at GB-scale layers) is
loaded twice with EVERY layer streamed from disk (`offload="disk"`, `max_ram=0`), so no layer is
resident and the self-draft is the substitute throughout: once with the shared 2.9M draft, once per
`--bits` width with `--draft self` (4: NF4; 3, 2: HQQ). For each (temperature, budget) both drafts decode every prompt of
../shared/bench/prompts.jsonl with specexec (bench/accept.py's `run_cell`: tokens per target pass
pooled over prompts with a 95% bootstrap interval over prompts), interleaved cell by cell so disk
drift hits both alike. At T = 0 every run's ids are checked against the same target's own
`--method ar` decoding. tokens/s is wall time on this CPU, where a substitute costs as much compute
as the target (on a GPU it costs a fraction of a pass; bench/gpu.py measures that). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accept import SHARED, load_prompts, run_cell  # noqa: E402

from specexec_cli.core.engine import DecodeState, GenerationConfig  # noqa: E402
from specexec_cli.session.loading import LoadOptions, load_models, quiet_transformers  # noqa: E402
from specexec_cli.core.methods import generate  # noqa: E402


def load(target: str, dtype: str, draft: str, bits: int | None = None, shared_kv: bool = True, skip: int = 0,
         rule: str = "influence"):
    return load_models(LoadOptions(target, draft, dtype=dtype, device="cpu", offload="disk", max_ram=0,
                                   draft_bits=bits, shared_kv=shared_kv, draft_skip=skip, draft_skip_rule=rule))


def ar_refs(models, prompts, n: int) -> list[list[int]]:
    refs = []
    for _, p in prompts:
        cfg = GenerationConfig(method="ar", max_new_tokens=n)
        refs.append([t for ev in generate(models, DecodeState(), models.tokenizer(p)["input_ids"], cfg)
                     for t in ev.tokens])
    return refs


def build_pairs(args) -> dict:
    """name -> Models: the shared draft (unless --no-shared) and one self-draft per width, KV mode, skip and rule."""
    pairs = {} if args.no_shared else {"shared-2.9M": load(args.target, args.dtype, str(SHARED / "models" / "draft"))}
    for bits in [int(b) for b in args.bits.split(",")]:
        for kv in ("shared", "own") if args.kv == "both" else (args.kv,):
            for skip in [int(k) for k in args.skip.split(",")]:
                rules = ("influence", "middle") if args.skip_rule == "both" and skip else (args.skip_rule,)
                for rule in rules:
                    name = (("self-nf4" if bits == 4 else f"self-hqq{bits}") + ("" if kv == "shared" else "-ownkv")
                            + (f"-skip{skip}" if skip else "") + ("-middle" if skip and rule == "middle" else ""))
                    pairs[name] = load(args.target, args.dtype, "self", bits, kv == "shared", skip, rule)
                    if skip:
                        print(f"{name}: leaves out layers {pairs[name].draft.skipped}", flush=True)
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="0:40")
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--bits", default="4", help="substitute widths to compare, e.g. 4,3,2 (3 and 2: HQQ)")
    ap.add_argument("--no-shared", action="store_true", help="skip the shared draft (it was measured already)")
    ap.add_argument("--skip", default="0", help="self-draft: middle layers left without a substitute (selfdraft.skip_block), e.g. 0,1,2,3,4")
    ap.add_argument("--skip-rule", default="influence", help="which layers --skip leaves out: influence (the "
                    "least influential, offload/influence.py), middle (a middle block), or both")
    ap.add_argument("--kv", default="shared", help="the self-draft's KV: shared (reads the target's), own, or both")
    ap.add_argument("--target", default=str(SHARED / "models" / "target"),
                    help="e.g. an inflated copy of the shared target (../shared/tools/inflate_llama.py)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the target's compute dtype")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "selfdraft.json"))
    args = ap.parse_args()
    for name, default in (("max_depth", 64), ("max_beams", 32), ("max_branch", 32), ("gamma", 5), ("scores", None)):
        setattr(args, name, default)
    if not (SHARED / "models" / "draft").exists() or not Path(args.target).exists():
        sys.exit("bench/selfdraft.py needs ../shared/models (the trained pair) and --target; one is not present")
    quiet_transformers()
    pairs = build_pairs(args)
    assert not any(m.target.plan.resident for m in pairs.values()), "every target layer must stream"
    prompts = load_prompts(args.prompts)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    greedy = 0.0 in temperatures   # the ar references check the T = 0 runs only
    refs = ar_refs(next(iter(pairs.values())), prompts, args.max_new_tokens) if greedy else [None] * len(prompts)
    rows = []
    for temperature in temperatures:
        for budget in [int(b) for b in args.budgets.split(",")]:
            for name, models in pairs.items():
                t0 = time.time()
                r = run_cell(models, prompts, refs if temperature == 0 else [None] * len(prompts), "specexec",
                             budget, temperature, args)
                r.update(draft=name, tokens_per_second=round(sum(r["per_prompt_tokens"]) / (time.time() - t0), 2))
                rows.append(r)
                print(f"T={temperature:g} budget={budget:<5} {name:<12} tokens/pass={r['tokens_per_pass']:<6} "
                      f"95%={r['ci95']} tok/s={r['tokens_per_second']} lossless={r['lossless']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(vars(args), command=" ".join(sys.argv), torch=torch.__version__, device="cpu", target_dtype=args.dtype,
                substitutes="4: nf4 (bitsandbytes, blocksize 64, double quant); 3, 2: HQQ axis 1, group 64 / 32",
                offload="disk, max_ram=0")
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n| T | budget | draft | tokens/pass [95%] | tok/s | lossless |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['temperature']:g} | {r['budget']} | {r['draft']} | {r['tokens_per_pass']:.2f} "
              f"[{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] | {r['tokens_per_second']} | {r['lossless']} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
