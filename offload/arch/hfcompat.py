"""The one place where transformers' API drift across the declared version range is absorbed.

Contract: transformers 5.24 renamed the KV-cache keyword `past_key_values` to `cache`.
`cache_kwargs(fn, cache)` returns `{name: cache}` with the name `fn` accepts in the installed version;
`output_cache_kwargs(cls, cache)` does the same for ModelOutput dataclasses. `register_as(name, forward,
mask)` makes an attention function and its mask builder known to transformers under `name`, once.
"""

from __future__ import annotations

import dataclasses
import inspect
from functools import cache, lru_cache

NEW, OLD = "cache", "past_key_values"


@cache
def _cache_name(fn) -> str:
    """The cache keyword of `fn` (its signature, following decorators' __wrapped__)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins or C callables: the installed convention
        return installed_name()
    if NEW in params or OLD in params:
        return NEW if NEW in params else OLD
    return installed_name()  # (*args, **kwargs) wrappers: whatever transformers expects


@lru_cache(maxsize=1)
def installed_name() -> str:
    """The installed transformers' convention, read off `create_causal_mask`'s signature."""
    from transformers.masking_utils import create_causal_mask

    return NEW if NEW in inspect.signature(create_causal_mask).parameters else OLD


def cache_kwargs(fn, cache) -> dict:
    target = getattr(fn, "forward", fn)  # an nn.Module: look at its forward's signature
    return {_cache_name(getattr(target, "__func__", target)): cache}


@cache
def _output_name(cls) -> str:
    names = {f.name for f in dataclasses.fields(cls)}
    return NEW if NEW in names else OLD


def output_cache_kwargs(cls, cache) -> dict:
    return {_output_name(cls): cache}


def register_as(name: str, forward, mask) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, forward)
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(name, mask)
    return name
