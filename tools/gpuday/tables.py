"""`gpu_day.py tables`: docs/gpu-status.md's tables from a run's --out (its summary.json).

Contract: `render(summary)` -> {block name: markdown table}; the blocks are TABLES (card, passes,
draft, demo, tests). `main(out, write)` prints them, or with --write replaces each block between
`<!-- gpuday:NAME -->` and `<!-- /gpuday:NAME -->` in that markdown file (a block the file lacks is
an error, exit 2). Every measured figure is printed beside passcost's prediction for it and their
ratio (measured / modelled); a phase that has not run or failed renders as one line saying so.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TABLES = ("card", "passes", "draft", "demo", "tests")


def _ms(s: float) -> str:
    return f"{1000 * s:.2f}" if s < 1 else f"{1000 * s:.0f}"


def _phase(summary: dict, name: str) -> dict | None:
    rec = summary.get("phases", {}).get(name)
    return rec["data"] if rec and rec.get("ok") else None


def _missing(summary: dict, name: str) -> str:
    rec = summary.get("phases", {}).get(name)
    return f"*{name}: {'failed: ' + rec['error'] if rec else 'not run yet'}*"


def card(summary: dict) -> str:
    p = _phase(summary, "probe")
    if p is None:
        return _missing(summary, "probe")
    e = _phase(summary, "env") or {}
    return (
        "| device | torch | pinned host->device GB/s | device memory GB/s (copy, r+w) | bf16 TFLOP/s | "
        "fp32 TFLOP/s (TF32 off) |\n|---|---|---|---|---|---|\n"
        f"| {p['device']} | {e.get('torch', '?')} | {p['link_bps'] / 1e9:.1f} | {p['memory_bps'] / 1e9:.0f} | "
        f"{p['bf16_flops'] / 1e12:.0f} | {p['fp32_flops'] / 1e12:.1f} |"
    )


def passes(summary: dict) -> str:
    fmts = [(f, _phase(summary, f"passes-{f}")) for f in ("bf16", "nf4", "q4k")]
    done = [(f, d) for f, d in fmts if d]
    if not done:
        return _missing(summary, "passes-bf16")
    first = done[0][1]
    head = "| n | " + " | ".join(f"{f} measured ms | {f} modelled ms | x" for f, _ in done) + " |"
    lines = [
        f"{first['layers']} layers streamed from pinned RAM, tree over {first['past']} cached tokens; "
        "modelled: offload/planning/passcost.py with the card's measured rates.",
        "",
        head,
        "|---|" + "---|---|---|" * len(done),
    ]
    by_n = {f: {r["n"]: r for r in d["rows"]} for f, d in done}
    for n in sorted(by_n[done[0][0]]):
        cells = []
        for f, _ in done:
            r = by_n[f].get(n)
            ratio = f"{r['seconds'] / r['predicted']['seconds']:.2f}" if r else ""
            cells += [_ms(r["seconds"]), _ms(r["predicted"]["seconds"]), ratio] if r else ["", "", ""]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [""] + [_missing(summary, f"passes-{f}") for f, d in fmts if not d]
    return "\n".join(lines).rstrip()


def draft(summary: dict) -> str:
    d = _phase(summary, "draft")
    if d is None:
        return _missing(summary, "draft")
    lines = ["| draft | b tokens | measured ms | modelled ms | x |", "|---|---|---|---|---|"]
    for r in d["small"]["rows"]:
        lines.append(
            f"| 1B-shaped bf16, whole forward | {r['b']} | {_ms(r['seconds'])} | "
            f"{_ms(r['predicted']['seconds'])} | {r['seconds'] / r['predicted']['seconds']:.2f} |"
        )
    for bits, sub in d["substitutes"].items():
        for r in sub["rows"]:
            lines.append(
                f"| {bits}-bit substitute ({sub['kernel']}), one 70B layer's linears | {r['b']} | "
                f"{_ms(r['seconds'])} | {_ms(r['predicted']['seconds'])} | "
                f"{r['seconds'] / r['predicted']['seconds']:.2f} |"
            )
    return "\n".join(lines)


def demo(summary: dict) -> str:
    d = _phase(summary, "demo")
    if d is None:
        return _missing(summary, "demo")
    s = d["serve"]
    return (
        "| T = 0 specexec ids == ar | tokens per pass (budget "
        f"{d['budget']}) | prior (draftcost) | served request |\n|---|---|---|---|\n"
        f"| {'yes' if d['equal'] else 'NO'} | {d['tokens_per_pass']:.2f} | {d['predicted_tokens_per_pass']:.2f} | "
        f"HTTP {s['status']}, {s['completion_tokens']} tokens |"
    )


def tests(summary: dict) -> str:
    rec = summary.get("phases", {}).get("cuda-tests")
    if rec is None or rec.get("data") is None:
        return _missing(summary, "cuda-tests")
    d = rec["data"]
    lines = ["| test | result | seconds |", "|---|---|---|"]
    lines += [
        f"| `{c['name']}` | {c['status']}{': ' + c['detail'] if c['detail'] else ''} | {c['seconds']:.1f} |"
        for c in d["cases"]
    ]
    return "\n".join(lines)


def render(summary: dict) -> dict[str, str]:
    return {
        "card": card(summary),
        "passes": passes(summary),
        "draft": draft(summary),
        "demo": demo(summary),
        "tests": tests(summary),
    }


def replace_blocks(text: str, blocks: dict[str, str]) -> str:
    for name, body in blocks.items():
        pat = re.compile(rf"(<!-- gpuday:{name} -->\n).*?(\n<!-- /gpuday:{name} -->)", re.S)
        if not pat.search(text):
            raise KeyError(name)
        text = pat.sub(lambda m: m.group(1) + body + m.group(2), text)
    return text


def main(out: Path, write: Path | None) -> int:
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError) as e:
        print(
            f"gpu_day tables: no readable {out / 'summary.json'} ({e}); run `gpu_day.py run --out {out}` first",
            file=sys.stderr,
        )
        return 2
    blocks = render(summary)
    if write is None:
        for name, body in blocks.items():
            print(f"## {name}\n\n{body}\n")
        return 0
    try:
        write.write_text(replace_blocks(write.read_text(), blocks))
    except KeyError as e:
        print(f"gpu_day tables: {write} has no <!-- gpuday:{e.args[0]} --> block", file=sys.stderr)
        return 2
    print(f"wrote {len(blocks)} tables into {write}")
    return 0
