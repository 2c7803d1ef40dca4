"""Model calls and KV-cache surgery shared by every decoding method.

Contract: a model is any HF-style causal LM (resident or `offload.OffloadedCausalLM`) taking
`input_ids, attention_mask (4-D additive), position_ids, past_key_values, logits_to_keep` and
returning `.logits`. A `SlabCache` is a `transformers.Cache` whose layers keep K and V in one
(1, kv_heads, capacity, head_dim) slab each and a `length`; `update` writes the new rows in place and
returns views of rows [0, length), what a DynamicCache would hold. `reserve` allocates the planned
rows up front (optionally through a counting allocator); `compact` moves a pass's kept rows together
in place and `crop` moves `length`, so a planned cache never reallocates (an unreserved one grows by
doubling; a reserved one that must grow warns once). `compact`/`crop` accept DynamicCaches too.
While `write_rows` holds a (T,) device tensor (draftstep.py's static passes), `update` writes the T
rows there and returns the WHOLE slabs, leaving `length` to `set_length`.

`SharedCache` (a self-draft's): the draft reads the target's committed K/V and writes its tree rows
into the target's slabs just past them, which the next verify pass overwrites; `follow(n)` puts it
at the target's n committed rows, and `compact` never moves those.
"""

from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from offload import cache_kwargs
from specexec_cli.core.transfers import upload

MIN_ROWS = 256  # first slab of an unreserved cache


def _torch_alloc(shape, dtype, device, component):
    return torch.empty(shape, dtype=dtype, device=device)


class SlabLayer(CacheLayerMixin):
    """One decoder layer's K/V: slabs `keys`/`values` (1, H, capacity, D), rows [0, length) valid."""

    is_sliding = False
    is_croppable = True

    def __init__(self, owner: SlabCache):
        super().__init__()
        self.owner = owner
        self.length = 0

    def allocate(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.keys = self.owner.alloc(shape, dtype, device, self.owner.component)
        self.values = self.owner.alloc(shape, dtype, device, self.owner.component)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, t, d = key_states.shape
        rows = self.owner.capacity or max(MIN_ROWS, 2 * t)
        self.allocate((b, h, rows, d), key_states.dtype, key_states.device)

    def _grow(self, rows: int) -> None:
        old_k, old_v = self.keys, self.values
        b, h, cap, d = old_k.shape
        if self.owner.capacity is not None and not self.owner.warned:
            warnings.warn(f"KV cache needs {rows} rows but the memory plan reserved {cap}; growing it", stacklevel=1)
            self.owner.warned = True
        self.owner.release(old_k, old_v)
        self.allocate((b, h, max(rows, 2 * cap), d), old_k.dtype, old_k.device)
        self.keys[:, :, : self.length] = old_k[:, :, : self.length]
        self.values[:, :, : self.length] = old_v[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows, keys, values = self.owner.write_rows, self.keys, self.values
        if rows is not None and keys is not None and values is not None:  # a static-shape pass (reserved slabs):
            keys.index_copy_(2, rows, key_states)  # (1, H, T, D) new rows at the device rows; whole slabs back
            values.index_copy_(2, rows, value_states)
            return keys, values
        end = self.length + key_states.shape[-2]
        self._make_room(key_states, value_states, end)
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _make_room(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        """Slabs allocated with at least `end` rows (rows [0, length) kept)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if end > self.keys.shape[-2]:
            self._grow(end)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else -1

    def get_max_cache_shape(self) -> int:
        """-1: a growing cache, as DynamicLayer says (abstract in transformers < 5.2x)."""
        return -1

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """HF convention: remove the last `-tokens_to_remove` rows (a negative count; 0 = no-op)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of rows to remove")
        self.length = max(0, self.length + tokens_to_remove)


class SlabCache(Cache):
    """A `transformers.Cache` of `SlabLayer`s; see the module docstring."""

    def __init__(self, capacity: int | None = None, alloc=None, component: str = "kv"):
        super().__init__(layers=[])
        self.capacity = capacity  # rows per slab once reserved; None = grow on demand
        self.alloc = alloc or _torch_alloc  # callable(shape, dtype, device, component) -> tensor
        self.component = component  # allocator counter name, e.g. "kv_target"
        self.release = lambda *tensors: None  # set by `reserve` when the allocator counts frees
        self.warned = False
        self.write_rows: torch.Tensor | None = None  # (T,) device rows a static-shape pass writes; None = append

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(SlabLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)


class AliasLayer(SlabLayer):
    """A draft layer whose K/V live in the target's SlabLayer `base` (same slabs, its own `length`)."""

    def __init__(self, owner: SharedCache, base: SlabLayer):
        super().__init__(owner)
        self.base = base

    @property
    def is_initialized(self) -> bool:
        return self.base.is_initialized

    @is_initialized.setter
    def is_initialized(self, value) -> None:  # CacheLayerMixin.__init__ assigns it; the base decides
        pass

    keys = property(lambda self: self.base.keys, lambda self, v: None)
    values = property(lambda self: self.base.values, lambda self, v: None)
    dtype = property(lambda self: self.base.dtype, lambda self, v: None)
    device = property(lambda self: self.base.device, lambda self, v: None)

    def _make_room(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        committed, self.base.length = self.base.length, self.length  # a grown slab keeps the draft's rows too
        self.base._make_room(key_states, value_states, end)
        self.base.length = committed


class SharedCache(Cache):
    """The self-draft's view of the target's `SlabCache` (see the module docstring)."""

    def __init__(self, target: SlabCache):
        super().__init__(layers=[])
        self.target = target
        self.start = 0  # committed rows the draft reads (the latest `follow`); new layers start there
        self.write_rows = None  # always appended (a static-shape pass needs slabs of its own)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Rows the draft sees: its layers' length, or the followed start before its first pass."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return layer.length if isinstance(layer, SlabLayer) else self.start

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.target.layers) <= layer_idx:
            self.target.layers.append(SlabLayer(self.target))
        while len(self.layers) <= layer_idx:
            self.layers.append(AliasLayer(self, self.target.layers[len(self.layers)]))
            self.layers[-1].length = self.start
        return self.layers[layer_idx].update(key_states, value_states)

    def follow(self, n: int) -> None:
        """The draft starts from the target's first `n` committed rows (its own tree rows are dropped)."""
        self.start = n
        for layer in self.layers:
            layer.length = n


def new_cache() -> SlabCache:
    """An empty full-attention cache (tree masks need every position, so no sliding layers)."""
    return SlabCache()


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of `model`'s cache, from its config (text_config for wrappers)."""
    cfg = getattr(model.config, "text_config", None) or model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim


def reserve(cache, model, rows: int, pool=None, component: str = "kv") -> None:
    """Allocate every layer's slabs for `rows` positions now (no-op if already allocated)."""
    if not isinstance(cache, SlabCache) or cache.layers:
        return
    layers, kv_heads, head_dim = kv_shape(model)
    cache.capacity, cache.component = rows, component
    if pool is not None:
        cache.alloc = lambda shape, dtype, device, comp: pool.empty(shape, dtype, comp)
        cache.release = lambda *ts: pool.free(component, *ts)
    dtype, device = model_dtype(model), model.device
    for _ in range(layers):
        layer = SlabLayer(cache)
        layer.allocate((1, kv_heads, rows, head_dim), dtype, device)
        cache.layers.append(layer)


def cache_len(cache) -> int:
    return cache.get_seq_length()


def slab_rows(cache) -> int | None:
    """Rows of the first layer's K slab; None before any allocation or for another cache."""
    keys = _first_slab(cache)
    return None if keys is None else int(keys.shape[-2])


def slab_ptr(cache) -> int:
    """Address of the first layer's K slab (0 = none): changes when the slabs are reallocated."""
    keys = _first_slab(cache)
    return 0 if keys is None else int(keys.data_ptr())


def _first_slab(cache) -> torch.Tensor | None:
    layer = cache.layers[0] if cache.layers else None
    if not isinstance(layer, SlabLayer) or not layer.is_initialized:
        return None
    return layer.keys


def set_length(cache, n: int) -> None:
    """Every layer holds `n` rows (after a static-shape pass wrote its rows at `write_rows`)."""
    for layer in cache.layers:
        if isinstance(layer, SlabLayer):
            layer.length = n


@torch.inference_mode()
def zero_tail(cache) -> None:
    """Zero every slab row past its layer's length: a whole-slab pass must not meet NaN (0 * NaN)."""
    for layer in cache.layers:
        if isinstance(layer, SlabLayer) and layer.keys is not None and layer.values is not None:
            layer.keys[:, :, layer.length :].zero_()
            layer.values[:, :, layer.length :].zero_()


def drop_last(cache, rows: int) -> None:
    """Forget every layer's last `rows` rows (a padded pass's padding): only the lengths move."""
    if rows > 0:
        for layer in cache.layers:
            layer.crop(-rows)


def model_dtype(model) -> torch.dtype:
    dtype = getattr(model, "dtype", torch.float32)
    return dtype if dtype.is_floating_point else torch.float32


def stage(model, tokens: torch.Tensor, positions: torch.Tensor, *extra: torch.Tensor) -> list[torch.Tensor]:
    """A pass's host-built ids (kept on the host with host embeddings), positions and `extra` long
    tensors -> the model's device in ONE counted upload (transfers.upload)."""
    device = torch.device(model.device)
    if torch.device(getattr(model, "input_device", device)) == device:
        return upload(device, tokens, positions, *extra)
    return [tokens, *upload(device, positions, *extra)]


def forward(
    model, cache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, last_only: bool = False
) -> torch.Tensor:
    """One model pass over T new tokens ((T,) long ids and positions; mask (1, 1, T, past+T) or None:
    causal) -> (T, V) logits, (1, V) with `last_only`; their K/V appended to `cache`."""
    tokens, positions = stage(model, tokens, positions)  # one copy for both (host embeddings: ids stay)
    if mask is not None:
        assert mask.device == torch.device(model.device), "build masks on the model's device (tree.py)"
        mask = mask.to(dtype=model_dtype(model))
    with torch.inference_mode():
        out = model(
            input_ids=tokens[None],  # (1, T)
            position_ids=positions[None],  # (1, T)
            attention_mask=mask,  # (1, 1, T, past + T) additive, or None: plain causal (prefill)
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            **cache_kwargs(model, cache),
        )
    return out.logits[0]


@torch.inference_mode()
def compact(cache, start: int, rows: torch.Tensor) -> None:
    """Keep rows [0, start) plus the absolute `rows` (ascending, >= start), moved to [start, start + n)."""
    n = int(rows.numel())
    if isinstance(cache, SharedCache):  # rows below the followed start are the target's committed ones
        if n and start < cache.start:
            raise RuntimeError("a shared draft cache never moves the target's committed rows")
        if not n:
            cache.follow(start)
            return
    on_device: dict[torch.device, torch.Tensor] = {}  # rows moved once per device, not per layer
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        dev = layer.keys.device
        if n and dev not in on_device:
            on_device[dev] = upload(dev, rows)[0]
        idx = on_device.get(dev)
        for name in ("keys", "values"):
            t = getattr(layer, name)  # (B, H, S, D)
            if n:
                t[:, :, start : start + n] = t.index_select(2, idx)
            if not isinstance(layer, SlabLayer):
                setattr(layer, name, t[:, :, : start + n])
        if isinstance(layer, SlabLayer):
            layer.length = start + n


def crop(cache, length: int) -> None:
    """Cut the cache back to its first `length` positions."""
    compact(cache, length, torch.empty(0, dtype=torch.long))
