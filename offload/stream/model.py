"""OffloadedCausalLM: a HF causal LM (families.SUPPORTED) whose decoder layers stream.

Contract: `OffloadedCausalLM.from_pretrained(path, device, dtype, offload, ...)` builds the HF model on
the meta device, materializes only the globals (embeddings, final norm, lm_head, rotary) on the compute
device, and keeps every decoder layer's weights in one buffer per layer (storage.py) placed by the plan
(placement.py, or the caller's memory plan). `model(input_ids=, attention_mask=, position_ids=, cache=,
use_cache=)` (or `past_key_values=`) is ONE lane of multi.py's `run_pass`, the only pass: it returns a
`CausalLMOutputWithPast` whose logits equal HF's for the same inputs (4-D additive tree masks, arbitrary
positions and a caller-owned cache included). The KV cache stays on the device. offload="none" keeps
every layer resident. Resident layers of a packed checkpoint named in `plan.dense` are dequantized once
here (quant/dense.py); a mixture-of-experts disk layer may read its routed experts apart
(stream/expertstore.py), or every layer keep its dense part resident and its experts split by tier
(experts="split": stream/splitexperts.py).
"""

from __future__ import annotations

from collections.abc import Callable
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
from offload.stream.loader import LoadedWeights, load_weights, resolve_dtype
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
    def __init__(
        self,
        config,
        device: torch.device,
        dtype: torch.dtype,
        hf: nn.Module,
        w: LoadedWeights,
        packing: str = "standard",
    ):
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
        self._bindings = [self._binding_table(layer) for layer in self.layers]
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
        for i in sorted({i for i, _ in w.experts.experts} if w.experts else ()):
            w.experts.attach(i, self.layers[i], self.layers[i].mlp.experts)
        if w.experts:
            w.experts.stats = self.stats
        self.split = w.split  # experts="split": each expert served from its tier (stream/splitexperts.py)
        if w.split is not None:
            w.split.attach(self.layers)
        self.prefetcher = Prefetcher(self.plan.streamed, self.store, device)
        self.lean = LeanStack.build(self)  # every layer in one C call for small passes, where it applies

    @classmethod
    def from_pretrained(
        cls,
        path,
        device="cpu",
        dtype=torch.float32,
        offload="auto",
        max_device_memory: int | None = None,
        max_host_memory: int | None = None,
        slots: int = 2,
        progress: Callable[[int, int, str], None] | None = None,
        host_slots: int | None = None,
        staging_bytes: int | None = None,
        memplan=None,
        pool=None,
        subset=None,
        nf4_compute: torch.dtype | None = None,
        experts: str = "auto",
        expert_cache: int | None = None,
    ):
        """host_slots / staging_bytes: the disk read-ahead ring (storage.staging_slots; default 1 GiB).
        `memplan`: an offload.planning.memplan.MemoryPlan fixing placement and embeddings (else the budgets
        decide); `pool`: a storage.DevicePool shared with the caller so it counts every device byte;
        `subset`: a loader.Subset (only those layers, shared globals: offload/selfdraft/build.py);
        `nf4_compute`: the compute dtype of a 4-bit load (default: fp32 on CPU, else bf16/fp16);
        `experts` / `expert_cache`: routed experts of disk layers read on demand ("on-demand"), streamed with
        their layer ("layers"), split by tier with every layer's dense part resident ("split": `expert_cache`
        experts cached on the device, evenly, what --max-host-memory holds in RAM, the rest read on demand;
        stream/splitexperts.py), or as the memory plan chose ("auto"; without a plan: on demand where they can
        be); on demand, the experts their RAM cache holds (None: the plan's, else stream/expertstore.py's rule)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if offload not in ("none", "ram", "disk", "auto"):
            raise OffloadError(f"offload must be none, ram, disk or auto, got {offload!r}")
        ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)  # opened (validated) once
        if _wants_nf4(dtype) and ckpt.format in PACKED_FORMATS:
            raise OffloadError(
                f"{ckpt.path}: already a 4-bit {ckpt.format} checkpoint; drop --dtype nf4 (its "
                "weights stream as stored) or point at a 16-bit checkpoint"
            )
        if (_wants_nf4(dtype) or ckpt.format == "bnb-nf4") and ckpt.hf_config.model_type in MOE_FAMILIES:
            # the 4-bit cache packs every 2-D layer tensor, MoE routers (raw parameters, no nn.Linear) too
            raise OffloadError(
                f"{ckpt.path}: NF4 is not supported for mixture-of-experts models "
                f"({ckpt.hf_config.model_type}) yet; use --dtype bf16, fp16 or fp32"
            )
        if _wants_nf4(dtype) and ckpt.format != "bnb-nf4":
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
        w = load_weights(
            ckpt,
            hf,
            device,
            storage_dtype,
            compute_dtype,
            nf4,
            offload,
            max_device_memory,
            max_host_memory,
            slots,
            progress,
            host_slots=host_slots,
            staging_bytes=staging_bytes,
            memplan=memplan,
            pool=pool,
            subset=subset,
            experts=experts,
            expert_cache=expert_cache,
        )
        model = cls(config, device, compute_dtype, hf, w, packing)
        model.source = path  # the checkpoint it was loaded from (the nf4 cache for a 16-bit one)
        model.checkpoint = ckpt  # its opened Checkpoint (formats.base)
        return model

    @property
    def input_device(self) -> torch.device:
        """Where input_ids should live: the host when the embeddings do (only rows then move)."""
        return torch.device("cpu") if type(self.embed_tokens).__name__ == "HostEmbedding" else self.device

    def _prelay_cpu(self, w: LoadedWeights) -> None:
        """On a CPU where bitsandbytes computes 4-bit linears with its fused AVX512-BF16 kernel
        (as transformers' Linear4bit does), put the packed bytes in that kernel's layout once per
        byte arrival: resident and RAM-tier arenas now, streamed slots on the copy thread after
        each read. Same bytes, moved nibbles (nf4.cpu_relayout); nothing is re-quantized.
        A cache packed for this kernel (CPU_PACKING) already stores them so: nothing moves."""
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

    @staticmethod
    def _binding_table(layer: nn.Module) -> list[tuple[nn.Module, str, str]]:
        table = []
        for name, _ in layer.named_parameters():
            mod_name, _, attr = name.rpartition(".")
            table.append((layer.get_submodule(mod_name) if mod_name else layer, attr, name))
        return table

    def _bind(self, i: int, buf: torch.Tensor, layout) -> None:
        """Point layer i's parameters that `layout` holds at views into `buf` (no copy). The views of one
        (layer, buffer) pair are made once: a streamed layer comes back to the same few staging slots, and
        its layout never changes, so a later pass re-points the parameters at the same view objects."""
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
            if i in resident:
                yield i
                continue
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
        """HF's causal-LM call as ONE lane of the pass `forward_many` runs (multi.run_pass): input_ids (B, T)
        or inputs_embeds, positions (None: from the cache's length), any mask, the cache (`cache` or
        `past_key_values`; a new DynamicCache when use_cache and none is given), the last
        `logits_to_keep` tokens' logits (0: all), `kwargs` passed to every decoder layer."""
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
        """Stop the copy threads (waiting for copies in flight), close the files, unpin host memory
        (idempotent)."""
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


def _wants_nf4(dtype) -> bool:
    return isinstance(dtype, str) and dtype.lower() == "nf4"


def _swap_nf4_linears(layers: nn.ModuleList, compute_dtype: torch.dtype, packed) -> None:
    """Replace each nn.Linear of the decoder layers whose weight the checkpoint stores packed (its name,
    e.g. "model.layers.0.self_attn.q_proj.weight", in `packed`) by an Nf4Linear of the same shape."""
    for i, layer in enumerate(layers):
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, nn.Linear) and f"model.layers.{i}.{name}.weight" in packed:
                parent_name, _, child = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                q = Nf4Linear(mod.in_features, mod.out_features, mod.bias is not None, compute_dtype)
                q.logical_shape = tuple(mod.weight.shape)
                setattr(parent, child, q)
