"""`gpu_day.py tables`: the GPU day's tables from a run's --out (its summary.json), into their pages.

Contract: `render(summary)` -> {table name: markdown}; the names are TABLES (card, moe, passes, draft,
step, demo, tests). `PAGES` gives each table's page, relative to the repository root: the day's
measurements are the user's (docs/gpu-status.md), the CUDA tests' table names test files and is the
developers' (CONTRIBUTING.md). `main(out, write)` prints the tables, or with --write puts each into
its page's `<!-- bench:gpuday-NAME -->` ... `<!-- /bench:gpuday-NAME -->` block through
bench/docblock.py's `write_block` (the docs' one marker dialect): every page, or only the pages
named. A block a page lacks, or a named page that is no table's, is an error (exit 2) and no page is
written. Every measured figure is printed beside the speed model's prediction for it and their
ratio (measured / modelled), the draft table beside its weight-read floor too; a phase that has not
run or failed renders as one line saying so (the moe table keeps what a failed run measured, under
its error). The moe table prints each pass modelled twice, on the priors and on the floor and CPU
expert rates the phase measured, and those measured rates beside their priors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TABLES = ("card", "moe", "passes", "draft", "step", "demo", "tests")
ROOT = Path(__file__).resolve().parents[2]
SPLITS = ("draft", "stream", "verify", "accept", "step")
GPU_STATUS, CONTRIBUTING = "docs/gpu-status.md", "CONTRIBUTING.md"
PAGES = {name: CONTRIBUTING if name == "tests" else GPU_STATUS for name in TABLES}


def block(name: str) -> str:
    """The docs block a table goes into."""
    return f"gpuday-{name}"


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


def _floor_cells(r: dict) -> str:
    floor = r.get("read_floor_s")  # absent from runs before the column
    return f"{_ms(floor)} | {r['seconds'] / floor:.1f}" if floor else "| "


def draft(summary: dict) -> str:
    d = _phase(summary, "draft")
    if d is None:
        return _missing(summary, "draft")
    lines = [
        "| draft | b tokens | measured ms | weight-read floor ms | x floor | modelled ms | x |",
        "|---|---|---|---|---|---|---|",
    ]
    subs = [
        (f"{bits}-bit substitute ({sub['kernel']}), one 70B layer's linears", sub)
        for bits, sub in d["substitutes"].items()
    ]
    for name, part in [("1B-shaped bf16, whole forward", d["small"]), *subs]:
        for r in part["rows"]:
            lines.append(
                f"| {name} | {r['b']} | {_ms(r['seconds'])} | {_floor_cells(r)} | "
                f"{_ms(r['predicted']['seconds'])} | {r['seconds'] / r['predicted']['seconds']:.2f} |"
            )
    return "\n".join(lines)


def step(summary: dict) -> str:
    d = _phase(summary, "step")
    if d is None:
        return _missing(summary, "step")
    lines = [
        f"{d['plan']} ({d['streamed_bytes'] / 1e9:.2f} GB a pass), a resident 1B-shaped bf16 draft, "
        f"{d['past']} cached tokens, the mean of {d['repeats']} steps; the target accepts what the development "
        "pair accepted in a CPU trace (tools/gpuday/step_trace.json). without: the engine's own step; with: "
        "the next tree grown on a CUDA stream of its own while the target's layers stream (this phase's "
        "arrangement: specexec_cli has no overlapped step yet). Modelled: offload/planning/draftcost.py's "
        "evaluate with the card's measured rates; it models no accept work and no overlap beyond the staging "
        "slots, so both rows' modelled step is the same.",
        "",
        "| budget | overlap | part | measured ms | modelled ms | x |",
        "|---|---|---|---|---|---|",
    ]
    for b in d["budgets"]:
        p = b["predicted"]
        for mode in ("without", "with"):
            for part in SPLITS:
                got, want = b[mode][part], p.get(part)
                cells = f"{_ms(want)} | {got / want:.2f}" if want else "not modelled | "
                lines.append(f"| {b['budget']} | {mode} | {part} | {_ms(got)} | {cells} |")
    lines += [
        "",
        "| budget | draft forwards per tree: measured / trace / modelled | draft logit scale | tokens per pass: "
        "replayed / trace | tokens/s at the trace's tokens per pass: without / with / modelled | with: step / "
        "max(stream, draft) |",
        "|---|---|---|---|---|---|",
    ]
    for b in d["budgets"]:
        w, o, p, tpp = b["without"], b["with"], b["predicted"], b["trace"]["tokens_per_pass"]
        lines.append(
            f"| {b['budget']} | {w['forwards']:.1f} / {b['trace']['forwards']:.1f} / {p['forwards']} | "
            f"{b['scale']['scale']:g} | {w['tokens']:.2f} / {tpp:.2f} | {tpp / w['step']:.2f} / "
            f"{tpp / o['step']:.2f} / {p['tokens_per_second']:.2f} | {o['step'] / max(o['stream'], o['draft']):.2f} |"
        )
    return "\n".join(lines)


def _x(got: float | None, want: float | None) -> str:
    return f"{got / want:.2f}" if want and got is not None else ""


def _mso(s: float | None) -> str:
    return "not modelled" if s is None else _ms(s)


def moe(summary: dict) -> str:
    rec = summary.get("phases", {}).get("moe")
    d = rec.get("data") if rec else None
    if not d:
        return _missing(summary, "moe")
    s, cpu, fl = d["shape"], d["cpu"], d["floors"]
    lines = [f"*moe: failed: {rec['error']}*", ""] if not rec.get("ok") else []
    lines += [
        f"A seeded Qwen3-MoE built on the box: {s['layers']} layers, hidden {s['hidden_size']}, {s['num_experts']} "
        f"experts of moe_intermediate {s['moe_intermediate_size']}, top-{s['num_experts_per_tok']}, {d['dtype']} "
        f"({d['expert_bytes'] / 1e6:.1f} MB an expert, {d['checkpoint_bytes'] / 1e9:.2f} GB); a pass of n tokens "
        "without a KV cache, the median of the rounds shown. layers: whole layers streamed from pinned RAM; split: "
        f"every layer's dense part on the card, {d['cache_experts']} experts ({100 * d['cache_share']:.0f}% of each "
        "layer's) cached there, the others computed on the CPU. Modelled: planning/experts.mode_seconds on the "
        "card's measured rates with the priors (forward floor, CPU experts), then with this run's measured floor "
        f"and CPU expert rates in their place. The plan's own choice here: {d['plan_mode']}. Greedy ids of the "
        f"two modes: {'equal' if d['ids_equal'] else 'differ at ' + str(d['differ'])}.",
        "",
        "| mode | n | rounds | measured ms | GB streamed | modelled ms, priors | x | modelled ms, measured "
        "floor and CPU rate | x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        p, m = r["modelled_s"], r["modelled_measured_s"]
        if "not_run" in r:
            got = f"| | {r['not_run']} | | {_mso(p)} | | {_mso(m)} | |"
        else:
            t = r["seconds"]
            got = f"| {r['rounds']} | {_ms(t)} | {r['streamed_bytes'] / 1e9:.3g} | {_mso(p)} | {_x(t, p)} | {_mso(m)} | {_x(t, m)} |"
        lines.append(f"| {r['mode']} | {r['n']} {got}")
    lines += ["", "| prior | measured | prior's value | measured / prior |", "|---|---|---|---|"]
    prior = fl["prior_s"]
    for c in fl["cases"]:
        f, one = [r["floor_s"] for r in c["rows"]], c["rows"][0]
        ns = " / ".join(str(r["n"]) for r in c["rows"])
        got = " / ".join(_ms(x) if x is not None else "no kernels traced" for x in f)
        wall = one["wall_s"] if f[0] is None else f[0] + one["kernels_s"]  # the wall the floor is taken from
        lines.append(
            f"| forward floor: {c['layers']} {c['kind']} layers (hidden 64), {c['placement']}, n = {ns} | {got} ms "
            f"(n = {one['n']}: {_ms(wall)} wall, {_ms(one['kernels_s'])} kernels) | {_ms(prior)} ms "
            f"({fl['prior_layers']} layers) | {_x(f[0], prior) if f[0] is not None else ''} |"
        )
    probe = cpu["profile_probe"]
    lines += [
        f"| CPU experts: GB/s of the distinct routed experts, 1 token, top-{s['num_experts_per_tok']}, {cpu['dtype']}, "
        f"{cpu['threads']} threads | {cpu['bps'] / 1e9:.3g} | {cpu['prior_bps'] / 1e9:.0f} | {_x(cpu['bps'], cpu['prior_bps'])} |",
        f"| CPU experts: GFLOP/s, {cpu['cells'][-1]['tokens']} tokens | {cpu['flops'] / 1e9:.3g} | "
        f"{cpu['prior_flops'] / 1e9:.0f} | {_x(cpu['flops'], cpu['prior_flops'])} |",
        f"| CPU experts: `specx profile`'s probe (fp32, 1 token, top-{probe['top_k']}) GB/s | {probe['gbps']:.3g} | "
        f"{cpu['prior_bps'] / 1e9:.0f} | {_x(probe['gbps'] * 1e9, cpu['prior_bps'])} |",
    ]
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
        "moe": moe(summary),
        "passes": passes(summary),
        "draft": draft(summary),
        "step": step(summary),
        "demo": demo(summary),
        "tests": tests(summary),
    }


def _docblock():
    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
    import docblock  # bench/docblock.py

    return docblock


def fill(text: str, blocks: dict[str, str]) -> str:
    """`text` with each table in its block (ValueError naming a block the text lacks)."""
    for name, body in blocks.items():
        text = _docblock().replace_block(text, block(name), body)
    return text


def write_tables(page: Path, blocks: dict[str, str]) -> None:
    """Each table into its `bench:gpuday-NAME` block of `page` by write_block, once every block is
    known to be there (SystemExit naming the first one missing, the page untouched)."""
    try:
        fill(page.read_text(), blocks)
    except ValueError as e:
        raise SystemExit(f"{page}: {e}") from None
    for name, body in blocks.items():
        _docblock().write_block(page, block(name), body)


def by_page(blocks: dict[str, str]) -> dict[str, dict[str, str]]:
    """The tables grouped by their page (PAGES), in TABLES order."""
    pages: dict[str, dict[str, str]] = {}
    for name, body in blocks.items():
        pages.setdefault(PAGES[name], {})[name] = body
    return pages


def write_pages(blocks: dict[str, str], only: list[Path] | None = None, root: Path = ROOT) -> list[Path]:
    """Each table into its page under `root` (only the pages in `only`, when given), once every chosen
    page is known to hold its blocks (SystemExit naming the first problem, no page touched)."""
    pages = {root / page: mine for page, mine in by_page(blocks).items()}
    if only:
        wanted = {p.resolve() for p in only}
        unknown = sorted(str(p) for p in wanted - {p.resolve() for p in pages})
        if unknown:
            raise SystemExit(
                f"{unknown[0]} holds none of the day's tables (they go to: {', '.join(sorted(set(PAGES.values())))})"
            )
        pages = {p: mine for p, mine in pages.items() if p.resolve() in wanted}
    for page, mine in pages.items():
        try:
            fill(page.read_text(), mine)
        except (OSError, ValueError) as e:
            raise SystemExit(f"{page}: {e}") from None
    for page, mine in pages.items():
        write_tables(page, mine)
    return list(pages)


def main(out: Path, write: list[Path] | None, root: Path = ROOT) -> int:
    """Print the tables (`write` None), or write them into every page ([]) or the pages named."""
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
        written = write_pages(blocks, write, root)
    except SystemExit as e:
        print(f"gpu_day tables: {e}", file=sys.stderr)
        return 2
    for page in written:
        names = [n for n in TABLES if root / PAGES[n] == page]
        print(f"wrote {len(names)} tables ({', '.join(names)}) into {page}")
    return 0
