"""LeanStack: a resident Llama or Gemma-3 stack of GGUF layers, run for a few tokens as ONE C call per pass.

Contract:
- `LeanStack.build(model)` -> LeanStack | None for an OffloadedCausalLM; `why_not(model)` says in one
  line why there is none (None when there is one). It needs a CPU fp32 model of a family decode_stack.c
  computes (`family_reason`: plain Llama, Gemma-3 text; Gemma's 1 + w norm multipliers folded once into
  fp32 copies), every linear served by the GGUF kernel (cpu/ggml_kernel.py; q/k/v and gate/up one call
  each where formats/qfuse.py stacked them) and $SPECX_DECODE_STACK not "off". Resident layers' pointers
  are bound once, streamed layers' per pass (`stream`); a layer-skip draft's pass-throughs are left out.
- `serves(h, attention_mask, cache)`: h (1, T, D) fp32 with 0 < T <= `max_rows` (ggml_kernel.MAX_ROWS
  where some linear holds an fp32 copy, else STACK_ROWS), attention_mask None or an additive
  (1, 1, T, past + T) fp32 mask, and a cache whose layers are slabs at one length `past` with room for
  T rows (cpu/slabcheck.py); with sliding-window layers also past + T <= sliding_window, since the stack
  applies no window (a longer context takes the HF path).
- `__call__(h, position_embeddings, attention_mask, cache)` -> a new h after the last decoder layer:
  each layer computed as HF's LlamaDecoderLayer (Gemma3DecoderLayer) does, the same fp32 math up to the
  order of roundings; the K/V rows are written at [past, past + T) of every slab and each `length`
  advances by T. The final norm and the head stay the caller's.
- `run(jobs)`: several sequences' passes in ONE call (offload/stream/multi.py), each packed weight read
  once; every matmul row is computed as a one-row call computes it, so a one-token job gets bit for bit
  what `__call__` gives it alone.
Why: HF's decoder layer is about 40 small torch ops, about 0.33 ms of dispatch per layer on a 2-core CPU
(bench/pass_breakdown.py), more than its matmuls take on a 135M model.
"""

from __future__ import annotations

import ctypes

import torch

from offload.cpu import ggml_kernel
from offload.cpu.slabcheck import SlabCheck

ENV = "SPECX_DECODE_STACK"   # auto (default) | off
ROWWISE = 2                  # decode_stack.c's flag: every matmul row as a one-row call computes it
ACT_SILU, ACT_GELU_TANH = 0, 1   # decode_stack.h's dims_t.act: Llama's SiLU, Gemma-3's GELU (tanh approximation)
STACK_ROWS = 64              # rows per pass of a stack with no fp32 copy (the self-draft's frontier, small trees)
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
         ctypes.c_int]   # decode_stack_lanes(lanes, L, nl, dims, h, nthreads, flags)


class _Seg(ctypes.Structure):     # decode_stack.c's seg_t: one matmul's packed weight (rows 0: unused)
    _fields_ = [("w", ctypes.c_void_p), ("map", ctypes.c_void_p), ("type", ctypes.c_int32), ("rows", ctypes.c_int64)]


class _Layer(ctypes.Structure):   # decode_stack.c's layer_t, field for field
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("post_attn_norm", ctypes.c_void_p), ("post_ffn_norm", ctypes.c_void_p),
                ("qkv", _Seg * 3), ("o", _Seg), ("gu", _Seg * 2), ("down", _Seg), ("rope", ctypes.c_int64),
                ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("cap", ctypes.c_int64), ("past", ctypes.c_int64)]


_WEIGHT_BYTES = _Layer.k.offset   # layer_t's weight fields come first: norms, then the matmuls' segments


class _LaneT(ctypes.Structure):   # decode_stack.c's lane_t
    _fields_ = [("layers", ctypes.c_void_p), ("T", ctypes.c_int64), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("mask_cols", ctypes.c_int64)]


class _Dims(ctypes.Structure):    # decode_stack.c's dims_t
    _fields_ = [("D", ctypes.c_int64), ("H", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("hd", ctypes.c_int64),
                ("F", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("act", ctypes.c_int32)]


def _function():
    return ggml_kernel.function("decode_stack_lanes", _ARGS)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


GEMMA3 = "gemma3_text"


def family_reason(cfg) -> str | None:
    """None when HF config `cfg` is a family decode_stack.c computes (plain Llama, Gemma-3 text), else
    why not. The planner asks the same (planning/memlayers.kernel_terms), so the model and the loader agree."""
    if ggml_kernel.turned_off(ENV):
        return f"${ENV}=off"
    def get(key, default=None):   # a PretrainedConfig, or the planner's config.json-style dict
        return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)
    family = get("model_type")
    if family == GEMMA3:
        if get("hidden_activation") != "gelu_pytorch_tanh":
            return f"Gemma-3 activation {get('hidden_activation')!r} is not gelu_pytorch_tanh"
        if get("attn_logit_softcapping") is not None or get("use_bidirectional_attention", False):
            return "Gemma-3 attention with soft-capping or bidirectional attention"
    elif family != "llama" or get("hidden_act") != "silu":
        return f"family {family!r} is not plain Llama or Gemma-3"
    if get("attention_bias", False) or get("mlp_bias", False):
        return "the model's linears have biases"
    return None


def _kind(layer) -> str | None:
    """ "llama", "gemma3" (HF's Gemma3DecoderLayer or arch/gemma3.py's TypedLayer) or None, by class name."""
    name = type(layer).__name__
    if name == "LlamaDecoderLayer":
        return "llama"
    if name in ("Gemma3DecoderLayer", "TypedLayer") and any(
        c.__name__ == "Gemma3DecoderLayer" for c in type(layer).__mro__
    ):
        return "gemma3"
    return None


def _rope_types(cfg) -> list[str]:
    """The rotary tables of a pass, in order (arch/gemma3.py's TypedRope.by_type keys): one per layer type."""
    return sorted(set(getattr(cfg, "layer_types", None) or ())) or ["full_attention"]


def _multiplier(norm) -> torch.Tensor | None:
    """What a Gemma-3 RMSNorm multiplies the normed x by, as an fp32 copy made once: 1 + w (HF's
    Gemma3RMSNorm), or arch/gemma3.py's PlusOneNorm's 1 + (s - 1) of a stored s; None for another norm."""
    w = norm.weight
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return None
    name = type(norm).__name__
    if name == "Gemma3RMSNorm":
        return (1.0 + w.detach().float()).contiguous()
    if name == "PlusOneNorm":
        return (1.0 + (w.detach().float() - 1.0)).contiguous()
    return None


def _streamed_parts(layer) -> dict | None:
    """A STREAMED layer's parts before its bytes are bound ({"idx"}: `stream` binds the rest per pass), where it
    can run on the stack once bound (seven kernel-served GGUF linears, no bias), else None."""
    if _kind(layer) is None:
        return None
    at, mlp = layer.self_attn, layer.mlp
    mods = (at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    ok = all(getattr(m, "ggml_type", None) is not None and getattr(m, "bias", None) is None for m in mods)
    return {"idx": at.layer_idx} if ok else None


def _streamed(model) -> frozenset:
    plan = getattr(model, "plan", None)
    return frozenset(getattr(plan, "streamed", None) or ())


def _packed(mod) -> tuple[torch.Tensor, int, torch.Tensor | None, int] | None:
    """(bytes, ggml type, row map, rows) of a kernel-served PackedLinear bound on the CPU, else None."""
    if getattr(mod, "ggml_type", None) is None or getattr(mod, "bias", None) is not None:
        return None
    raw = getattr(mod, next(iter(mod.parts)))
    return (raw, mod.ggml_type, mod.row_map, mod.out_features) if raw.device.type == "cpu" else None


def _siblings(mods: list) -> list | None:
    """The segments of sibling linears side by side: one over their stacked bytes (formats/qfuse.py's
    group), or one each where they do not stack (types differ: a Q4_K_M file's v_proj has more bits)."""
    group = getattr(mods[0], "group", None)
    view = group.stacked() if group is not None else None
    if view is not None:
        return [(view, group.qtype, group.row_map, group.out_features)]
    segs = [_packed(m) for m in mods]
    return None if any(s is None for s in segs) else segs


def _layer_parts(layer) -> dict | None:
    """The tensors decode_stack.c reads for one decoder layer ({} for a pass-through), or None."""
    if type(layer).__name__ == "PassThrough":   # offload/selfdraft/build.py (told apart by name: stream < selfdraft)
        return {}
    kind = _kind(layer)
    if kind is None:
        return None
    at, mlp = layer.self_attn, layer.mlp
    parts = {"qkv": _siblings([at.q_proj, at.k_proj, at.v_proj]), "o": _packed(at.o_proj),
             "gu": _siblings([mlp.gate_proj, mlp.up_proj]), "down": _packed(mlp.down_proj)}
    if any(v is None for v in parts.values()):
        return None
    parts["idx"] = at.layer_idx
    if kind == "gemma3":   # attn, ffn, then q, k, post-attention, post-feedforward multipliers
        mods = (layer.input_layernorm, layer.pre_feedforward_layernorm, at.q_norm, at.k_norm,
                layer.post_attention_layernorm, layer.post_feedforward_layernorm)
        folded = [_multiplier(m) for m in mods]
        if any(w is None for w in folded):
            return None
        parts["norms"], parts["gemma"] = tuple(folded[:2]), tuple(folded[2:])
        parts["rope"] = _rope_types(at.config).index(at.layer_type)
        return parts
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous() for w in norms):
        return None
    parts["norms"] = norms
    return parts


def _stack_parts(model) -> list[dict] | str:
    """Each decoder layer's parts (`_layer_parts`, `_streamed_parts`), or one line on why `model` has no LeanStack."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "not a CPU fp32 model"
    reason = family_reason(model.config)
    if reason is not None:
        return reason
    if _function() is None:
        return ggml_kernel.kernel_status() or "the GGUF kernel library is not built"
    streamed = _streamed(model)
    parts = []
    for i, layer in enumerate(model.layers):
        parts.append(_streamed_parts(layer) if i in streamed else _layer_parts(layer))
        if parts[-1] is None:
            return f"decoder layer {i} is not a Llama or Gemma-3 layer of kernel-served GGUF linears"
    return parts if streamed or any(parts) else "every decoder layer is skipped"


def why_not(model) -> str | None:
    """One line on why `model` has no LeanStack, or None when it has one."""
    parts = _stack_parts(model)
    return parts if isinstance(parts, str) else None


def _fill(s: _Layer, p: dict) -> None:
    """Point layer_t `s` at the norms and packed segments of `_layer_parts`' dict `p`."""
    s.attn_norm, s.ffn_norm = p["norms"][0].data_ptr(), p["norms"][1].data_ptr()
    gemma = p.get("gemma", (None,) * 4)
    s.q_norm, s.k_norm, s.post_attn_norm, s.post_ffn_norm = (_ptr(w) for w in gemma)
    s.rope = p.get("rope", 0)
    for name in ("qkv", "o", "gu", "down"):
        segs = p[name] if isinstance(p[name], list) else [p[name]]
        slots = getattr(s, name)
        for i, slot in enumerate(slots if isinstance(slots, ctypes.Array) else [slots]):   # unused slots: rows 0
            raw, qtype, rowmap, rows = segs[i] if i < len(segs) else (None, 0, None, 0)
            slot.w, slot.map, slot.type, slot.rows = _ptr(raw), _ptr(rowmap), qtype, rows


class LeanStack:
    def __init__(self, model, parts: list[dict], streamed: frozenset = frozenset()):
        cfg = model.config
        self.streamed = streamed                    # decoder layers whose bytes are bound per pass (`stream`)
        self.fn = _function()
        heads = cfg.num_attention_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.hkv = getattr(cfg, "num_key_value_heads", None) or heads
        gemma = getattr(cfg, "model_type", None) == GEMMA3
        norm = model.layers[0].input_layernorm
        eps = float(norm.eps if gemma else norm.variance_epsilon)
        scale = cfg.query_pre_attn_scalar ** -0.5 if gemma else self.hd ** -0.5
        self.dims = _Dims(cfg.hidden_size, heads, self.hkv, self.hd, cfg.intermediate_size, eps, scale,
                          ACT_GELU_TANH if gemma else ACT_SILU)
        self.ropes = _rope_types(cfg) if gemma else None   # the rotary tables' layer types, in order (Gemma-3)
        types = getattr(cfg, "layer_types", None) or ()
        # sliding layers: the stack applies no window, so it serves only passes no window can cut (`serves`)
        self.window = getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None
        self.parts = parts                          # keeps every tensor the structs point at alive
        self.idx = [p["idx"] for p in parts]        # cache layer of each decoder layer
        self.structs = (_Layer * len(parts))()
        for s, p in zip(self.structs, parts):
            if "norms" in p:   # resident: bound once
                _fill(s, p)
        # rows a pass may have on the stack: with an fp32 copy of some linear, a library GEMM beats the
        # kernel above MAX_ROWS; with none (a kernel-block self-draft) the kernel serves every size anyway
        dense = any(getattr(m, "dense", None) is not None for layer in model.layers for m in layer.modules())
        self.max_rows = ggml_kernel.MAX_ROWS if dense else STACK_ROWS
        self.spare: list = []                       # layer_t arrays of the lanes beyond the first (run)
        self._filled: dict[tuple[int, int], tuple] = {}   # (streamed layer, buffer) -> (its layer_t, parts)
        self.slabs = SlabCheck(self.idx, self.hkv, self.hd, self.window)   # (cache, t) -> its slabs or None

    @classmethod
    def build(cls, model) -> LeanStack | None:
        parts = _stack_parts(model)
        if isinstance(parts, str):
            return None
        streamed = _streamed(model)
        # streamed: every layer kept, the streamed ones' pointers bound per pass (`stream`); else pass-throughs left out
        return cls(model, parts if streamed else [p for p in parts if p], streamed)

    def serves(self, h: torch.Tensor, attention_mask: torch.Tensor | None, cache) -> bool:
        if ggml_kernel.turned_off(ENV) or h.dim() != 3 or h.shape[0] != 1 or h.dtype != torch.float32 or not h.is_cpu:
            return False
        t = h.shape[1]
        if not 0 < t <= self.max_rows:
            return False
        slabs = self.slabs(cache, t)
        if slabs is None:
            return False
        if attention_mask is None:
            return True
        m = attention_mask
        return m.dtype == torch.float32 and m.is_cpu and tuple(m.shape) == (1, 1, t, slabs[0].length + t)

    def __call__(self, h: torch.Tensor, position_embeddings, attention_mask: torch.Tensor | None, cache):
        return self.run([(h, position_embeddings, attention_mask, cache)])[0]

    def run(self, jobs: list) -> list[torch.Tensor]:
        """`jobs` = [(h, position_embeddings, attention_mask, cache)], each one `serves` accepts -> each h
        after the last decoder layer, in ONE call (the contract; ROWWISE with more than one job)."""
        if self.streamed:
            raise RuntimeError("a stack with streamed layers runs one pass at a time (LeanStack.stream)")
        lanes, keep, flat = self._lanes(jobs)
        self._call(lanes, len(jobs), len(self.structs), flat, ROWWISE if len(jobs) > 1 else 0)
        self._advance(keep, jobs)
        return [part[None] for part in flat.split([h.shape[1] for h, *_ in jobs])]

    def stream(self, h: torch.Tensor, position_embeddings, attention_mask, cache, layers, modules) -> torch.Tensor:
        """`__call__` for a model whose `streamed` layers arrive one by one: `layers` yields each decoder
        layer's index once its bytes are bound (OffloadedCausalLM._layer_stream), `modules` are the layers.
        Layer i is its own C call, so the next streamed layer's read proceeds while this one computes."""
        lanes, keep, flat = self._lanes([(h, position_embeddings, attention_mask, cache)])
        base, size = ctypes.addressof(self.structs), ctypes.sizeof(_Layer)
        for i in layers:
            if i in self.streamed:
                ctypes.memmove(base + i * size, ctypes.addressof(self._bound(i, modules[i])), _WEIGHT_BYTES)
            lanes[0].layers = base + i * size   # this layer alone: its layer_t is the lane's layer 0
            self._call(lanes, 1, 1, flat, 0)
        self._advance(keep, [(h,)])
        return flat[None]

    def _bound(self, i: int, layer) -> _Layer:
        """A layer_t of streamed layer i's weight pointers as bound now, filled once per staging buffer (its
        q_proj bytes' address): the same buffer gives the same pointers every pass."""
        key = (i, _packed(layer.self_attn.q_proj)[0].data_ptr())
        if key not in self._filled:
            parts = _layer_parts(layer)
            if parts is None:
                raise RuntimeError(f"streamed decoder layer {i} is not kernel-served once bound")
            filled = _Layer()
            _fill(filled, parts)
            self._filled[key] = (filled, parts)   # parts: the tensors its pointers name stay alive
        return self._filled[key][0]

    def _lanes(self, jobs: list):
        """decode_stack.c's lane_t array for `jobs`, the tensors it points at, and the rows (sum T, D)."""
        lanes, keep, rows = (_LaneT * len(jobs))(), [], []
        while len(self.spare) < len(jobs) - 1:   # each lane beyond the first points at its own slabs
            self.spare.append((_Layer * len(self.structs)).from_buffer_copy(self.structs))
        for j, (lane, (h, emb, mask, cache)) in enumerate(zip(lanes, jobs)):
            t = h.shape[1]
            structs = self.structs if j == 0 else self.spare[j - 1]
            slabs = self.slabs(cache, t)
            for s, layer in zip(structs, slabs):
                s.k, s.v = layer.keys.data_ptr(), layer.values.data_ptr()
                s.cap, s.past = layer.keys.shape[2], layer.length
            if self.ropes is not None:   # Gemma-3: one table per layer type, (n, T, hd), in self.ropes' order
                by_type = getattr(emb, "by_type", None)   # a plain (cos, sin) rotates every layer (TypedLayer)
                emb = [torch.stack([(by_type[r] if by_type else emb)[k].reshape(t, self.hd) for r in self.ropes])
                       for k in (0, 1)]
            cos, sin = (e.reshape(-1, self.hd).to(torch.float32).contiguous() for e in emb)
            mask = None if mask is None else mask[0, 0].contiguous()
            lane.layers, lane.T, lane.cos, lane.sin = ctypes.addressof(structs), t, cos.data_ptr(), sin.data_ptr()
            lane.mask, lane.mask_cols = _ptr(mask), 0 if mask is None else mask.shape[1]
            keep.append((cos, sin, mask, slabs))
            rows.append(h[0])
        flat = torch.cat(rows).contiguous()   # (sum T, D): a new tensor, the inputs stay as they were
        return lanes, keep, flat

    def _call(self, lanes, n_lanes: int, n_layers: int, flat: torch.Tensor, flags: int) -> None:
        rc = self.fn(ctypes.addressof(lanes), n_lanes, n_layers, ctypes.addressof(self.dims), flat.data_ptr(),
                     ggml_kernel.threads(), flags)
        if rc != 0:
            raise RuntimeError(f"decode_stack failed ({rc})")

    def _advance(self, keep: list, jobs: list) -> None:
        """Each job's slabs hold T more rows: HF's cache update, done once per pass."""
        for (*_, slabs), (h, *_) in zip(keep, jobs):
            for layer in slabs:
                layer.length += h.shape[1]
