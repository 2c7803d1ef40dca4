"""OffloadedCausalLM: a HF causal LM (families.SUPPORTED) whose decoder layers stream.

Contract: `OffloadedCausalLM.from_pretrained(path, device, dtype, **options)` (loader.OffloadOptions) builds the
HF model on meta, materializes the globals on the device and keeps each decoder layer in one buffer (storage.py)
placed by the plan (placement.py, or the caller's memory plan). `model(...)` is ONE lane of multi.run_pass and
returns a `CausalLMOutputWithPast` whose logits equal HF's (tree masks, arbitrary positions and a caller-owned
cache included). Resident packed layers in `plan.dense` are dequantized once (quant/dense.py); MoE experts may
be read apart (expertstore.py) or split by tier (splitexperts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from offload.arch.families import Family, meta_model
from offload.arch.hfcompat import output_cache_kwargs
from offload.arch.moe import MOE_FAMILIES
from offload.cpu.leanstack import LeanStack
from offload.errors import OffloadError
from offload.formats import Checkpoint, open_checkpoint
from offload.formats.gguf_gptoss import swap_gguf_experts
from offload.formats.mxfp4 import swap_mxfp4_experts
from offload.formats.qlinear import swap_packed_linears
from offload.quant.dense import densify
from offload.quant.nf4 import CPU_PACKING, Nf4Linear, cpu_relayout, needs_cpu_layout, packing_for
from offload.quant.quant_cache import ensure_nf4_cache
from offload.stream.expertstore import param_slot
from offload.stream.loader import LoadedWeights, OffloadOptions, load_weights, resolve_dtype, wants_nf4
from offload.stream.multi import Lane, run_pass
from offload.stream.placement import OffloadPlan
from offload.stream.prefetch import Prefetcher


@dataclass
class OffloadStats:
    passes: int = 0
    streamed_bytes: int = 0  # bytes of streamed layers moved (file bytes read for disk), all passes
    streamed_bytes_per_pass: int = 0  # of the last pass
    stall_seconds: float = 0.0  # time compute blocked waiting for a streamed layer, all passes
    last_pass_stall_seconds: float = 0.0  # of the last pass
    link_busy_seconds: float = 0.0  # time the link stage moved bytes, all passes and between them


PACKED_FORMATS = ("awq", "gptq", "compressed-tensors", "gguf")  # streamed as stored, dequantized per pass


class OffloadedCausalLM(nn.Module):
    def __init__(self, config, device: torch.device, dtype: torch.dtype, hf, w: LoadedWeights, packing="standard"):
        super().__init__()
        self.packing = packing  # byte layout of the checkpoint's packed 4-bit weights
        self.config, self.device, self.dtype = config, device, dtype
        self.family = Family.of(config)
        self.embed_tokens, self.norm, self.lm_head = w.embed, w.norm, w.lm_head
        self.rotary_emb = w.rotary
        self.layers = hf.model.layers  # meta-device HF decoder layers, re-bound per pass
        self.plan: OffloadPlan = w.plan
        self.pool, self.store = w.pool, w.store
        self.stats = OffloadStats()
        # per layer (module, attribute, name) of each parameter, re-pointed at a buffer's views by _bind
        self._bindings = [[param_slot(layer, n) for n, _ in layer.named_parameters()] for layer in self.layers]
        self._views: dict[tuple[int, int], list] = {}  # (layer, buffer address) -> its parameters' views
        for i, (buf, layout) in [*w.pinned.items(), *w.resident.items()]:
            self._bind(i, buf, layout)
        for i in self.plan.dense:  # resident packed linears: dequantized once, counted in the pool
            densify(self.layers[i], self.pool)
        for i, states in w.qstates.items():
            for name, state in states.items():
                self.layers[i].get_submodule(name.rsplit(".", 1)[0]).quant_state = state
        self._prelay_cpu(w)
        self.experts = w.experts  # disk layers' routed experts, read on demand (stream/expertstore.py)
        if w.experts:
            w.experts.attach(self.layers, self.stats)
        self.split = w.split  # experts="split": each expert served from its tier (stream/splitexperts.py)
        if w.split is not None:
            w.split.attach(self.layers)
        self.prefetcher = Prefetcher(self.plan.streamed, self.store, device)
        self.lean = LeanStack.build(self)  # every layer in one C call for small passes, where it applies

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32, **options):
        """`options`: loader.OffloadOptions' fields, by name (each field's comment says what it does)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if unknown := sorted(options.keys() - OffloadOptions.__dataclass_fields__.keys()):
            valid = ", ".join(OffloadOptions.__dataclass_fields__)
            raise TypeError(f"from_pretrained: unknown option(s) {', '.join(unknown)}; the options are {valid}")
        opts = OffloadOptions(**options)
        ckpt, packing = _open_checked(path, dtype, device, opts.progress)
        storage_dtype, compute_dtype, nf4, hf = _skeleton(ckpt, dtype, device, opts.nf4_compute)
        w = load_weights(ckpt, hf, device, storage_dtype, compute_dtype, nf4, opts)
        model = cls(ckpt.hf_config, device, compute_dtype, hf, w, packing)
        model.source = ckpt.path  # the checkpoint it was loaded from (the nf4 cache for a 16-bit one)
        model.checkpoint = ckpt  # its opened Checkpoint (formats.base)
        return model

    @property
    def input_device(self) -> torch.device:
        """Where input_ids should live: the host when the embeddings do."""
        return torch.device("cpu") if type(self.embed_tokens).__name__ == "HostEmbedding" else self.device

    def _prelay_cpu(self, w: LoadedWeights) -> None:
        """On a CPU where bitsandbytes' fused AVX512-BF16 kernel computes 4-bit linears, put the packed bytes in
        its layout once per arrival (arenas now, disk slots after each read): the same bytes, nibbles moved
        (nf4.cpu_relayout). A cache packed for this kernel (CPU_PACKING) already stores them so."""
        if self.device.type != "cpu":
            return
        self._relayout = {
            i: [(n, tuple(s.shape)) for n, s in states.items() if needs_cpu_layout(s)]
            for i, states in w.qstates.items()
        }
        if not any(self._relayout.values()):
            return
        for i, names in self._relayout.items():
            for name, _ in names:
                self.layers[i].get_submodule(name.rsplit(".", 1)[0]).prelaid = True
        if self.packing == CPU_PACKING:
            return
        for i, (buf, layout) in [*w.resident.items(), *self.store.ram.items()]:
            self._relayout_layer(i, buf, layout)
        self.store.after_disk_read = lambda i, buf: self._relayout_layer(i, buf, self.store.layout(i))

    def _relayout_layer(self, i: int, buf: torch.Tensor, layout) -> None:
        for name, shape in self._relayout.get(i, ()):
            view = layout.view(buf, name)
            view.view(-1).copy_(cpu_relayout(view, shape).view(-1))

    def _bind(self, i: int, buf: torch.Tensor, layout) -> None:
        """Point layer i's parameters that `layout` holds at views into `buf` (no copy). The views of a (layer,
        buffer) pair are made once: a streamed layer returns to the same few slots with the same layout."""
        key = (i, buf.data_ptr())
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = [
                (mod, attr, nn.Parameter(layout.view(buf, name), requires_grad=False))
                for mod, attr, name in self._bindings[i]
                if name in layout.slices
            ]
        for mod, attr, param in views:
            mod._parameters[attr] = param

    def _layer_stream(self):
        """All layers in order: resident ones as-is, streamed ones from the prefetcher."""
        streamed = self.prefetcher.pass_()
        resident = set(self.plan.resident)
        for i in range(len(self.layers)):
            if i not in resident:
                lid, buf = next(streamed)
                assert lid == i, f"prefetcher yielded layer {lid}, expected {i}"
                self._bind(i, buf, self.store.layout(i))
                self.stats.streamed_bytes_per_pass += self.store.link_bytes(i)
            yield i
        for _ in streamed:  # resume once more: releases the last slot, queues the next pass
            raise AssertionError("prefetcher yielded more layers than the plan streams")

    @torch.no_grad()
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=None,
        inputs_embeds=None,
        logits_to_keep: int = 0,
        past_key_values=None,
        **kwargs,
    ):
        """HF's causal-LM call as ONE lane of multi.run_pass: `cache` wins over `past_key_values` (a new
        DynamicCache when use_cache and neither is given); `kwargs` go to every decoder layer."""
        from transformers import DynamicCache
        from transformers.modeling_outputs import CausalLMOutputWithPast

        past_key_values = cache if cache is not None else past_key_values  # `cache` wins when both are given
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        lane = Lane(
            input_ids, inputs_embeds, attention_mask, past_key_values, position_ids, logits_to_keep, use_cache, kwargs
        )
        (logits,) = run_pass(self, [lane])
        return CausalLMOutputWithPast(logits=logits, **output_cache_kwargs(CausalLMOutputWithPast, past_key_values))

    def link_busy_seconds(self, now: float | None = None) -> float:
        """Cumulative time the weight stream moved bytes up to `now` (perf_counter), passes and gaps."""
        return self.prefetcher.link_busy_seconds(now)

    def close(self) -> None:
        """Stop the threads (waiting for copies in flight), close the files, unpin host memory (idempotent)."""
        self.prefetcher.close()
        self.store.reader.close()
        if getattr(self, "experts", None) is not None:
            self.experts.close()
        self.store.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _open_checked(path, dtype, device: torch.device, progress) -> tuple[Checkpoint, str]:
    """(ckpt, packing): the checkpoint to stream (a 16-bit one's nf4 cache for nf4), checked, and its 4-bit packing."""
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)  # opened (validated) once
    if wants_nf4(dtype) and ckpt.format in PACKED_FORMATS:
        raise OffloadError(
            f"{ckpt.path}: already a 4-bit {ckpt.format} checkpoint; drop --dtype nf4 (its "
            "weights stream as stored) or point at a 16-bit checkpoint"
        )
    if (wants_nf4(dtype) or ckpt.format == "bnb-nf4") and ckpt.hf_config.model_type in MOE_FAMILIES:
        # the 4-bit cache packs every 2-D layer tensor, MoE routers (raw parameters, no nn.Linear) too
        raise OffloadError(
            f"{ckpt.path}: NF4 is not supported for mixture-of-experts models "
            f"({ckpt.hf_config.model_type}) yet; use --dtype bf16, fp16 or fp32"
        )
    if wants_nf4(dtype) and ckpt.format != "bnb-nf4":
        # A 16-bit checkpoint: quantize once into the cache (or reuse it), then load that.
        ckpt = open_checkpoint(ensure_nf4_cache(ckpt, progress=progress, packing=packing_for(device)))
    path, config = ckpt.path, ckpt.hf_config
    config._attn_implementation = Family.of(config).attn_implementation  # Gemma-2: eager (soft-capping)
    packing = getattr(config, "specx_packing", "standard")
    if packing != "standard" and packing != packing_for(device):
        raise OffloadError(
            f"{path}: its 4-bit bytes are packed for {packing} and cannot compute on {device}; "
            "load the 16-bit source with --dtype nf4 (specx builds the cache it needs)"
        )
    return ckpt, packing


def _skeleton(ckpt: Checkpoint, dtype, device, nf4_compute) -> tuple[torch.dtype, torch.dtype, bool, nn.Module]:
    """(storage dtype, compute dtype, nf4?, hf): the dtypes and the weightless model with the checkpoint's layers."""
    path, config = ckpt.path, ckpt.hf_config
    storage_dtype, compute_dtype, nf4 = resolve_dtype(dtype, config, device)
    if nf4 and nf4_compute is not None:
        storage_dtype = compute_dtype = nf4_compute
    nf4 = ckpt.format == "bnb-nf4"
    hf = meta_model(config, path / "config.json")  # impossible sizes in config.json: one line
    if nf4:
        _swap_nf4_linears(hf.model.layers, compute_dtype, ckpt.packed)
    elif ckpt.packed:
        swap_packed_linears(hf.model.layers, ckpt, compute_dtype)
    if ckpt.format == "mxfp4":  # the experts' MXFP4 bytes stream as stored, dequantized per routed expert
        swap_mxfp4_experts(hf.model.layers, compute_dtype)
    if ckpt.format == "gguf" and config.model_type == "gpt_oss":  # experts as stored: gate, up, down apart
        swap_gguf_experts(hf.model.layers, ckpt, compute_dtype)
    return storage_dtype, compute_dtype, nf4, hf


def _swap_nf4_linears(layers: nn.ModuleList, compute_dtype: torch.dtype, packed) -> None:
    """Each nn.Linear whose weight the checkpoint stores packed (full name in `packed`) -> an Nf4Linear."""
    for i, layer in enumerate(layers):
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, nn.Linear) and f"model.layers.{i}.{name}.weight" in packed:
                parent, child, _ = param_slot(layer, name)
                q = Nf4Linear(mod.in_features, mod.out_features, mod.bias is not None, compute_dtype)
                q.logical_shape = tuple(mod.weight.shape)
                setattr(parent, child, q)
