"""Test hooks that make a phase slow enough to interrupt it from outside (never used otherwise).

Contract: with `SPECX_TEST_SLOW` unset, nothing here does anything. Set it to comma-separated
`phase=seconds` pairs and `install(models)` / `slow_progress(progress)` add a delay (and print a
`specx-test: <phase>` marker line on stderr the first time the phase is entered, so a test knows
when to send SIGINT):
- `load`: per layer of the offloaded target's load loop (inside the real loading, via progress);
- `target` / `draft`: before every decoder-layer forward of that model (prefill and verify
  passes for the target; tree growth for the draft);
- `copy`: inside the prefetcher's read job (its background thread for disk-tier layers),
  before each streamed layer is read.
The delays are plain `time.sleep`s on the thread that does the work, so a Ctrl-C lands exactly
where it would during a slow real phase.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "SPECX_TEST_SLOW"


def settings() -> dict[str, float]:
    spec = os.environ.get(ENV, "")
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        out[name.strip()] = float(value or 0)
    return out


_seen: set[str] = set()


def pause(phase: str, seconds: float) -> None:
    if phase not in _seen:
        _seen.add(phase)
        print(f"specx-test: {phase}", file=sys.stderr, flush=True)
    time.sleep(seconds)


def slow_progress(progress):
    """Wrap a load-progress callable so each loaded layer takes `load` seconds longer."""
    delay = settings().get("load")
    if delay is None:
        return progress

    def wrapped(done, total, what):
        pause("load", delay)
        if progress is not None:
            progress(done, total, what)

    return wrapped


def _layers(model):
    inner = getattr(model, "model", None)
    return getattr(inner, "layers", None) or getattr(model, "layers", None) or []


def install(models) -> None:
    """Add the configured delays to the loaded models (see the module docstring)."""
    conf = settings()
    if not conf:
        return
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
