"""Sampling defaults from a checkpoint's generation defaults, the way transformers reads them.

Contract: a checkpoint's generation defaults `gen` are its generation_config.json as a dict (a
GGUF's built from its metadata; `generation_of(target)` gives a ModelRef's). `checkpoint_sampling(gen)`
is what `run`/`chat` use for unset flags: greedy unless `do_sample: true`, then its values over
transformers' defaults (1.0, 50, 1.0). `serve_sampling(gen)` is `specx serve`'s: the same where `gen`
says anything about sampling, else llama-server's defaults (SERVE_DEFAULTS). `merge` lets explicitly
set values win one by one. No torch, no transformers.
"""

from __future__ import annotations

from pathlib import Path

from specexec_cli.core.sampling import SamplingParams
from specexec_cli.session.strict import config_json

HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' values when do_sample is set
GREEDY = SamplingParams()
# llama-server's sampling defaults (common/common.h: temp 0.8, top_k 40, top_p 0.95); its min_p 0.05
# has no counterpart in core/sampling.py and is not applied
SERVE_DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)


def read_generation_config(model_dir: Path | str | None) -> dict:
    return {} if model_dir is None else config_json(model_dir, "generation_config.json")


def generation_of(target) -> dict:
    """The generation defaults of a ModelRef (pickle weights: its generation_config.json)."""
    if target.format == "pickle":
        return read_generation_config(target.path)
    return target.checkpoint.generation


def numbers(cfg: dict) -> dict:
    """The sampling values (HF_DEFAULTS' names) that `cfg` gives as numbers (a bool is not one)."""
    return {k: cfg[k] for k in HF_DEFAULTS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)}


def checkpoint_sampling(cfg: dict) -> SamplingParams:
    if cfg.get("do_sample") is not True:
        return GREEDY
    try:
        params = merge(SamplingParams(**HF_DEFAULTS), **numbers(cfg))
    except (ValueError, OverflowError):
        return SamplingParams(**HF_DEFAULTS)
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
        return SamplingParams(**HF_DEFAULTS)  # a broken file: transformers' defaults, never an error
    return params


def serve_sampling(cfg: dict) -> SamplingParams:
    """`specx serve`'s sampling for requests that set none (module docstring)."""
    if "do_sample" in cfg:
        return checkpoint_sampling(cfg)
    try:
        params = merge(SERVE_DEFAULTS, **numbers(cfg))
    except (ValueError, OverflowError):
        return SERVE_DEFAULTS
    if not (params.temperature >= 0 and 0 < params.top_p <= 1 and params.top_k >= 0):
        return SERVE_DEFAULTS  # a broken file (NaN too): never an error
    return params


def merge(
    defaults: SamplingParams, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None
) -> SamplingParams:
    return SamplingParams(
        temperature=defaults.temperature if temperature is None else float(temperature),
        top_k=defaults.top_k if top_k is None else int(top_k),
        top_p=defaults.top_p if top_p is None else float(top_p),
    )
