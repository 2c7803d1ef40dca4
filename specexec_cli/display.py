"""Rich rendering of RunStats on stderr: the live panel and the plain summary line.

Contract: the only module that imports rich. `LiveView` is a context manager fed with the RunStats
after each step; it draws a Live panel on a stderr console when `live` is true (a TTY and no
`--no-live`), and otherwise prints one plain summary line on stderr at the end.
stdout is never touched here.
"""

from __future__ import annotations

import sys

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


def render(stats: RunStats, extra: dict | None = None) -> Panel:
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
    grid.add_row("tree", f"{size} nodes · depth {depth} · budget {cfg.get('budget')} · {cfg.get('method')}")
    grid.add_row(
        "per pass",
        f"draft {1000 * stats.draft_seconds / passes:.1f} ms · target {1000 * stats.target_seconds / passes:.1f} ms",
    )
    if stats.streamed_bytes:
        grid.add_row("streamed", f"{stats.streamed_gbps:.2f} GB/s")
    for key, value in (extra or {}).items():
        grid.add_row(key, str(value))
    title = f"specx · {stats.new_tokens} tokens · {stats.target_passes} passes"
    return Panel(grid, title=title, border_style="blue", expand=False)


class LiveView:
    """`with LiveView(live) as view: view.update(stats)`; prints the summary line when not live."""

    def __init__(self, live: bool, console: Console | None = None):
        self.live = live
        self.console = console or stderr_console()
        self._live: Live | None = None
        self.stats: RunStats | None = None

    def __enter__(self) -> "LiveView":
        if self.live:
            # Text on a terminal stdout is printed above the panel; piped stdout is left alone.
            self._live = Live(
                console=self.console, refresh_per_second=8, transient=False,
                redirect_stdout=sys.stdout.isatty(), redirect_stderr=False,
            )  # fmt: skip
            self._live.__enter__()
        return self

    def update(self, stats: RunStats, extra: dict | None = None) -> None:
        self.stats = stats
        if self._live is not None:
            self._live.update(render(stats, extra))

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
        elif self.stats is not None:
            print(self.stats.summary_line(), file=sys.stderr, flush=True)


def print_notice(message: str) -> None:
    """A one-line notice on stderr (loading plans, demo-pair notice)."""
    stderr_console().print(f"[dim]{message}[/dim]")


def print_error(message: str) -> None:
    stderr_console().print(f"[bold red]error:[/bold red] {message}", soft_wrap=True)
