"""`python -m tests.slow_specx ARGS` = `python -m specexec_cli ARGS` with one phase made slow, for the
tests that interrupt a real specx process from outside (tests/test_interrupt.py, test_serve_cancel.py).

The product has no hook for this: before running the CLI, this launcher wraps
`specexec_cli.session.loading.load_models` (every CLI command looks it up there at call time).
`SPECX_TEST_SLOW` holds comma-separated `phase=seconds` pairs; each phase's delay is a plain
`time.sleep` on the thread that does the work, so a Ctrl-C lands exactly where it would during a
slow real phase, and the first time a phase is entered it prints a `specx-test: <phase>` line on
stderr, so a test knows when to send SIGINT:
- `load`: per layer of the offloaded target's load loop (through the load's progress callable);
- `target` / `draft`: before every decoder-layer forward of that model (a forward pre-hook on each
  layer: the prefill and verify passes for the target, tree growth for the draft);
- `copy`: before each streamed layer's read, in the prefetcher's read stage (its background
  thread for disk-tier layers).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from dataclasses import replace

ENV = "SPECX_TEST_SLOW"


def settings() -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in os.environ.get(ENV, "").split(","))):
        name, _, value = part.partition("=")
        out[name.strip()] = float(value or 0)
    return out


_seen: set[str] = set()


def pause(phase: str, seconds: float) -> None:
    if phase not in _seen:
        _seen.add(phase)
        print(f"specx-test: {phase}", file=sys.stderr, flush=True)
    time.sleep(seconds)


def slow_progress(progress, delay: float):
    """A load-progress callable under which each loaded layer takes `delay` seconds longer."""

    def wrapped(done, total, what):
        pause("load", delay)
        if progress is not None:
            progress(done, total, what)

    return wrapped


def _layers(model):
    inner = getattr(model, "model", None)
    return getattr(inner, "layers", None) or getattr(model, "layers", None) or []


def slow_models(models, conf: dict[str, float]) -> None:
    """The `target` / `draft` / `copy` delays put on the loaded models."""
    for role, model in (("target", models.target), ("draft", models.draft)):
        if model is not None and role in conf:
            for layer in _layers(model):
                layer.register_forward_pre_hook(lambda *_, r=role: pause(r, conf[r]))
    prefetcher = getattr(models.target, "prefetcher", None)
    if prefetcher is not None and "copy" in conf:
        read = prefetcher.read  # the read stage: runs on the prefetcher's thread for disk layers

        def slow_read(*args, **kwargs):
            pause("copy", conf["copy"])
            return read(*args, **kwargs)

        prefetcher.read = slow_read


def install(conf: dict[str, float]) -> None:
    from specexec_cli.session import loading

    load_models = loading.load_models

    def slow_load_models(opts):
        if "load" in conf:
            opts = replace(opts, progress=slow_progress(opts.progress, conf["load"]))
        models = load_models(opts)
        slow_models(models, conf)
        return models

    loading.load_models = slow_load_models


if __name__ == "__main__":
    install(settings())
    runpy.run_module("specexec_cli", run_name="__main__", alter_sys=True)
