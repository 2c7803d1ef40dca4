"""Sampling defaults from a checkpoint's generation_config.json, the way transformers reads them.

Contract: `checkpoint_sampling(model_dir)` returns the `SamplingParams` a request (or `run`/`chat`
without --temperature/--top-k/--top-p) uses when it sets none: greedy unless the file says
`do_sample: true`; then its temperature/top_k/top_p, with transformers' own defaults (1.0, 50, 1.0)
for the ones it leaves out. A missing or unreadable file means greedy. `serve_sampling(model_dir)`
is what `specx serve` uses instead: the same where the file says anything about sampling, and
llama-server's defaults (SERVE_DEFAULTS) for what it leaves unsaid, so that a server whose requests
and checkpoint set nothing samples as llama-server and ollama do (`run`/`chat` stay greedy there).
`merge` lets explicitly set values win one by one. Pure file reading: no torch, no transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from specexec_cli.core.sampling import SamplingParams

HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' values when do_sample is set
GREEDY = SamplingParams()
# llama-server's sampling defaults (common/common.h: temp 0.8, top_k 40, top_p 0.95); its min_p 0.05
# has no counterpart in core/sampling.py and is not applied
SERVE_DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)


def read_generation_config(model_dir: Path | str | None) -> dict:
    """The parsed generation_config.json of a model dir, or {} when absent or unreadable."""
    if model_dir is None:
        return {}
    try:
        data = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def numbers(cfg: dict) -> dict:
    """The sampling values (HF_DEFAULTS' names) that `cfg` gives as numbers (a bool is not one)."""
    return {k: cfg[k] for k in HF_DEFAULTS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)}


def checkpoint_sampling(model_dir: Path | str | None) -> SamplingParams:
    """The checkpoint's own sampling settings (greedy unless it samples; see the module docstring)."""
    cfg = read_generation_config(model_dir)
    if cfg.get("do_sample") is not True:
        return GREEDY
    values = {**HF_DEFAULTS, **numbers(cfg)}
    try:
        params = SamplingParams(
            temperature=float(values["temperature"]), top_k=int(values["top_k"]), top_p=float(values["top_p"])
        )
    except (TypeError, ValueError, OverflowError):
        return SamplingParams(**HF_DEFAULTS)
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
        return SamplingParams(**HF_DEFAULTS)  # a broken file: transformers' defaults, never an error
    return params


def serve_sampling(model_dir: Path | str | None) -> SamplingParams:
    """`specx serve`'s sampling for requests that set none: the checkpoint's when its
    generation_config.json has `do_sample` (transformers' reading, as `checkpoint_sampling`), its
    own temperature/top_k/top_p over SERVE_DEFAULTS when it has some of those without `do_sample`,
    else SERVE_DEFAULTS (no file, a GGUF, a file of token ids only)."""
    cfg = read_generation_config(model_dir)
    if "do_sample" in cfg:
        return checkpoint_sampling(model_dir)
    given = numbers(cfg)
    try:
        params = merge(SERVE_DEFAULTS, given.get("temperature"), given.get("top_k"), given.get("top_p"))
    except (ValueError, OverflowError):
        return SERVE_DEFAULTS
    if not (params.temperature >= 0 and 0 < params.top_p <= 1 and params.top_k >= 0):
        return SERVE_DEFAULTS  # a broken file (NaN too): never an error
    return params


def merge(
    defaults: SamplingParams, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None
) -> SamplingParams:
    """`defaults` with each explicitly given value replacing its field."""
    return SamplingParams(
        temperature=defaults.temperature if temperature is None else float(temperature),
        top_k=defaults.top_k if top_k is None else int(top_k),
        top_p=defaults.top_p if top_p is None else float(top_p),
    )
