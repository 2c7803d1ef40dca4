"""One `specx run` decode: engine events → raw text on stdout, the live view on stderr, stats.

Contract: `decode_to_stdout` drives `engine.generate` (or a `budget.BudgetTuner`), writes the text
through a `TextSink`, feeds a `display.LiveView` (the text's last line is ended before it closes) and
returns the `RunStats`; `--stats-json` is written even when decoding stops early (Ctrl-C, an error).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specexec_cli.core.engine import DecodeState
from specexec_cli.core.methods import generate
from specexec_cli.core.stats import LinkMeter, RunStats
from specexec_cli.errors import SpecxError, is_oom, oom_error, write_output
from specexec_cli.session.chat import StopScanner
from specexec_cli.terminal import display
from specexec_cli.terminal.output import TextSink


def streamed_bytes(model) -> int:
    stats = getattr(model, "stats", None)
    return int(getattr(stats, "streamed_bytes", 0) or 0)


def decode_to_stdout(
    models, ids: list[int], cfg, live: bool, stats_json: Path | None, tuner=None, link_gbps=None, color: bool = False
) -> RunStats:
    """Stream one continuation of `ids`; the stats JSON's config part is made from `cfg` and the plan."""
    from specexec_cli.session.options import config_record

    plan = getattr(models.target, "plan", None)
    record = config_record(cfg, plan.describe() if plan is not None else None)
    stats = RunStats(config=record)
    state = DecodeState()
    streamed0 = streamed_bytes(models.target)
    meter = LinkMeter(models.target)
    sink, stops = TextSink(color=color), StopScanner(list(models.stop_strings))
    try:
        with display.LiveView(live, link_gbps=link_gbps) as view:
            try:
                events = tuner.drive(models, state, ids, cfg) if tuner else generate(models, state, ids, cfg)
                for ev in events:
                    stats.add(ev)  # counted before shown: a Ctrl-C between keeps shown text's tokens counted
                    shown = stops.feed(ev.text)  # a stop string's cut loses the draft colouring
                    sink(shown, None if shown is ev.text else 0)
                    meter.step(stats, ev)
                    stats.streamed_bytes = streamed_bytes(models.target) - streamed0
                    if tuner is not None:
                        stats.config.update(budget=tuner.shape.budget, max_depth=tuner.shape.max_depth)
                    view.update(stats, {"budget": "auto"} if tuner else None)
                    if stops.stopped:  # the checkpoint's stop string: nothing after it is shown
                        stats.finish = "stop"
                        break
                sink(stops.flush())
            except RuntimeError as exc:  # torch.OutOfMemoryError mid-pass: one line with plan and fix
                if not is_oom(exc):
                    raise
                raise oom_error(record.get("offload"), stats.config.get("budget"), models.ctx_limit) from None
            finally:
                sink.end_line()  # before the view closes: the summary must not run into the text
    finally:
        if stats_json is not None:
            save_stats(stats_json, stats)
    return stats


def save_stats(path: Path, stats: RunStats) -> None:
    """Write --stats-json; a full disk is one error line, and never hides a Ctrl-C or another error."""
    propagating = sys.exc_info()[0]  # called from a `finally`: is a Ctrl-C or an error on its way?
    try:
        write_output(path, json.dumps(stats.to_json(), indent=1) + "\n", "--stats-json")
    except SpecxError as exc:
        if propagating is None:
            raise
        display.print_error(str(exc))
