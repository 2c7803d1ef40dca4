"""End-to-end peers, side by side, on one disk-tier target: HF + accelerate vs specx.  Run by hand.

Contract: one process loads the target twice from the same checkpoint -- once as HF transformers
with accelerate disk offload (every decoder layer on "disk", the rest on the CPU), once as specx's
`OffloadedCausalLM` in the disk tier (`--offload disk --max-ram 0`: every layer read with O_DIRECT
on every pass) -- plus the draft, then decodes each prompt with every method, round-robin with a
rotating start, so the 2x disk-speed drift of these machines hits every method alike:
  hf-generate     HF `generate`, greedy (accelerate's disk offload reads the weights each forward)
  hf-assisted     HF assisted generation, greedy, `assistant_model=` the draft
  specx-ar        specx plain decoding (the speed baseline)
  specx-specexec  SpecExec at `--budget auto` (a fresh BudgetTuner per prompt, as `specx run`)
                  and at each fixed --budgets value
The page cache is dropped for the checkpoint's files (posix_fadvise DONTNEED) before every HF
forward, so HF reads the disk too, as specx's O_DIRECT reads do; kernel-counted read bytes per
target forward are reported for both to show it.
Rate = tokens emitted after the first target pass ÷ wall time after it (the prefill, and for
hf-assisted its first verification pass, are excluded alike). All runs are greedy and every
method's ids are checked against specx-ar's (`lossless`). Ratios reported:
  specexec_auto ÷ (its tokens/pass × ar tok/s)  (the step-cost check, target >= 0.90)
  specexec_auto ÷ hf-assisted                  (target >= 3)
Writes JSON (--out/e2e.json), prints a markdown table, and a bar plot if matplotlib is present.

    python bench/e2e.py --target /tmp/target-xl \
        --draft ../shared/models/draft --num-prompts 3 --max-new-tokens 16 --budgets 15,63
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHARED = Path(__file__).resolve().parents[2] / "shared"


def kernel_read_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def drop_page_cache(paths: list[Path]) -> None:
    """Evict the files' clean pages so the next read goes to the disk (best effort)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Timeline:
    """StoppingCriteria that timestamps every HF decoding step (never stops anything)."""

    def __init__(self):
        self.points: list[tuple[float, int]] = []  # (perf_counter, sequence length) per step

    def __call__(self, input_ids, scores=None, **kwargs):
        self.points.append((time.perf_counter(), input_ids.shape[-1]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load_hf_disk(target: Path, dtype: torch.dtype, offload_dir: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    n = AutoConfig.from_pretrained(target).num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" for i in range(n)})
    model = AutoModelForCausalLM.from_pretrained(
        target, dtype=dtype, device_map=device_map, offload_folder=offload_dir
    ).eval()
    files = [*target.glob("*.safetensors"), *Path(offload_dir).rglob("*")]
    model.register_forward_pre_hook(lambda mod, args: drop_page_cache([f for f in files if f.is_file()]))
    return model, files


def run_hf(model, draft, ids: list[int], max_new: int, eos: list[int]) -> dict:
    from transformers import StoppingCriteriaList

    tl = Timeline()
    inp = torch.tensor([ids])
    kw = dict(
        max_new_tokens=max_new,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList([tl]),
        eos_token_id=eos,
        pad_token_id=eos[0],
        attention_mask=torch.ones_like(inp),
    )
    if draft is not None:
        kw["assistant_model"] = draft
    passes0 = model.forward_calls
    b0 = kernel_read_bytes()
    with torch.no_grad():
        out = model.generate(inp, **kw)[0, len(ids) :].tolist()
    passes = model.forward_calls - passes0
    (t_first, len_first), (t_last, len_last) = tl.points[0], tl.points[-1]
    return dict(
        token_ids=out,
        tokens_after_first=len_last - len_first,
        seconds_after_first=t_last - t_first,
        target_passes=passes,
        read_bytes=kernel_read_bytes() - b0,
    )


def run_specx(models, ids: list[int], max_new: int, budget: str) -> dict:
    from specexec_cli.core.budget import make_tuner
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import DecodeState, GenerationConfig, generate
    from specexec_cli.core.stats import LinkMeter, RunStats
    from specexec_cli.session.profiles import find_profile

    method = "ar" if budget == "ar" else "specexec"
    shape = TreeShape(budget=64 if budget in ("ar", "auto") else int(budget), max_depth=64)
    cfg = GenerationConfig(method=method, shape=shape, max_new_tokens=max_new)
    tuner = make_tuner(find_profile(None), shape, False) if budget == "auto" else None
    stats, meter = RunStats(), LinkMeter(models.target)
    b0, p0 = kernel_read_bytes(), models.target.stats.passes
    events = tuner.drive(models, DecodeState(), ids, cfg) if tuner else generate(models, DecodeState(), ids, cfg)
    for ev in events:
        stats.add(ev)
        meter.step(stats, ev)
    return dict(
        token_ids=stats.token_ids,
        tokens_after_first=stats.new_tokens - 1,
        seconds_after_first=stats.decode_seconds,
        target_passes=models.target.stats.passes - p0,
        decode_passes=stats.target_passes,
        tokens_per_pass=stats.tokens_per_pass,
        mean_tree_size=sum(stats.tree_sizes) / max(1, len(stats.tree_sizes)),
        link_busy_fraction=stats.link_busy_fraction,
        stall_seconds=sum(stats.stall),
        draft_seconds=stats.draft_seconds,
        read_bytes=kernel_read_bytes() - b0,
    )


def summarise(name: str, runs: list[dict], ref: list[list[int]]) -> dict:
    tokens = sum(r["tokens_after_first"] for r in runs)
    secs = sum(r["seconds_after_first"] for r in runs)
    rec = dict(
        method=name,
        prompts=len(runs),
        tokens=tokens,
        seconds=round(secs, 3),
        tok_s=round(tokens / secs, 4) if secs > 0 else 0.0,
        target_passes=sum(r["target_passes"] for r in runs),
        read_gb_per_pass=round(
            sum(r["read_bytes"] for r in runs) / max(1, sum(r["target_passes"] for r in runs)) / 1e9, 4
        ),
        lossless=all(
            r["token_ids"] == want[: len(r["token_ids"])] and len(r["token_ids"]) == len(want)
            for r, want in zip(runs, ref)
        ),
    )
    if "decode_passes" in runs[0]:
        passes = sum(r["decode_passes"] for r in runs)
        rec.update(
            tokens_per_pass=round(sum(r["tokens_per_pass"] * r["decode_passes"] for r in runs) / max(1, passes), 3),
            mean_tree_size=round(sum(r["mean_tree_size"] for r in runs) / len(runs), 1),
            link_busy_fraction=round(sum(r["link_busy_fraction"] for r in runs) / len(runs), 3),
            stall_seconds=round(sum(r["stall_seconds"] for r in runs), 2),
            draft_seconds=round(sum(r["draft_seconds"] for r in runs), 2),
        )
    return rec


def load_prompts(tokenizer, path: Path, n: int, index: str, max_prompt: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pick = [int(i) for i in index.split(",")][:n]
    return [tokenizer(rows[i]["prompt"])["input_ids"][-max_prompt:] for i in pick]


def count_forwards(model) -> None:
    model.forward_calls = 0

    def hook(mod, args):
        mod.forward_calls += 1

    model.register_forward_pre_hook(hook)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="/tmp/target-xl")
    ap.add_argument("--draft", default=str(SHARED / "models" / "draft"))
    ap.add_argument("--prompts", default=str(SHARED / "bench" / "prompts.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument(
        "--prompt-index",
        default="1,4,5,10,11,12,13",
        help="lines of --prompts to use (the shared target ends most others at EOS at once)",
    )
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--budgets", default="15,63", help="fixed SpecExec budgets besides auto")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--methods", default="hf-generate,hf-assisted,specx-ar,specx-specexec")
    ap.add_argument("--out", default="bench_e2e")
    args = ap.parse_args()
    from specexec_cli.session.loading import LoadOptions, load_models

    torch.set_grad_enabled(False)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    models = load_models(
        LoadOptions(
            target=args.target,
            draft=args.draft,
            dtype=args.dtype,
            device="cpu",
            offload="disk",
            max_ram=0,
            max_gpu_memory=0,
        )
    )
    print(models.target.plan.describe(), f"read-ahead ring {models.target.store.host_slots} layers", flush=True)
    count_forwards(models.target)
    wanted = args.methods.split(",")
    cells = [m for m in ("hf-generate", "hf-assisted") if m in wanted]
    if "specx-ar" in wanted or "specx-specexec" in wanted:
        cells.append("specx-ar")  # the reference ids and the ar rate
    if "specx-specexec" in wanted:
        cells += ["specexec@auto"] + [f"specexec@{b}" for b in args.budgets.split(",") if b]
    offload_dir = tempfile.mkdtemp(prefix="e2e-hf-offload-")
    hf = None
    if any(c.startswith("hf-") for c in cells):
        hf, _ = load_hf_disk(Path(args.target), dtype, offload_dir)
        count_forwards(hf)
    prompts = load_prompts(
        models.tokenizer, Path(args.prompts), args.num_prompts, args.prompt_index, args.max_prompt_tokens
    )
    eos = sorted(models.eos_ids)
    run_specx(models, prompts[0][:16], 2, "ar")  # untimed warm-up (threads, kernels)
    runs: dict[str, list[dict]] = {c: [] for c in cells}
    for i, ids in enumerate(prompts):
        for c in cells[i % len(cells) :] + cells[: i % len(cells)]:
            t0 = time.perf_counter()
            if c.startswith("hf-"):
                r = run_hf(hf, models.draft if c == "hf-assisted" else None, ids, args.max_new_tokens, eos)
            else:
                r = run_specx(models, ids, args.max_new_tokens, "ar" if c == "specx-ar" else c.split("@")[1])
            runs[c].append(r)
            print(
                f"prompt {i + 1}/{len(prompts)} {c:<16} {r['tokens_after_first']:>3} tok "
                f"{r['seconds_after_first']:7.1f}s  ({time.perf_counter() - t0:.0f}s wall)",
                flush=True,
            )
    layer_bytes = sum(sl.nbytes for d in models.target.store.disk.values() for sl in d.raw.slices.values())
    report(runs, args, layer_bytes)
    models.target.close()


def report(runs: dict[str, list[dict]], args, layer_bytes: int) -> None:
    ref_name = "specx-ar" if "specx-ar" in runs else next(iter(runs))
    ref = [r["token_ids"] for r in runs[ref_name]]
    recs = [summarise(name, rs, ref) for name, rs in runs.items()]
    by = {r["method"]: r for r in recs}
    ratios = {}
    auto, ar, hfa = by.get("specexec@auto"), by.get("specx-ar"), by.get("hf-assisted")
    if auto and ar and ar["tok_s"]:
        ratios["auto_vs_tpp_times_ar"] = round(auto["tok_s"] / (auto["tokens_per_pass"] * ar["tok_s"]), 3)
    for r in recs:
        if ar and ar["tok_s"]:
            r["x_ar"] = round(r["tok_s"] / ar["tok_s"], 2)
        if hfa and hfa["tok_s"]:
            r["x_hf_assisted"] = round(r["tok_s"] / hfa["tok_s"], 2)
    if auto and hfa and hfa["tok_s"]:
        ratios["auto_vs_hf_assisted"] = round(auto["tok_s"] / hfa["tok_s"], 2)
    ratios["layer_gb_per_pass"] = round(layer_bytes / 1e9, 4)  # compare with read_gb_per_pass
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(dict(args=vars(args), records=recs, ratios=ratios, runs=runs), indent=1))
    lines = [
        "| method | tokens | tok/s | × ar | × hf-assisted | tokens/pass | tree | link busy | GB read/pass | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        lines.append(
            f"| {r['method']} | {r['tokens']} | {r['tok_s']:.3f} | {r.get('x_ar', '')} | "
            f"{r.get('x_hf_assisted', '')} | {r.get('tokens_per_pass', '')} | {r.get('mean_tree_size', '')} | "
            f"{r.get('link_busy_fraction', '')} | {r['read_gb_per_pass']} | {r['lossless']} |"
        )
    table = "\n".join(lines)
    (out / "e2e.md").write_text(table + "\n\n" + json.dumps(ratios) + "\n")
    print(table)
    print("ratios:", json.dumps(ratios))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar([r["method"] for r in recs], [r["tok_s"] for r in recs])
        ax.set_ylabel("tokens / s")
        ax.set_title("disk-tier target, greedy, interleaved")
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
        fig.tight_layout()
        fig.savefig(out / "e2e.png", dpi=120)
        print(f"wrote {out / 'e2e.png'}")
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[plot]')")
    print(f"wrote {out / 'e2e.json'}, {out / 'e2e.md'}")


if __name__ == "__main__":
    main()
