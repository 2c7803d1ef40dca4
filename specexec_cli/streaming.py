"""One `specx run` decode: engine events → raw text on stdout, the live view on stderr, stats.

Contract: `decode_to_stdout` drives `engine.generate` (or a `budget.BudgetTuner`), writes every
event's text through a `terminal.TextSink` (raw, optionally coloured by origin), feeds a
`display.LiveView` and returns the `RunStats`. The last line of text is ended before the view
closes, so the summary line or final panel never runs into it. `--stats-json` is written even
when decoding stops early (Ctrl-C, an error); its path was validated before the models loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from specexec_cli import display
from specexec_cli.engine import DecodeState
from specexec_cli.methods import generate
from specexec_cli.stats import LinkMeter, RunStats
from specexec_cli.terminal import TextSink


def streamed_bytes(model) -> int:
    stats = getattr(model, "stats", None)
    return int(getattr(stats, "streamed_bytes", 0) or 0)


def decode_to_stdout(models, ids: list[int], cfg, record: dict, live: bool, stats_json: Path | None,
                     state: DecodeState | None = None, tuner=None, link_gbps: float | None = None,
                     color: bool = False) -> RunStats:
    """Stream one continuation of `ids`; `record` is the config part of the stats JSON."""
    stats = RunStats(config=record)
    state = state if state is not None else DecodeState()
    streamed0 = streamed_bytes(models.target)
    meter = LinkMeter(models.target)
    sink = TextSink(color=color)
    try:
        with display.LiveView(live, link_gbps=link_gbps) as view:
            try:
                events = tuner.drive(models, state, ids, cfg) if tuner else generate(models, state, ids, cfg)
                for ev in events:
                    sink(ev.text)
                    stats.add(ev)
                    meter.step(stats, ev)
                    stats.streamed_bytes = streamed_bytes(models.target) - streamed0
                    if tuner is not None:
                        stats.config.update(budget=tuner.shape.budget, max_depth=tuner.shape.max_depth)
                    view.update(stats, {"budget": "auto"} if tuner else None)
            finally:
                sink.end_line()  # before the view closes: the summary must not run into the text
    finally:
        if stats_json is not None:
            stats_json.write_text(json.dumps(stats.to_json(), indent=1) + "\n")
    return stats
