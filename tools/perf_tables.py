"""Regenerate every measured table of README.md, CONTRIBUTING.md and docs/ from the JSON in bench/results/.

Contract: for every block of bench/manifest.py whose renderer is pure and whose page text is
reproducible, `<!-- bench:NAME -->` ... `<!-- /bench:NAME -->` on each of its pages is replaced by the
renderer's table of the block's saved JSON (bench/docblock.py writes it); names given on the command
line limit it to those blocks. `--check` writes nothing and exits 1 naming the pages whose tables
differ from the JSON; a missing or doubled block is an error (exit 2). The renderers of the tables
no benchmark script renders itself live here, each a function of the JSON alone: `headline`
(SmolLM2 streamed from disk, bench/spec_pass.py: --method ar, specx's own choice and the 3-bit
self-draft by budget), `pair_headline` (the development pair's drafts at budget 1024, T = 0 and 0.7),
`selfdraft_xl` (the 16-layer disk-tier target) and `serve`, `serve_turns`, `serve_cache`
(bench/serve.py); the full self-draft table is tools/selfdraft_table.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
import manifest  # noqa: E402  (bench/manifest.py)
import selfdraft_table  # noqa: E402  (tools/ is not a package)
from docblock import md_table, replace_block  # noqa: E402  (bench/docblock.py)


def _rate(rs: list[dict]) -> float:
    """Total tokens over total decode seconds of some runs."""
    return sum(len(r["token_ids"]) for r in rs) / sum(len(r["token_ids"]) / r["tokens_per_second"] for r in rs)


def headline(data: dict) -> str:
    """SmolLM2 streamed from disk (bench/spec_pass.py): --method ar, specx's own choice (no draft flags)
    and the 3-bit self-draft at each budget, tokens per target pass, tok/s and its ratio to --method
    ar's in the same run, and whether the T = 0 ids equal --method ar's."""
    groups: dict = {}
    for r in data["rows"]:
        if r["tier"] == "disk":
            groups.setdefault(r["config"], []).append(r)
    ar = _rate(groups["ar"])
    rows = []
    for config, rs in groups.items():
        if config in ("ar", "default"):
            name = "`--method ar`" if config == "ar" else "no draft flags (specx's own choice)"
        else:
            name = f"`--draft self --draft-bits 3 --budget {config.split('b')[-1]}`"
        tpp = sum(r["tokens_per_pass"] for r in rs) / len(rs)
        same = "-" if config == "ar" else ("yes" if all(r["ids_equal_ar"] for r in rs) else "NO")
        rows.append([name, f"{tpp:.2f}", f"{_rate(rs):.1f}", f"{_rate(rs) / ar:.2f}x", same])
    head = ["decoding", "tokens per target pass", "tok/s (this CPU)", "x `--method ar`", "ids equal `--method ar`"]
    return md_table(head, rows)


def pair_headline(runs: list[dict]) -> str:
    """The development pair: one row per draft, tokens per pass at budget 1024, T = 0 and 0.7, against the
    2.9M-parameter draft's."""
    cells = {(r["draft"], r["temperature"]): r for r in selfdraft_table.rows(runs) if r["budget"] == 1024}
    g0, s0 = cells[("shared-2.9M", 0.0)], cells[("shared-2.9M", 0.7)]
    rows = []
    for draft in ("shared-2.9M", "self-nf4", "self-hqq3", "self-hqq2"):
        g, s = cells.get((draft, 0.0)), cells.get((draft, 0.7))
        if g is None or s is None:
            continue
        rows.append(
            [
                selfdraft_table.NAMES[draft],
                f"{g['tokens_per_pass']:.2f}",
                f"{g['tokens_per_pass'] / g0['tokens_per_pass']:.1f}x",
                f"{s['tokens_per_pass']:.2f}",
                f"{s['tokens_per_pass'] / s0['tokens_per_pass']:.1f}x",
                "yes" if g["lossless"] else "NO",
            ]
        )
    head = ["draft", "tokens per target pass, T = 0", "x 2.9M draft", "T = 0.7", "x 2.9M draft"]
    return md_table(head + ["T = 0 ids equal `--method ar`"], rows)


def selfdraft_xl(data: dict) -> str:
    """The 16-layer target: tokens per pass [95%] and tok/s per budget and draft."""
    rows = sorted(data["rows"], key=lambda r: (r["budget"], r["draft"] != "shared-2.9M"))
    return md_table(
        ["budget", "draft", "tokens per target pass [95%]", "tok/s (this CPU)"],
        [
            [
                r["budget"],
                selfdraft_table.NAMES[r["draft"]],
                f"{r['tokens_per_pass']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]",
                f"{r['tokens_per_second']:.2f}",
            ]
            for r in rows
        ],
    )


def serve(data: dict) -> str:
    """bench/serve.py: `specx run` against the server as the streaming `openai` client sees it."""
    s = data["summary"]
    head = ["prompts timed", "`specx run` tok/s", "server tok/s (`openai` client, streamed)", "server ÷ run"]
    head += ["server engine tok/s", "time to first token", "every reply equals `specx run`"]
    row = [s["prompts_timed"], f"{s['run_tok_s']:.1f}", f"{s['serve_tok_s']:.1f}", f"{s['ratio']:.2f}"]
    row += [f"{s['serve_engine_tok_s']:.1f}", f"{s['ttft_s']:.3f} s", "yes" if s["all_same_text"] else "NO"]
    return md_table(head, [row])


def serve_turns(data: dict) -> str:
    """bench/serve.py: prefill tokens per turn of a conversation, prefix reused against caches evicted."""
    t = data["summary"]["turn_prefill"]
    return md_table(
        ["turn", "prefill tokens, prefix reused", "prefill tokens, caches evicted"],
        [[i, a, b] for i, (a, b) in enumerate(zip(t["reuse"], t["no_reuse"]), 1)],
    )


def serve_cache(data: dict) -> str:
    """bench/serve.py --background: turns 2-5 of a conversation with the prompt cache and with one entry."""
    s = data["summary"]
    c, o = s["cache"], s["one_entry"]
    rows = [
        [
            "prompt tokens not prefilled",
            f"{c['cached_fraction_turns_2_5']:.0%}",
            f"{o['cached_fraction_turns_2_5']:.0%}",
        ],
        ["time to first token, summed", f"{c['ttft_s_turns_2_5']:.2f} s", f"{o['ttft_s_turns_2_5']:.2f} s"],
        ["server prefill seconds, summed", f"{c['prefill_s_turns_2_5']:.2f} s", f"{o['prefill_s_turns_2_5']:.2f} s"],
        ["turn time, summed", f"{c['turn_s_turns_2_5']:.2f} s", f"{o['turn_s_turns_2_5']:.2f} s"],
        ["replies the same on both servers", "yes" if s["same_replies"] else "NO", ""],
    ]
    return md_table(["turns 2-5", "prompt cache", "one entry (`--cache-ram 0`)"], rows)


def generated(names: list[str] | None = None) -> list[manifest.Block]:
    """The manifest's blocks this tool regenerates: pure renderers, reproducible pages (or `names`)."""
    blocks = [b for b in manifest.BLOCKS.values() if b.pure and b.reproducible]
    unknown = sorted(set(names or []) - {b.name for b in blocks})
    if unknown:
        raise ValueError(f"not regenerated from JSON: {unknown}; those are {sorted(b.name for b in blocks)}")
    return [b for b in blocks if not names or b.name in names]


def rendered(texts: dict[str, str], blocks: list[manifest.Block]) -> dict[str, str]:
    """`texts` (page -> text) with every block of `blocks` that lands on one of them regenerated."""
    out = dict(texts)
    for block in blocks:
        body = manifest.render(block)
        for page in block.pages:
            if page in out:
                out[page] = replace_block(out[page], block.name, body)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="only these blocks (default: every one the JSON makes)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a table differs from its JSON")
    args = ap.parse_args(argv)
    blocks = generated(args.names)
    texts = {p: (ROOT / p).read_text() for b in blocks for p in b.pages}
    try:
        new = rendered(texts, blocks)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    stale = [p for p in texts if new[p] != texts[p]]
    if args.check:
        print(
            "tables are up to date"
            if not stale
            else f"out of date: {', '.join(stale)}; run python tools/perf_tables.py"
        )
        return int(bool(stale))
    for p in stale:
        (ROOT / p).write_text(new[p])
    print(f"updated {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
