"""Sampling defaults from a checkpoint's generation defaults, the way transformers reads them.

Contract: a checkpoint's generation defaults `gen` are its generation_config.json as a dict, or
for a GGUF the same keys built from its metadata (offload/formats/gguf.py: `general.sampling.*`,
which llama.cpp also applies as defaults, ollama's params over them, `do_sample` when a temperature
above 0 is given); `generation_of(target)` gives a ModelRef's. `checkpoint_sampling(gen)` returns the
`SamplingParams` a request (or `run`/`chat` without --temperature/--top-k/--top-p) uses when it sets
none: greedy unless `gen` says `do_sample: true`; then its temperature/top_k/top_p, with
transformers' own defaults (1.0, 50, 1.0) for the ones it leaves out. Nothing given means greedy.
`serve_sampling(gen)` is what `specx serve` uses instead: the same where `gen` says anything about
sampling, and llama-server's defaults (SERVE_DEFAULTS) for what it leaves unsaid, so that a server
whose requests and checkpoint set nothing samples as llama-server and ollama do (`run`/`chat` stay
greedy there). `merge` lets explicitly set values win one by one. No torch, no transformers.
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


def generation_of(target) -> dict:
    """The generation defaults of `target` (a ModelRef): its opened checkpoint's, else (pickle weights
    under --allow-pickle, which no offload reader opens) its generation_config.json."""
    if target.format == "pickle":
        return read_generation_config(target.path)
    return target.checkpoint.generation


def numbers(cfg: dict) -> dict:
    """The sampling values (HF_DEFAULTS' names) that `cfg` gives as numbers (a bool is not one)."""
    return {k: cfg[k] for k in HF_DEFAULTS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)}


def checkpoint_sampling(cfg: dict) -> SamplingParams:
    """The checkpoint's own sampling settings (greedy unless it samples; see the module docstring)."""
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


def serve_sampling(cfg: dict) -> SamplingParams:
    """`specx serve`'s sampling for requests that set none: the checkpoint's when its generation
    defaults have `do_sample` (transformers' reading, as `checkpoint_sampling`), its own
    temperature/top_k/top_p over SERVE_DEFAULTS when it has some of those without `do_sample`,
    else SERVE_DEFAULTS (nothing given, token ids only)."""
    if "do_sample" in cfg:
        return checkpoint_sampling(cfg)
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
