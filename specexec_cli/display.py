"""Rich rendering of RunStats on stderr: the live panel and the plain summary line.

Contract: the only module that imports rich. `LiveView` is a context manager fed with the RunStats
after each step; it draws a Live panel on a stderr console when `live` is true (a TTY and no
`--no-live`), and otherwise prints one plain summary line on stderr at the end.
stdout is never touched here.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from specexec_cli.stats import RunStats

SPARKS = "▁▂▃▄▅▆▇█"


def stderr_console() -> Console:
    return Console(file=sys.stderr, highlight=False)


def sparkline(values: list[int], width: int = 32) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    top = max(vals) or 1
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v / top) * (len(SPARKS) - 1)))] for v in vals)


def recent_tps(stats: RunStats, window: int = 8) -> float:
    """tok/s over the last `window` passes (current speed)."""
    toks, secs = stats.pass_tokens[-window:], stats.pass_seconds[-window:]
    return sum(toks) / sum(secs) if secs and sum(secs) > 0 else 0.0


def memory_line() -> str:
    """Host RSS / available RAM, plus device memory in use when CUDA is present."""
    import psutil
    import torch

    gb = 1e9
    vm = psutil.virtual_memory()
    line = f"host {psutil.Process().memory_info().rss / gb:.2f} GB used · {vm.available / gb:.1f} GB free"
    if torch.cuda.is_available():
        line += f" · gpu {torch.cuda.memory_allocated() / gb:.2f}/{torch.cuda.get_device_properties(0).total_memory / gb:.1f} GB"
    return line


def render(stats: RunStats, extra: dict | None = None, link_gbps: float | None = None) -> Panel:
    cfg = stats.config
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", justify="right")
    grid.add_column()
    last = stats.pass_tokens[-1] if stats.pass_tokens else 0
    passes = max(stats.target_passes, 1)
    grid.add_row("speed", f"{recent_tps(stats):.2f} tok/s now · {stats.tokens_per_second:.2f} tok/s avg")
    grid.add_row("tokens/pass", f"{stats.tokens_per_pass:.2f} mean · {last} last  {sparkline(stats.pass_tokens)}")
    size = stats.tree_sizes[-1] if stats.tree_sizes else 0
    depth = stats.tree_depths[-1] if stats.tree_depths else 0
    grid.add_row("tree", f"{size} nodes · depth {depth} · budget {cfg.get('budget')} · max depth "
                 f"{cfg.get('max_depth')} · {cfg.get('method')}")
    other = max(stats.decode_seconds - stats.draft_seconds - stats.target_seconds, 0.0)
    total = max(stats.decode_seconds, 1e-9)
    grid.add_row(
        "per pass",
        f"draft {1000 * stats.draft_seconds / passes:.1f} ms · target {1000 * stats.target_seconds / passes:.1f} ms"
        f"  (split {100 * stats.draft_seconds / total:.0f}/{100 * stats.target_seconds / total:.0f}/"
        f"{100 * other / total:.0f} % draft/target/other)",
    )
    if stats.streamed_bytes:
        peak = f" of {link_gbps:.2f} GB/s link peak" if link_gbps else ""
        grid.add_row("streamed", f"{stats.streamed_gbps:.2f} GB/s{peak}")
    grid.add_row("memory", memory_line())
    for key, value in (extra or {}).items():
        grid.add_row(key, str(value))
    title = f"specx · {stats.new_tokens} tokens · {stats.target_passes} passes"
    return Panel(grid, title=title, border_style="blue", expand=False)


class LiveView:
    """`with LiveView(live) as view: view.update(stats)`; prints the summary line when not live."""

    def __init__(self, live: bool, console: Console | None = None, transient: bool = False,
                 link_gbps: float | None = None, summary: bool = True):
        self.live, self.transient, self.link_gbps, self.summary = live, transient, link_gbps, summary
        self._last_draw = 0.0
        self.extra: dict | None = None
        self.console = console or stderr_console()
        self._live: Live | None = None
        self.stats: RunStats | None = None

    def __enter__(self) -> "LiveView":
        if self.live:
            # Text on a terminal stdout is printed above the panel; piped stdout is left alone.
            self._live = Live(
                console=self.console, refresh_per_second=8, transient=self.transient,
                redirect_stdout=sys.stdout.isatty(), redirect_stderr=False,
            )  # fmt: skip
            self._live.__enter__()
        return self

    def update(self, stats: RunStats, extra: dict | None = None) -> None:
        self.stats, self.extra = stats, extra
        now = time.monotonic()
        # re-render at most ~10x/s (and always on the last step): rendering costs ~ms per call
        if self._live is not None and (now - self._last_draw > 0.1 or stats.finish):
            self._last_draw = now
            self._live.update(render(stats, extra, self.link_gbps))

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            if self.stats is not None:  # the throttle may have skipped the last step
                self._live.update(render(self.stats, self.extra, self.link_gbps))
            self._live.__exit__(*exc)
        elif self.stats is not None and self.summary:
            print(self.stats.summary_line(), file=sys.stderr, flush=True)


def print_notice(message: str) -> None:
    """A one-line notice on stderr (loading plans, demo-pair notice)."""
    stderr_console().print(f"[dim]{message}[/dim]")


def print_error(message: str) -> None:
    stderr_console().print(f"[bold red]error:[/bold red] {message}", soft_wrap=True)


def print_info(message: str) -> None:
    """Plain text on stderr (chat command output, summaries); no markup interpretation."""
    print(message, file=sys.stderr, flush=True)


class LoadProgress:
    """A Rich progress bar on stderr for model loading / quantizing; a callable(done, total, what).

    Disabled (a no-op callable) when `enabled` is false, e.g. stderr is not a terminal.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._progress = None
        self._task = None

    def __enter__(self) -> "LoadProgress":
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                      console=stderr_console(), transient=True)  # fmt: skip
            self._progress.__enter__()
        return self

    def __call__(self, done: int, total: int, what: str) -> None:
        if self._progress is None:
            return
        if self._task is None:
            self._task = self._progress.add_task(what, total=total)
        elif done < self._progress.tasks[0].completed:   # a new phase (quantizing -> loading): fresh ETA
            self._progress.reset(self._task, total=total)
        self._progress.update(self._task, completed=done, total=total, description=what)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


def print_profile(profile: dict) -> None:
    """The `specx profile` result as a Rich table on stderr, then the recommended budget."""
    gb = 1e9
    table = Table(title=f"specx profile · {profile.get('hostname')}", show_header=False, expand=False)
    table.add_column(style="bold cyan", justify="right")
    table.add_column()
    cpu, mem, disk, mm = profile["cpu"], profile["memory"], profile["disk"], profile["matmul"]
    table.add_row("cpu", f"{cpu['model']} · {cpu['physical_cores']} cores / {cpu['logical_cores']} threads "
                  f"({cpu['usable_cores']} usable)")
    table.add_row("ram", f"{mem['total_bytes'] / gb:.1f} GB total · {mem['available_bytes'] / gb:.1f} GB free")
    for g in profile.get("gpus") or []:
        table.add_row(f"gpu {g['index']}", f"{g['name']} · {g['total_bytes'] / gb:.1f} GB · "
                      f"pinned H2D {g['h2d_pinned_gbps']:.2f} GB/s")
    if not profile.get("gpus"):
        table.add_row("gpu", "none (CUDA not available)")
    note = f" · {disk['note']}" if disk.get("note") else ""
    table.add_row("disk", f"{disk.get('read_gbps')} GB/s {disk.get('method')} read of {disk.get('path')}{note}")
    table.add_row("matmul", f"bf16 {mm['bf16_gflops']} GFLOP/s · fp32 {mm['fp32_gflops']} GFLOP/s ({mm['device']})")
    models = profile.get("models")
    if models:
        pts = ", ".join(f"{n}: {1000 * s:.1f}" for n, s in models["target_seconds"].items())
        table.add_row("t_target(n) ms", pts)
        if models.get("draft_step_seconds"):
            table.add_row("draft step", f"{1000 * models['draft_step_seconds']:.1f} ms per {models['max_beams']}-node forward")
    rec = profile.get("recommended")
    if rec:
        table.add_row("recommended", f"--budget {rec['budget']} --max-depth {rec['max_depth']} "
                      f"(~{rec['expected_tokens_per_pass']} tokens/pass with the prior acceptance curve, "
                      f"{rec['timing']} timings)")
    stderr_console().print(table)


class BenchProgress(LoadProgress):
    """`specx bench` progress: bar, cells done/total, elapsed and ETA; a callable(done, total, what)."""

    def __enter__(self) -> "BenchProgress":
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                      console=stderr_console(), transient=True)  # fmt: skip
            self._progress.__enter__()
        return self


def print_bench_table(records: list[dict]) -> None:
    """One row per bench cell (method × budget × temperature) on stderr."""
    table = Table(title="specx bench", header_style="bold cyan")
    for col in ("T", "budget", "method", "tok/pass", "tok/s", "draft s", "target s", "tree", "lossless"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    for r in records:
        lossless = {True: "[green]yes[/green]", False: "[bold red]NO[/bold red]", None: "n/a"}[r["lossless"]]
        budget = f"{r['budget']}*" if r.get("budget_independent") else str(r["budget"])
        table.add_row(f"{r['temperature']:g}", budget, r["method"], f"{r['tokens_per_pass']:.2f}",
                      f"{r['tokens_per_second']:.2f}", f"{r['draft_seconds']:.1f}", f"{r['target_seconds']:.1f}",
                      f"{r['mean_tree_size']:g}", lossless)  # fmt: skip
    stderr_console().print(table)
    stderr_console().print("[dim]* budget-independent method (ar; chain uses --gamma): one run, repeated per budget[/dim]")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def print_plan(plan: dict, title: str = "specx memory plan") -> None:
    """The --dry-run plan (MemoryPlan.to_json()) on stdout: component, where it lives, bytes."""
    dev = "cuda" if plan.get("device") == "cuda" else "cpu"
    table = Table(title=title, header_style="bold cyan")
    for col, justify in (("component", "left"), ("where", "left"), ("bytes", "right"), ("GB", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for name, n in plan["device_bytes"].items():
        table.add_row(name, dev, f"{n:,}", _gb(n))
    table.add_row("[bold]device total[/bold]", dev, f"{plan['device_total']:,}",
                  f"{_gb(plan['device_total'])} of {_gb(plan['device_capacity'])}", end_section=True)
    for name, n in plan["host_bytes"].items():
        table.add_row(name, "ram", f"{n:,}", _gb(n))
    table.add_row("[bold]host total[/bold]", "ram", f"{plan['host_total']:,}",
                  f"{_gb(plan['host_total'])} of {_gb(plan['host_capacity'])}", end_section=True)
    table.add_row("layers read per pass", "disk", f"{plan['disk_bytes_per_pass']:,}", _gb(plan["disk_bytes_per_pass"]))
    streamed = plan["streamed_layers"]
    table.caption = (f"layers: {plan['resident_layers']} resident, {streamed['ram']} from RAM, {streamed['disk']} "
                     f"from disk · embeddings on {plan['embeddings']} · ctx {plan['ctx']} · budget {plan['budget']} · "
                     + ("[green]fits[/green]" if plan["fits"] else "[bold red]does not fit[/bold red]"))
    Console(highlight=False).print(table)
