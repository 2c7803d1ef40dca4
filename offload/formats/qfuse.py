"""Sibling GGUF linears that read the same input, computed as ONE kernel call over their stacked rows.

Contract: `fuse_siblings(layer)` attaches a `FusedGroup` to the PackedLinears of each sibling set
(`SIBLINGS`: q/k/v, gate/up) that run the GGUF kernel on one type and input width.
`FusedGroup.take(member, x)` returns that member's x W^T (+ its bias), or None (it then computes
alone): the first member called computes every member in one `ggml_kernel.linear` over their bytes as
one matrix (a view: only while the bound bytes lie back to back in member order, checked on the
pointers at every call) and keeps the others' slices; a member called next with the same tensor x,
unmodified (`x._version`; an inference tensor keeps none: identity alone), and the same bytes gets its
slice. Each output row is its own dot product, so a slice is bit for bit the member's own call.
"""

from __future__ import annotations

import torch

from offload.cpu import ggml_kernel

SIBLINGS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


class FusedGroup:
    def __init__(self, members: list):
        self.members = members
        self.qtype = members[0].ggml_type
        self.sizes = [m.out_features for m in members]
        maps, off = [], 0
        for m in members:  # stored row r of member i -> output column off_i + its own column
            own = m.row_map if m.row_map is not None else torch.arange(m.out_features, dtype=torch.int32)
            maps.append(own.to(torch.int32) + off)
            off += m.out_features
        self.row_map = torch.cat(maps)
        self.out_features = off
        self._span: tuple | None = None  # (bound pointers, the stacked bytes view or None)
        self._x = self._ver = self._ptrs = None  # the input of the last fused call, while members wait
        self._outs: dict = {}  # member id -> its slice, not yet taken

    def _raws(self) -> list[torch.Tensor]:
        return [getattr(m, next(iter(m.parts))) for m in self.members]

    def _stacked(self, raws: list[torch.Tensor], ptrs: tuple) -> torch.Tensor | None:
        """The members' bytes as one flat uint8 view when they lie back to back in one buffer, else None."""
        if self._span is not None and self._span[0] == ptrs:
            return self._span[1]
        first, view = raws[0], None
        adjacent = all(
            r.device.type == "cpu"
            and r.dtype == torch.uint8
            and r.dim() == 1
            and r.is_contiguous()
            and r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            for r in raws
        )
        adjacent = adjacent and all(ptrs[i] + raws[i].numel() == ptrs[i + 1] for i in range(len(raws) - 1))
        if adjacent:
            total = sum(r.numel() for r in raws)
            view = first.as_strided((total,), (1,), first.storage_offset())
        self._span = (ptrs, view)
        return view

    def stacked(self) -> torch.Tensor | None:
        """The members' bytes as one flat view (their stored rows in member order), or None when
        they are not back to back (cpu/leanstack.py multiplies by it in C)."""
        raws = self._raws()
        return self._stacked(raws, tuple(r.data_ptr() for r in raws))

    def take(self, member, x: torch.Tensor) -> torch.Tensor | None:
        raws = self._raws()
        ptrs = tuple(r.data_ptr() for r in raws)
        key = id(member)
        if x is self._x and _version(x) == self._ver and ptrs == self._ptrs and key in self._outs:
            y = self._outs.pop(key)
            if not self._outs:
                self._x = None
            return y
        limit = ggml_kernel.MAX_ROWS if any(m.dense is not None for m in self.members) else None
        if not ggml_kernel.usable(x, self.qtype, limit):
            return None
        raw = self._stacked(raws, ptrs)
        if raw is None:
            return None
        y = ggml_kernel.linear(x, raw, self.qtype, self.out_features, self.row_map)
        outs = {}
        for m, part in zip(self.members, y.split(self.sizes, dim=-1)):
            outs[id(m)] = part if m.bias is None else part + m.bias.to(part.dtype)
        mine = outs.pop(key)
        self._x, self._ver, self._ptrs, self._outs = x, _version(x), ptrs, outs
        return mine


def _version(x: torch.Tensor) -> int:
    """x's in-place write counter; an inference tensor keeps none (-1: identity alone decides)."""
    return -1 if x.is_inference() else x._version


def fuse_siblings(layer: torch.nn.Module) -> int:
    """Attach a FusedGroup to each eligible sibling set of `layer`; returns how many were attached."""
    n = 0
    for names in SIBLINGS:
        try:
            mods = [layer.get_submodule(name) for name in names]
        except AttributeError:
            continue
        # qlinear.PackedLinear members (told apart by their fields: qlinear imports this module, not back)
        if not all(getattr(m, "ggml_type", None) is not None and len(getattr(m, "parts", ())) == 1 for m in mods):
            continue
        if len({(m.ggml_type, m.in_features) for m in mods}) != 1:
            continue
        group = FusedGroup(mods)
        for m in mods:
            m.group = group
        n += 1
    return n
