"""Rich rendering of RunStats on stderr: the live panel and the plain summary line.

Contract: with candidates.py, the only rich importer; importing it loads rich's console only, and it
never writes stdout. `LiveView`, fed the RunStats after each step, draws the panel when `live`
(stderr a terminal, no `--no-live`): in the bottom rows below a scroll region when stdout is the
terminal too (`BottomPanel`: text scrolls above it untouched), else as a rich `Live` on stderr.
Otherwise (or on a too small terminal) it prints one summary line at the end. Text that can carry
user input, file names or model output is escaped or printed without markup.
"""

from __future__ import annotations

import io
import os
import sys
import time
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from rich.panel import Panel

    from specexec_cli.core.stats import RunStats

SPARKS = "▁▂▃▄▅▆▇█"


_LIVE_CONSOLE: Console | None = None  # the console of an active progress bar: notices print above it


def stderr_console() -> Console:
    if _LIVE_CONSOLE is not None:
        return _LIVE_CONSOLE
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
    from rich.panel import Panel
    from rich.table import Table

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
        grid.add_row(escape(str(key)), escape(str(value)))
    title = f"specx · {stats.new_tokens} tokens · {stats.target_passes} passes"
    return Panel(grid, title=title, border_style="blue", expand=False)


PANEL_ROWS = 10  # rows reserved at the bottom: 2 borders + up to 8 grid rows


class BottomPanel:
    """The bottom `rows` lines of the terminal: `open` sets the scroll region (DECSTBM) to the rows
    above them, as apt does, so stdout's text scrolls there; `draw` paints with the cursor saved and
    restored (DECSC/DECRC); `close` clears them and frees the screen. Escapes go to `out` (stderr)."""

    def __init__(self, out, rows: int = PANEL_ROWS):
        self.out, self.rows = out, rows
        self.size = os.get_terminal_size(out.fileno())
        self.ok = self.size.lines >= rows + 4  # too small a terminal: the caller falls back

    def _region(self, lines: int) -> str:
        return f"\x1b7\x1b[1;{lines - self.rows}r\x1b8"  # DECSTBM homes the cursor: save/restore

    def open(self) -> None:
        # newlines scroll the screen when the cursor is in the last `rows` rows; then go back up
        self._write("\n" * self.rows + f"\x1b[{self.rows}A" + self._region(self.size.lines))

    def draw(self, lines: list[str]) -> None:
        size = os.get_terminal_size(self.out.fileno())
        buf = ""
        if size != self.size:  # resized: move the region to the new bottom
            self.size = size
            buf += self._region(size.lines)
        top = size.lines - self.rows + 1
        buf += "\x1b7"
        for i in range(self.rows):
            buf += f"\x1b[{top + i};1H\x1b[2K" + (lines[i] if i < len(lines) else "")
        self._write(buf + "\x1b8")

    def close(self) -> None:
        top = self.size.lines - self.rows + 1
        clear = "".join(f"\x1b[{top + i};1H\x1b[2K" for i in range(self.rows))
        self._write("\x1b7" + clear + "\x1b[r\x1b8")  # DECSTBM reset also homes: save/restore

    def _write(self, data: str) -> None:
        sys.stdout.flush()  # text already written must land before the cursor moves
        self.out.write(data)
        self.out.flush()


def panel_lines(panel, width: int, rows: int) -> list[str]:
    """The panel rendered with ANSI styles, as at most `rows` lines no wider than `width`."""
    console = Console(file=io.StringIO(), width=width, force_terminal=True, highlight=False,
                      color_system=None if os.environ.get("NO_COLOR") else "standard")
    with console.capture() as cap:
        console.print(panel, crop=True, overflow="crop")
    return cap.get().splitlines()[:rows]


class LiveView:
    """`with LiveView(live) as view: view.update(stats)`. summary: True = the summary line (or final
    panel) at the end, "turn" = a short per-reply line, False = nothing."""

    def __init__(self, live: bool, transient: bool = False, link_gbps: float | None = None,
                 summary: bool | str = True, end_text=None):
        self.live, self.transient, self.link_gbps, self.summary = live, transient, link_gbps, summary
        self.end_text = end_text  # called first on exit: ends the text's last line (TextSink.end_line)
        self._last_draw = 0.0
        self.extra: dict | None = None
        self.console = stderr_console()
        self._live = None  # rich Live (stdout piped)
        self._bottom: BottomPanel | None = None  # scroll-region panel (stdout is the terminal)
        self.stats: RunStats | None = None

    def __enter__(self) -> LiveView:
        if self.live and sys.stdout.isatty():
            bottom = BottomPanel(sys.stderr)
            if bottom.ok:
                self._bottom = bottom
                bottom.open()
        elif self.live:
            from rich.live import Live

            self._live = Live(console=self.console, refresh_per_second=8, transient=self.transient,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.__enter__()
        return self

    def update(self, stats: RunStats, extra: dict | None = None) -> None:
        self.stats, self.extra = stats, extra
        now = time.monotonic()
        # re-render at most ~10x/s (and always on the last step): rendering costs ~ms per call
        if now - self._last_draw > 0.1 or stats.finish:
            self._last_draw = now
            self._draw()

    def _draw(self) -> None:
        if self.stats is None:
            return
        if self._bottom is not None:
            panel = render(self.stats, self.extra, self.link_gbps)
            self._bottom.draw(panel_lines(panel, self._bottom.size.columns, self._bottom.rows))
        elif self._live is not None:
            self._live.update(render(self.stats, self.extra, self.link_gbps))

    def __exit__(self, *exc) -> None:
        if self.end_text is not None:
            self.end_text()
        # an error's line stands alone: no summary of a run that failed (Ctrl-C keeps it) or produced nothing
        failed = exc and exc[0] is not None and not issubclass(exc[0], KeyboardInterrupt)
        report = self.stats is not None and not failed and self.stats.new_tokens > 0
        if self._live is not None:
            self._draw()  # the throttle may have skipped the last step
            self._live.__exit__(*exc)
        elif self._bottom is not None:
            self._bottom.close()
            if not self.transient and report and self.summary is True:
                self.console.print(render(self.stats, self.extra, self.link_gbps))
        if not report:
            return
        if self.summary == "turn":  # the one line after each chat reply
            s = self.stats
            print(f"[{s.new_tokens} tokens · {s.tokens_per_second:.2f} tok/s · {s.tokens_per_pass:.2f} tokens/pass · "
                  f"{s.target_passes} passes]", file=sys.stderr, flush=True)
        elif self.summary and self._live is None and self._bottom is None:
            print(self.stats.summary_line(), file=sys.stderr, flush=True)


def live_enabled(no_live: bool) -> bool:
    """The live panel shows unless --no-live or stderr is not a terminal."""
    return not no_live and sys.stderr.isatty()


def route_offload_notices() -> None:
    """Show offload's OffloadNotice warnings as one-line notices; others keep Python's display."""
    import warnings

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if category.__name__ == "OffloadNotice":   # by name: importing offload would load torch
            print_notice(str(message))
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def print_notice(message: str) -> None:
    """A one-line notice on stderr (loading plans, demo-pair notice)."""
    stderr_console().print(f"[dim]{escape(message)}[/dim]", soft_wrap=True)


def print_error(message: str) -> None:
    """`error: message` on stderr; the message is escaped (it may name files or quote input)."""
    stderr_console().print(f"[bold red]error:[/bold red] {escape(message)}", soft_wrap=True)


def print_info(message: str) -> None:
    """Plain text on stderr (chat command output, summaries); no markup interpretation."""
    print(message, file=sys.stderr, flush=True)


class LoadProgress:
    """A progress bar on stderr, callable(done, total, what); a no-op when not `enabled`."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._progress = None
        self._task = None

    def __enter__(self) -> LoadProgress:
        global _LIVE_CONSOLE
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                      console=stderr_console(), transient=True)
            self._progress.__enter__()
            # print_notice/print_error go through the bar's console while it is shown (a second
            # console on stderr would write into the bar's line)
            self._outer, _LIVE_CONSOLE = _LIVE_CONSOLE, self._progress.console
        return self

    def __call__(self, done: int, total: int, what: str) -> None:
        if self._progress is None:
            return
        if self._task is None:
            self._task = self._progress.add_task(escape(what), total=total)
        elif done < self._progress.tasks[0].completed:   # a new phase (quantizing -> loading): fresh ETA
            self._progress.reset(self._task, total=total)
        self._progress.update(self._task, completed=done, total=total, description=escape(what))

    def __exit__(self, *exc) -> None:
        global _LIVE_CONSOLE
        if self._progress is not None:
            _LIVE_CONSOLE = self._outer
            self._progress.__exit__(*exc)


def print_profile(profile: dict) -> None:
    """The `specx profile` result as a Rich table on stderr, then the recommended budget."""
    from rich.table import Table

    gb = 1e9
    table = Table(title=f"specx profile · {escape(str(profile.get('hostname')))}", show_header=False, expand=False)
    table.add_column(style="bold cyan", justify="right")
    table.add_column()
    cpu, mem, disk, mm = profile["cpu"], profile["memory"], profile["disk"], profile["matmul"]
    table.add_row("cpu", f"{escape(str(cpu['model']))} · {cpu['physical_cores']} cores / {cpu['logical_cores']} threads "
                  f"({cpu['usable_cores']} usable)")
    table.add_row("ram", f"{mem['total_bytes'] / gb:.1f} GB total · {mem['available_bytes'] / gb:.1f} GB free")
    for g in profile.get("gpus") or []:
        table.add_row(f"gpu {g['index']}", f"{escape(str(g['name']))} · {g['total_bytes'] / gb:.1f} GB · "
                      f"pinned H2D {g['h2d_pinned_gbps']:.2f} GB/s")
    if not profile.get("gpus"):
        table.add_row("gpu", "none (CUDA not available)")
    note = f" · {disk['note']}" if disk.get("note") else ""
    table.add_row("disk", escape(f"{disk.get('read_gbps')} GB/s {disk.get('method')} read of {disk.get('path')}{note}"))
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


BENCH_COLUMNS = ("T", "budget", "method", "tok/pass", "tok/s", "draft", "target", "tree", "= ar")
BENCH_NOTE = ("draft, target: seconds; tree: mean nodes per pass; = ar: the ids equal --method ar's (T = 0); "
              "* budget-independent method (ar; chain uses --gamma): one run, repeated per budget")


def bench_cells(r: dict) -> list[str]:
    """One bench record's cells, in BENCH_COLUMNS order (markup only in `lossless`)."""
    lossless = {True: "[green]yes[/green]", False: "[bold red]NO[/bold red]", None: "n/a"}[r["lossless"]]
    budget = f"{r['budget']}*" if r.get("budget_independent") else str(r["budget"])
    return [f"{r['temperature']:g}", budget, r["method"], f"{r['tokens_per_pass']:.2f}",
            f"{r['tokens_per_second']:.2f}", f"{r['draft_seconds']:.1f}", f"{r['target_seconds']:.1f}",
            f"{r['mean_tree_size']:g}", lossless]


def bench_table(records: list[dict], width: int):
    """The bench table when it fits `width` columns uncut, else one wrapped line per cell."""
    from rich import box
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    console = stderr_console()
    table = Table(title="specx bench", header_style="bold cyan", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in BENCH_COLUMNS:
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    for r in records:
        table.add_row(*bench_cells(r))
    if Measurement.get(console, console.options.update(width=10_000), table).maximum <= width:
        return table
    lines = [Text("specx bench", style="bold")]
    for r in records:   # narrow: "T 0.7 budget 64 specexec: tok/pass 2.30, tok/s 1.10, ..." wrapped at spaces
        c = bench_cells(r)
        line = f"T {c[0]} budget {c[1]} {c[2]}: " + ", ".join(f"{h} {v}" for h, v in zip(BENCH_COLUMNS[3:], c[3:]))
        lines.append(Text.from_markup(line))
    from rich.console import Group

    return Group(*lines)


def print_bench_table(records: list[dict]) -> None:
    """One row per bench cell (method × budget × temperature) on stderr; see bench_table."""
    console = stderr_console()
    console.print(bench_table(records, console.width))
    console.print(f"[dim]{BENCH_NOTE}[/dim]")
