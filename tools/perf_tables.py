"""Regenerate the measured tables of README.md and docs/ from the JSON in bench/results/.

Contract: every `<!-- perf:NAME -->` … `<!-- /perf:NAME -->` block in the files of `FILES` is replaced
by `TABLES[NAME]()`, a markdown table computed from bench/results/ alone (an unknown NAME or an
unclosed block is an error, exit 2). Tables: `headline` (SmolLM2-135M-Instruct streamed from disk,
bench/spec_pass.py: --method ar and the 3-bit self-draft by budget, tokens per target pass, tok/s
against --method ar in the same run), `pair-headline` (the development pair: tokens per target pass of the
2.9M-parameter draft and the self-draft widths at budget 1024, T = 0 and 0.7), `selfdraft` (the full self-draft
table of the trained pair, from tools/selfdraft_table.py), `selfdraft-xl` (the
16-layer disk-tier target), `serve`, `serve-turns` and `serve-cache` (bench/serve.py), `serve-parallel`,
`serve-parallel-xl`, `serve-parallel-xl-auto`, `serve-parallel-xl-even` and `serve-parallel-xl-8`
(bench/serve_parallel.py: the 8-layer pair, then the 16-layer target with whole prompts, with short
prompts under --budget auto and under an even split of --budget 16, and 8 requests at once). `--check` writes nothing
and exits 1 naming the files whose tables differ from the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FILES = ["README.md", "docs/performance.md", "docs/self-draft.md", "CONTRIBUTING.md"]
BLOCK = re.compile(r"<!-- perf:([a-z0-9-]+) -->\n(.*?)<!-- /perf:\1 -->", re.S)
OPEN = re.compile(r"<!-- perf:([a-z0-9-]+) -->")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import selfdraft_table  # noqa: E402  (tools/ is not a package)


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


REAL = {
    "none (ar)": "none (`--method ar`)",
    "self-hqq3": "`--draft self --draft-bits 3` (HQQ)",
    "self-hqq2": "`--draft self --draft-bits 2` (HQQ)",
}


def headline() -> str:
    """SmolLM2 streamed from disk (bench/spec_pass.py): --method ar, specx's own choice (no draft flags)
    and the 3-bit self-draft at each budget,
    tokens per target pass, tok/s and its ratio to --method ar's in the same run, and whether the T = 0 ids
    equal --method ar's."""
    rows = [r for r in load("spec_pass.json")["rows"] if r["tier"] == "disk"]
    groups: dict = {}
    for r in rows:
        groups.setdefault(r["config"], []).append(r)

    def rate(rs):  # total tokens over total decode seconds
        return sum(len(r["token_ids"]) for r in rs) / sum(len(r["token_ids"]) / r["tokens_per_second"] for r in rs)

    ar = rate(groups["ar"])
    lines = [
        "| decoding | tokens per target pass | tok/s (this CPU) | x `--method ar` | ids equal `--method ar` |",
        "|---|---|---|---|---|",
    ]
    for config, rs in groups.items():
        name = (
            "`--method ar`"
            if config == "ar"
            else "no draft flags (specx's own choice)"
            if config == "default"
            else f"`--draft self --draft-bits 3 --budget {config.split('b')[-1]}`"
        )
        tpp = sum(r["tokens_per_pass"] for r in rs) / len(rs)
        same = "-" if config == "ar" else ("yes" if all(r["ids_equal_ar"] for r in rs) else "NO")
        lines.append(f"| {name} | {tpp:.2f} | {rate(rs):.1f} | {rate(rs) / ar:.2f}x | {same} |")
    return "\n".join(lines)


def pair_headline() -> str:
    """The development pair: one row per draft, tokens per pass at budget 1024, T = 0 and 0.7, against the 2.9M-parameter draft."""
    cells = {(r["draft"], r["temperature"]): r for r in selfdraft_table.rows() if r["budget"] == 1024}
    lines = [
        "| draft | tokens per target pass, T = 0 | x 2.9M draft | T = 0.7 | x 2.9M draft | T = 0 ids equal `--method ar` |",
        "|---|---|---|---|---|---|",
    ]
    for draft in ("shared-2.9M", "self-nf4", "self-hqq3", "self-hqq2"):
        g, s = cells.get((draft, 0.0)), cells.get((draft, 0.7))
        if g is None or s is None:
            continue
        g0, s0 = cells[("shared-2.9M", 0.0)], cells[("shared-2.9M", 0.7)]
        name = selfdraft_table.NAMES[draft]
        lines.append(
            f"| {name} | {g['tokens_per_pass']:.2f} | {g['tokens_per_pass'] / g0['tokens_per_pass']:.1f}x | "
            f"{s['tokens_per_pass']:.2f} | {s['tokens_per_pass'] / s0['tokens_per_pass']:.1f}x | "
            f"{'yes' if g['lossless'] else 'NO'} |"
        )
    return "\n".join(lines)


def selfdraft_xl() -> str:
    rows = sorted(load("selfdraft_xl.json")["rows"], key=lambda r: (r["budget"], r["draft"] != "shared-2.9M"))
    lines = ["| budget | draft | tokens per target pass [95%] | tok/s (this CPU) |", "|---|---|---|---|"]
    for r in rows:
        lo, hi = r["ci95"]
        lines.append(
            f"| {r['budget']} | {selfdraft_table.NAMES[r['draft']]} | {r['tokens_per_pass']:.2f} "
            f"[{lo:.2f}, {hi:.2f}] | {r['tokens_per_second']:.2f} |"
        )
    return "\n".join(lines)


def serve() -> str:
    s = load("serve/serve.json")["summary"]
    return "\n".join(
        [
            "| prompts timed | `specx run` tok/s | server tok/s (`openai` client, streamed) | server ÷ run | server engine tok/s | time to first token | every reply equals `specx run` |",
            "|---|---|---|---|---|---|---|",
            f"| {s['prompts_timed']} | {s['run_tok_s']:.1f} | {s['serve_tok_s']:.1f} | {s['ratio']:.2f} | "
            f"{s['serve_engine_tok_s']:.1f} | {s['ttft_s']:.3f} s | {'yes' if s['all_same_text'] else 'NO'} |",
        ]
    )


def serve_turns() -> str:
    t = load("serve/serve.json")["summary"]["turn_prefill"]
    lines = ["| turn | prefill tokens, prefix reused | prefill tokens, caches evicted |", "|---|---|---|"]
    lines += [f"| {i} | {a} | {b} |" for i, (a, b) in enumerate(zip(t["reuse"], t["no_reuse"]), 1)]
    return "\n".join(lines)


def serve_cache() -> str:
    """bench/serve.py --background: turns 2-5 of a conversation with the prompt cache and with one entry."""
    s = load("serve/cache.json")["summary"]
    c, o = s["cache"], s["one_entry"]
    return "\n".join(
        [
            "| turns 2-5 | prompt cache | one entry (`--cache-ram 0`) |",
            "|---|---|---|",
            f"| prompt tokens not prefilled | {c['cached_fraction_turns_2_5']:.0%} | {o['cached_fraction_turns_2_5']:.0%} |",
            f"| time to first token, summed | {c['ttft_s_turns_2_5']:.2f} s | {o['ttft_s_turns_2_5']:.2f} s |",
            f"| server prefill seconds, summed | {c['prefill_s_turns_2_5']:.2f} s | {o['prefill_s_turns_2_5']:.2f} s |",
            f"| turn time, summed | {c['turn_s_turns_2_5']:.2f} s | {o['turn_s_turns_2_5']:.2f} s |",
            f"| replies the same on both servers | {'yes' if s['same_replies'] else 'NO'} | |",
        ]
    )


def serve_parallel(name: str = "serve/parallel.json") -> str:
    """bench/serve_parallel.py's own table: k requests at once under --parallel 1 and --parallel p."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_parallel", ROOT / "bench" / "serve_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.table(load(name))


TABLES = {
    "headline": headline,
    "pair-headline": pair_headline,
    "selfdraft": selfdraft_table.table,
    "selfdraft-xl": selfdraft_xl,
    "serve": serve,
    "serve-turns": serve_turns,
    "serve-cache": serve_cache,
    "serve-parallel": serve_parallel,
    "serve-parallel-xl": lambda: serve_parallel("serve/parallel_xl.json"),
    "serve-parallel-xl-auto": lambda: serve_parallel("serve/parallel_xl_decode_auto.json"),
    "serve-parallel-xl-even": lambda: serve_parallel("serve/parallel_xl_decode_16.json"),
    "serve-parallel-xl-8": lambda: serve_parallel("serve/parallel_xl_decode_8.json"),
}


def render(text: str) -> str:
    """`text` with every perf block regenerated; ValueError on an unknown or unclosed block."""
    names = OPEN.findall(text)
    closed = [m.group(1) for m in BLOCK.finditer(text)]
    if names != closed:
        raise ValueError(f"unclosed perf block(s): {sorted(set(names) - set(closed)) or names}")
    unknown = sorted(set(names) - set(TABLES))
    if unknown:
        raise ValueError(f"unknown perf table(s) {unknown}; known: {sorted(TABLES)}")
    return BLOCK.sub(lambda m: f"<!-- perf:{m.group(1)} -->\n{TABLES[m.group(1)]()}\n<!-- /perf:{m.group(1)} -->", text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a table differs from its JSON")
    args = ap.parse_args(argv)
    stale = []
    for rel in FILES:
        path = ROOT / rel
        if not path.exists():
            continue
        text = path.read_text()
        try:
            new = render(text)
        except ValueError as exc:
            print(f"{rel}: {exc}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(rel)
            if not args.check:
                path.write_text(new)
    if args.check:
        print(
            "perf tables are up to date"
            if not stale
            else f"out of date: {', '.join(stale)}; run python tools/perf_tables.py"
        )
        return int(bool(stale))
    print(f"updated {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
