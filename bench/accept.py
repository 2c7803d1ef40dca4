"""Tokens per target pass vs budget, per method, on the shared trained pair, with 95% intervals.

Run by hand (not a test), under the shared lock:
`python bench/accept.py [--prompts 0:40] [--budgets 16,128,1024]
 [--methods specexec,sequoia,specinfer,chain] [--temperatures 0,0.7] [--seeds 3] [--readme]`.
For each (temperature, budget, method) it decodes every selected prompt of
../shared/bench/prompts.jsonl (at T > 0 once per seed) with the engine and reports tokens per
target pass = tokens emitted by target passes ÷ passes (the prefill token is excluded), pooled over
the prompts, with a 95% percentile-bootstrap interval that resamples prompts (a prompt's seeds stay
together). At T = 0 every run's ids are checked against the target's HF greedy `generate`.
Writes JSON; `--readme` also rewrites the block `<!-- bench:accept -->` (`block(runs)`: the runs'
commands and their table, from their JSON alone) on the pages bench/manifest.py lists for it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

from specexec_cli.core.draft import TreeShape  # noqa: E402
from specexec_cli.core.engine import DecodeState, GenerationConfig  # noqa: E402
from specexec_cli.core.methods import generate  # noqa: E402
from specexec_cli.core.sampling import SamplingParams  # noqa: E402
from specexec_cli.core.stats import RunStats  # noqa: E402
from specexec_cli.session.loading import LoadOptions, load_models  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
from docblock import md_table  # noqa: E402  (bench/docblock.py)


def load_prompts(spec: str) -> list[tuple[int, str]]:
    """'a:b' (or 'n' = '0:n') → [(index, prompt)] from the shared prompt file."""
    lines = (SHARED / "bench" / "prompts.jsonl").read_text().splitlines()
    a, b = (int(x) for x in spec.split(":")) if ":" in spec else (0, int(spec))
    return [(i, json.loads(lines[i])["prompt"]) for i in range(a, min(b, len(lines)))]


def interval(tokens: np.ndarray, passes: np.ndarray, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap of sum(tokens)/sum(passes), resampling prompts (rows)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(tokens), size=(draws, len(tokens)))
    ratios = tokens[idx].sum(1) / np.maximum(passes[idx].sum(1), 1)
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def run_cell(models, prompts, refs, method, budget, temperature, args) -> dict:
    shape = TreeShape(budget, args.max_depth, args.max_beams, args.max_branch)
    extra = {"scores": args.scores} if args.scores else {}
    seeds = range(args.seeds) if temperature > 0 else range(1)
    tokens, passes, lossless, t0 = [], [], True, time.time()
    for (i, prompt), ref in zip(prompts, refs):
        tok = npass = 0
        for seed in seeds:
            cfg = GenerationConfig(
                method=method,
                shape=shape,
                sampling=SamplingParams(temperature),
                seed=1000 * seed + i,
                max_new_tokens=args.max_new_tokens,
                extra=dict(extra, gamma=args.gamma),
            )
            stats = RunStats()
            for ev in generate(models, DecodeState(), models.tokenizer(prompt)["input_ids"], cfg):
                stats.add(ev)
            tok, npass = tok + sum(stats.pass_tokens), npass + stats.target_passes
            if temperature == 0 and ref is not None:
                lossless = lossless and stats.token_ids == ref
        tokens.append(tok)
        passes.append(npass)
    t, p = np.array(tokens, float), np.array(passes, float)
    lo, hi = interval(t, p)
    return dict(
        method=method,
        budget=budget,
        temperature=temperature,
        prompts=len(prompts),
        seeds=len(seeds),
        tokens_per_pass=round(t.sum() / max(p.sum(), 1), 3),
        ci95=[round(lo, 3), round(hi, 3)],
        target_passes=int(p.sum()),
        lossless=lossless if temperature == 0 and refs[0] is not None else None,
        seconds=round(time.time() - t0, 1),
        per_prompt_tokens=tokens,
        per_prompt_passes=passes,
    )


class ReuseMeter:
    """How much of a pass's draft work the next pass could reuse (issue: reuse across passes).

    After acceptance the next root is the bonus token. If the draft had already put that token in
    the tree under the last accepted node, the subtree below it (the nodes the draft already ran
    there) could seed the next tree with its cache rows. Counts those run nodes against all run nodes.
    """

    def __init__(self):
        self.passes = self.hits = self.reusable = self.run = 0

    def install(self):
        import specexec_cli.core.engine as engine

        real = engine.commit_tree

        def commit(st, tree, vt, acc, n_pending):
            self.observe(tree, vt, acc)
            return real(st, tree, vt, acc, n_pending)

        engine.commit_tree = commit

    def observe(self, tree, vt, acc) -> None:
        self.passes += 1
        self.run += tree.n_slots - 1  # nodes the draft ran this pass (root excluded)
        if not acc.bonus:
            return
        last = int(vt.draft_ids[acc.path[-1]]) if acc.path else 0
        hit = ((tree.parents == last) & (tree.tokens == acc.tokens[-1])).nonzero()
        if hit.numel() == 0:
            return
        self.hits += 1
        inside = torch.zeros(tree.size, dtype=torch.bool)
        inside[int(hit[0, 0])] = True
        for i in range(int(hit[0, 0]) + 1, tree.size):  # parents precede children
            inside[i] = inside[int(tree.parents[i])]
        self.reusable += int((inside & (tree.slot >= 0)).sum())

    def report(self) -> dict:
        return dict(
            passes=self.passes,
            bonus_in_tree=round(self.hits / max(self.passes, 1), 3),
            reusable_run_nodes_per_pass=round(self.reusable / max(self.passes, 1), 2),
            run_nodes_per_pass=round(self.run / max(self.passes, 1), 2),
        )


def table(rows: list[dict]) -> str:
    """Markdown: one row per (T, budget), one column per method: tokens/pass [95% interval]."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out = []
    for key in dict.fromkeys((r["temperature"], r["budget"]) for r in rows):
        cells = {r["method"]: r for r in rows if (r["temperature"], r["budget"]) == key}
        fmt = [
            f"{c['tokens_per_pass']:.2f} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]" if (c := cells.get(m)) else ""
            for m in methods
        ]
        out.append([f"{key[0]:g}", key[1], *fmt])
    return md_table(["T", "budget", *methods], out)


def _command(data: dict) -> str:
    return f"`python bench/accept.py {' '.join(data['meta']['command'].split()[1:])}`"


def block(runs: dict | list[dict]) -> str:
    """The docs block of one run's JSON, or of several runs' (a sweep split across processes: one table,
    every command listed)."""
    if isinstance(runs, dict):
        meta = runs["meta"]
        return (
            f"{_command(runs)} — tokens per target pass, prompts {meta['prompts']} of prompts.jsonl, "
            f"{meta['max_new_tokens']} new tokens, 95% bootstrap interval over prompts:\n\n" + table(runs["rows"])
        )
    rows = sorted((r for data in runs for r in data["rows"]), key=lambda r: (r["temperature"], r["budget"]))
    lossless = all(r["lossless"] for r in rows if r["temperature"] == 0)
    return (
        "Tokens per target pass on the 8-layer pair, 95% bootstrap interval over prompts (at T > 0 "
        "a prompt's seeds stay together), from "
        + "; ".join(_command(data) for data in runs)
        + f". Every T=0 run equals the target's greedy `generate`: {lossless}.\n\n"
        + table(rows)
    )


def write_doc(body: str) -> None:
    import manifest  # bench/manifest.py: the block's pages

    manifest.write("accept", body)


def merged_table(files: list[str], readme: bool) -> None:
    """One table from several runs' JSON; with `readme` the docs block too."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    print(table(sorted((r for data in runs for r in data["rows"]), key=lambda r: (r["temperature"], r["budget"]))))
    if readme:
        write_doc(block(runs))


def save(args, rows: list[dict]) -> Path:
    """Write the JSON: the rows so far, the settings and what the calibration learned."""
    from specexec_cli.core import calibrate

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    learned = {k[2]: dict(rates=c.rates(), tests=[int(x) for x in c.tests]) for k, c in calibrate._PAIRS.items()}
    meta = dict(
        vars(args), dtype="fp32", device="cpu", torch=torch.__version__, command=" ".join(sys.argv), calibration=learned
    )
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="0:40", help="prompt index range a:b, or a count n (= 0:n)")
    ap.add_argument("--budgets", default="16,128,1024")
    ap.add_argument("--methods", default="specexec")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--seeds", type=int, default=3, help="runs per prompt at T > 0")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-depth", type=int, default=64)
    ap.add_argument("--max-beams", type=int, default=32)
    ap.add_argument("--max-branch", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=5, help="chain: draft tokens per pass")
    ap.add_argument("--scores", default=None, help="specexec node scores: calibrated+ngram | calibrated | draft")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the HF greedy comparison")
    ap.add_argument(
        "--readme",
        action="store_true",
        help="rewrite the acceptance block of the docs (bench/manifest.py) from this run",
    )
    ap.add_argument("--reuse", action="store_true", help="measure how much draft work the next pass could reuse")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "accept.json"))
    ap.add_argument(
        "--from-json",
        nargs="+",
        metavar="FILE",
        help="no decoding: merge the rows of earlier runs' JSON files into one table (with --readme)",
    )
    args = ap.parse_args()
    if args.from_json:
        return merged_table(args.from_json, args.readme)
    if not (SHARED / "models" / "target").exists():
        sys.exit("bench/accept.py needs ../shared/models (the trained pair); it is not present")
    models = load_models(
        LoadOptions(str(SHARED / "models/target"), str(SHARED / "models/draft"), dtype="fp32", device="cpu")
    )
    prompts = load_prompts(args.prompts)
    refs = [None] * len(prompts)
    if args.check and "0" in [f"{float(t):g}" for t in args.temperatures.split(",")]:
        refs = [
            models.target.generate(
                torch.tensor([ids := models.tokenizer(p)["input_ids"]]),
                do_sample=False,
                max_new_tokens=args.max_new_tokens,
            )[0, len(ids) :].tolist()
            for _, p in prompts
        ]
    meter = ReuseMeter() if args.reuse else None
    if meter:
        meter.install()
    rows, t0 = [], time.time()
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        for budget in [int(b) for b in args.budgets.split(",")]:
            for method in args.methods.split(","):
                if meter:
                    meter.__init__()
                r = run_cell(models, prompts, refs, method, budget, temperature, args)
                if meter:
                    r["reuse"] = meter.report()
                    print("  reuse:", r["reuse"])
                rows.append(r)
                save(args, rows)  # after every cell, so an interrupted sweep keeps what it measured
                print(
                    f"T={temperature:<4g} budget={budget:<5} {method:<10} tokens/pass={r['tokens_per_pass']:<6} "
                    f"95%=[{r['ci95'][0]}, {r['ci95'][1]}] lossless={r['lossless']}  [{time.time() - t0:.0f}s]",
                    flush=True,
                )
    out = save(args, rows)
    print("\n" + table(rows) + f"\n\nwrote {out}")
    if args.readme:
        write_doc(block(json.loads(out.read_text())))


if __name__ == "__main__":
    main()
