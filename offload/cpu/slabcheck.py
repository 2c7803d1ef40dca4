"""Which K/V cache a one-call stack pass can write straight into (cpu/leanstack.py).

Contract: `SlabCheck(idx, hkv, hd, window)(cache, t)` returns the cache layers `idx` when every one is
a slab the C stack can read and append to: fp32 CPU contiguous `keys` and `values` of shape
(1, hkv, cap, hd), at one common int `length` with room for t more rows (and, with a sliding `window`,
length + t <= window); else None. Types and shapes are checked once per slab tensors (held by weak
reference), later calls only the lengths; at most KEEP caches are remembered (a server makes one a request)."""

from __future__ import annotations

import weakref

import torch

KEEP = 8  # caches whose slabs are remembered as checked


class SlabCheck:
    def __init__(self, idx: list[int], hkv: int, hd: int, window: int | None):
        self.idx, self.hkv, self.hd, self.window = idx, hkv, hd, window
        self._seen: dict[int, tuple] = {}  # id(cache.layers) -> (weakrefs of each (keys, values), min cap)

    def __call__(self, cache, t: int) -> list | None:
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) <= max(self.idx):
            return None
        picked = [layers[i] for i in self.idx]
        seen = self._seen.get(id(layers))
        if seen is not None and all(
            getattr(x, "keys", None) is k() and getattr(x, "values", None) is v() for x, (k, v) in zip(picked, seen[0])
        ):
            return picked if self._room(picked, t, seen[1]) else None
        if not all(self._slab(x) for x in picked):
            return None
        cap = min(x.keys.shape[2] for x in picked)
        self._seen[id(layers)] = ([(weakref.ref(x.keys), weakref.ref(x.values)) for x in picked], cap)
        while len(self._seen) > KEEP:
            self._seen.pop(next(iter(self._seen)))
        return picked if self._room(picked, t, cap) else None

    def _room(self, picked: list, t: int, cap: int) -> bool:
        """Every layer at one length, with t more rows inside the slabs and the window."""
        past = picked[0].length
        if not isinstance(past, int) or any(x.length != past for x in picked):
            return False
        return past + t <= cap and (self.window is None or past + t <= self.window)

    def _slab(self, layer) -> bool:
        """One cache layer's keys and values are a slab the stack reads (the contract's types and shape)."""
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            return False
        return (
            isinstance(getattr(layer, "length", None), int)
            and keys.dtype == torch.float32
            and keys.device.type == "cpu"
            and keys.dim() == 4
            and keys.shape[:2] == (1, self.hkv)
            and keys.shape[3] == self.hd
            and keys.is_contiguous()
            and values.shape == keys.shape
            and values.dtype == keys.dtype
            and values.is_contiguous()
        )
