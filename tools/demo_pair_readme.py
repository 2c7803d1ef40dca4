"""The demo pair's README.md: how tools/make_demo_pair.py made it and what it measured.

Contract: `write_readme(out, info, eot, seq_len)` writes `out/README.md` from the `info` dict that
make_demo_pair.main builds (command, seed, corpus, vocab, training settings, quality, sizes), ending
with where the repository's docs/performance.md reports what specx measures with the pair.
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_readme(out: Path, info: dict, eot: str, seq_len: int) -> None:
    q, t, d = info["quality"], info["target"], info["draft"]
    lines = [
        "# Embedded demo pair (target + draft)",
        "",
        "Tiny Llama-architecture models trained from scratch on the Python standard",
        "library so that `specx run` works offline out of the box. They write",
        "stdlib-flavoured Python and are **not** useful for anything else.",
        "",
        "## How it was made",
        "",
        f"Command (run from the repo root): `{info['command']}`",
        "",
        f"- seed: {info['seed']}; torch {torch.__version__}, {info['threads']} CPU threads",
        f"- corpus: {info['corpus']}",
        f"- tokenizer: byte-level BPE, vocab {info['vocab']}, `{eot}` = BOS/EOS/PAD (identical files in both dirs)",
        "- training: AdamW (0.9, 0.95, wd 0.1), warmup + cosine driven by the used fraction",
        "  of a budget in CPU-seconds per thread (capped in wall time; the machine was",
        "  shared with other jobs, so wall time exceeds CPU budget),",
        f"   seq len {seq_len}, batch {info['batch']}, peak lr {info['lrs']}.",
        f"- draft objective: {info['draft_obj']}.",
        "- with --target-steps/--draft-steps the step counts are fixed; time-limited loops",
        "  (the --*-minutes budgets) give a similar but not bit-identical pair.",
        "",
        "| model | params | layers x hidden | steps | train tokens | wall time | CPU time | size on disk |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in (("target", t), ("draft", d)):
        lines.append(
            f"| {name} | {m['params']:,} | {m['shape']} | {m['steps']} | "
            f"{m['tokens']:,} | {m['seconds']:.0f} s | {m['cpu_seconds']:.0f} s | "
            f"{m['mb']:.2f} MB |"
        )
    lines += [
        "",
        "Weights stored as bf16 safetensors (`config.dtype = bfloat16`).",
        "",
        "## Measured quality (held-out stdlib files, bf16 weights reloaded as fp32)",
        "",
        f"- held-out tokens evaluated: {q['eval_tokens']:,}",
        f"- target teacher-forced loss: {q['target_loss']:.3f} nats/token",
        f"- draft teacher-forced loss: {q['draft_loss']:.3f} nats/token",
        f"- draft top-1 agreement with target: {100 * q['top1_agreement']:.1f}%",
        "",
    ]
    if info.get("sample"):
        smp = info["sample"]
        lines += [
            "## Greedy 64-token continuation of `examples/prompt.txt` (target, fp32)",
            "",
            f"{100 * smp['nonblank_fraction']:.0f}% of its {smp['lines']} lines are non-blank:",
            "",
            "```python",
            smp["text"].rstrip("\n"),
            "```",
            "",
        ]
    lines += [
        "What specx measures with this pair (tokens per target pass, the budget it picks): the repository's",
        '`docs/performance.md`, section "The embedded demo pair".',
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))
