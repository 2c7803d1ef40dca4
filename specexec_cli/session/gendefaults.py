"""Sampling defaults from a checkpoint's generation_config.json, the way transformers reads them.

Contract: `checkpoint_sampling(model_dir)` returns the `SamplingParams` a request (or `run`/`chat`
without --temperature/--top-k/--top-p) uses when it sets none: greedy unless the file says
`do_sample: true`; then its temperature/top_k/top_p, with transformers' own defaults (1.0, 50, 1.0)
for the ones it leaves out. A missing or unreadable file means greedy. `merge` lets explicitly set
values win one by one. Pure file reading: no torch, no transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from specexec_cli.core.sampling import SamplingParams

HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' values when do_sample is set
GREEDY = SamplingParams()


def read_generation_config(model_dir: Path | str | None) -> dict:
    """The parsed generation_config.json of a model dir, or {} when absent or unreadable."""
    if model_dir is None:
        return {}
    try:
        data = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def checkpoint_sampling(model_dir: Path | str | None) -> SamplingParams:
    """The checkpoint's own sampling settings (greedy unless it samples; see the module docstring)."""
    cfg = read_generation_config(model_dir)
    if cfg.get("do_sample") is not True:
        return GREEDY
    values = {}
    for name, default in HF_DEFAULTS.items():
        value = cfg.get(name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        values[name] = value if ok else default
    try:
        params = SamplingParams(temperature=float(values["temperature"]), top_k=int(values["top_k"]),
                                top_p=float(values["top_p"]))  # fmt: skip
    except (TypeError, ValueError, OverflowError):
        return SamplingParams(**HF_DEFAULTS)
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
        return SamplingParams(**HF_DEFAULTS)   # a broken file: transformers' defaults, never an error
    return params


def merge(defaults: SamplingParams, temperature: float | None = None, top_k: int | None = None,
          top_p: float | None = None) -> SamplingParams:
    """`defaults` with each explicitly given value replacing its field."""
    return SamplingParams(
        temperature=defaults.temperature if temperature is None else float(temperature),
        top_k=defaults.top_k if top_k is None else int(top_k),
        top_p=defaults.top_p if top_p is None else float(top_p),
    )
