"""`specx bench`: every (method, budget, temperature) cell over the same prompts, in one process.

Contract: `run_bench(models, prompts, grid, progress)` returns one record per (method, budget,
temperature). Per prompt the cells run round-robin from a rotating start, so drift hits all alike.
Budget-less methods (`ar`, `chain`) run once per (prompt, temperature), their record repeated under
every budget with `budget_independent: true`. Sequoia's calibration runs before the timed grid.
`lossless` compares T = 0 ids with `ar`'s (run hidden when not requested); null at T > 0.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.core.methods.common import MethodSettings, with_settings
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.core.stats import LinkMeter, RunStats
from specexec_cli.errors import SpecxError

BUDGETLESS = ("ar", "chain")  # methods whose verified size does not depend on --budgets


@dataclass(frozen=True)
class BenchGrid:
    methods: tuple[str, ...]  # --methods, in the order given
    budgets: tuple[int, ...]  # --budgets (tree nodes verified per pass)
    temperatures: tuple[float, ...]  # --temperatures
    max_new_tokens: int = 128
    max_depth: int = 64  # tree depth cap for the tree methods
    seed: int = 0
    options: dict = field(default_factory=dict, hash=False, compare=False)  # gamma, branching, sequoia_profile


@dataclass(frozen=True)
class Cell:
    method: str
    budget: int | None  # None for budget-less methods
    temperature: float
    hidden: bool = False  # the T=0 `ar` reference when ar was not requested


def parse_list(text: str, kind, flag: str) -> tuple:
    try:
        values = tuple(kind(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise SpecxError(f"{flag} must be a comma-separated list (got {text!r})") from None
    if not values:
        raise SpecxError(f"{flag} is empty; give at least one value")
    return values


def make_grid(
    methods: str, budgets: str, temperatures: str, max_new_tokens: int, max_depth: int, seed: int, options: dict
) -> BenchGrid:
    """Validated grid from the CLI's comma-separated flags."""
    from specexec_cli.core.methods import METHODS

    names = parse_list(methods, str, "--methods")
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise SpecxError(f"--methods: unknown {unknown[0]!r}; choose from {', '.join(METHODS)}")
    sizes, temps = parse_list(budgets, int, "--budgets"), parse_list(temperatures, float, "--temperatures")
    grid = BenchGrid(names, sizes, temps, max_new_tokens, max_depth, seed, options)
    if min(grid.budgets) < 1 or min(grid.temperatures) < 0 or max_new_tokens < 1 or max_depth < 1:
        raise SpecxError("--budgets, --max-new-tokens and --max-depth must be >= 1, --temperatures >= 0")
    return grid


def load_prompts(path: Path, limit: int | None) -> list[str]:
    """JSONL with a "prompt" field per line (plain text lines are accepted too)."""
    if not path.is_file():
        raise SpecxError(f'--prompts {path}: no such file; pass a JSONL file with a "prompt" per line')
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            prompts.append(json.loads(line)["prompt"] if line.lstrip().startswith("{") else line)
    if not prompts:
        raise SpecxError(f"--prompts {path}: no prompts found")
    return prompts[:limit] if limit else prompts


def grid_cells(grid: BenchGrid) -> list[Cell]:
    cells = []
    for t in grid.temperatures:
        if t == 0 and "ar" not in grid.methods:
            cells.append(Cell("ar", None, t, hidden=True))
        for m in grid.methods:
            budgets = [None] if m in BUDGETLESS else list(grid.budgets)
            cells += [Cell(m, b, t) for b in budgets]
    return cells


def cell_config(cell: Cell, grid: BenchGrid) -> GenerationConfig:
    budget = cell.budget if cell.budget is not None else max(grid.budgets)
    cfg = GenerationConfig(
        method=cell.method,
        shape=TreeShape(budget, grid.max_depth),
        sampling=SamplingParams(temperature=cell.temperature),
        seed=grid.seed,
        max_new_tokens=grid.max_new_tokens,
    )
    return with_settings(cfg, **grid.options)


def run_one(models, ids: list[int], cfg: GenerationConfig) -> RunStats:
    stats, meter = RunStats(), LinkMeter(models.target)
    for ev in generate(models, DecodeState(), ids, cfg):
        stats.add(ev)
        meter.step(stats, ev)
    return stats


def warm_up(models, prompts: list[list[int]], grid: BenchGrid) -> None:
    """Untimed: one short decode per method (lazy init) and Sequoia's calibration per temperature."""
    from specexec_cli.core.methods.sequoia import acceptance_vector

    for t in grid.temperatures:
        if "sequoia" in grid.methods:
            acceptance_vector(models, prompts[0], SamplingParams(temperature=t), grid.options.get("sequoia_profile"))
    short = replace(grid, max_new_tokens=4, max_depth=4, seed=0)
    for m in dict.fromkeys(("ar",) + grid.methods):
        run_one(models, prompts[0], cell_config(Cell(m, 8, grid.temperatures[0]), short))


def run_bench(models, prompts: list[list[int]], grid: BenchGrid, progress=None) -> list[dict]:
    """Run the grid (module docstring); returns the records."""
    cells = grid_cells(grid)
    warm_up(models, prompts, grid)
    runs: dict[Cell, list[RunStats]] = {c: [] for c in cells}
    total, done = len(cells) * len(prompts), 0
    for i, ids in enumerate(prompts):
        order = cells[i % len(cells) :] + cells[: i % len(cells)]  # round-robin, rotating start
        for cell in order:
            if progress:
                progress(done, total, f"prompt {i + 1}/{len(prompts)} · {label(cell)}")
            runs[cell].append(run_one(models, ids, cell_config(cell, grid)))
            done += 1
    if progress:
        progress(done, total, "done")
    return make_records(runs, grid)


def label(cell: Cell) -> str:
    budget = "-" if cell.budget is None else str(cell.budget)
    return f"{cell.method} b={budget} T={cell.temperature:g}"


def summarise(runs: list[RunStats]) -> dict:
    """Totals over prompts: per-pass means weight every pass, tok/s is total tokens / total decode time."""
    passes = sum(r.target_passes for r in runs)
    tokens = sum(sum(r.pass_tokens) for r in runs)
    decode = sum(r.decode_seconds for r in runs)
    sizes = [s for r in runs for s in r.tree_sizes]
    hist = Counter()
    for r in runs:
        hist.update(r.pass_tokens)
    return dict(
        prompts=len(runs),
        new_tokens=sum(r.new_tokens for r in runs),
        target_passes=passes,
        tokens_per_pass=round(tokens / passes, 4) if passes else 0.0,
        accept_histogram={str(k): v for k, v in sorted(hist.items())},
        tokens_per_second=round(sum(r.new_tokens for r in runs) / decode, 3) if decode > 0 else 0.0,
        decode_seconds=round(decode, 3),
        draft_seconds=round(sum(r.draft_seconds for r in runs), 3),
        target_seconds=round(sum(r.target_seconds for r in runs), 3),
        mean_tree_size=round(sum(sizes) / len(sizes), 2) if sizes else 0.0,
        **_link_summary(runs),
    )


def _link_summary(runs: list[RunStats]) -> dict:
    """Offloaded target only: mean per-pass link-busy fraction and total stall seconds."""
    busy = [x for r in runs for x in r.link_busy]
    if not busy:
        return {}
    return dict(
        link_busy_fraction=round(sum(busy) / len(busy), 4),
        stall_seconds=round(sum(x for r in runs for x in r.stall), 4),
    )


def make_records(runs: dict[Cell, list[RunStats]], grid: BenchGrid) -> list[dict]:
    ref = next(([r.token_ids for r in rs] for c, rs in runs.items() if c.method == "ar" and c.temperature == 0), None)
    settings = MethodSettings.of(cell_config(next(iter(runs)), grid))
    records = []
    for cell, rs in runs.items():
        if cell.hidden:
            continue
        lossless = all(a.token_ids == b for a, b in zip(rs, ref)) if cell.temperature == 0 and ref is not None else None
        base = dict(method=cell.method, temperature=cell.temperature, lossless=lossless, **summarise(rs))
        if cell.method == "chain":
            base["gamma"] = settings.gamma
        for budget in grid.budgets if cell.budget is None else [cell.budget]:
            records.append(dict(base, budget=budget, budget_independent=cell.budget is None))
    order = {m: i for i, m in enumerate(grid.methods)}
    return sorted(records, key=lambda r: (r["temperature"], r["budget"], order[r["method"]]))


def write_plots(out: Path, records: list[dict]) -> list[Path]:
    """tokens_per_pass.png and tokens_per_second.png (method vs budget, a panel per temperature);
    ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in records})
    methods = list(dict.fromkeys(r["method"] for r in records))
    paths = []
    for key, ylabel in (("tokens_per_pass", "tokens per target pass"), ("tokens_per_second", "tokens per second")):
        fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
        for ax, t in zip(axes[0], temps):
            for m in methods:
                rows = sorted(
                    (r for r in records if r["method"] == m and r["temperature"] == t), key=lambda r: r["budget"]
                )
                style = "--" if rows and rows[0]["budget_independent"] else "-o"
                ax.plot([r["budget"] for r in rows], [r[key] for r in rows], style, label=m)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (tree nodes per pass)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"T = {t:g}")
            ax.grid(alpha=0.3)
        axes[0][0].legend()
        fig.tight_layout()
        paths.append(out / f"{key}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def save(out: Path, records: list[dict]) -> str:
    """results.json and (with matplotlib) the plots; returns a one-line note of what was written."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    try:
        plots = write_plots(out, records)
    except ImportError:
        from specexec_cli.session.deps import install_hint

        return f"wrote {path}; matplotlib is missing, so no plots (fix: {install_hint('matplotlib')})"
    return f"wrote {path}, " + ", ".join(str(p) for p in plots)
