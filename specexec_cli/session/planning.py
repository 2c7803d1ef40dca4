"""The CLI side of the device-memory plan: options -> offload.planning.memplan request -> plan, before loading.

Contract: `make_plan(opts, shape, budget_auto)` reads only config.json and the weight headers (the
ModelRefs' checkpoints, shared with loading), the device's free memory and psutil's available RAM,
and returns an `offload.planning.memplan.MemoryPlan`; it never reads weights, so `--dry-run` needs
no GPU. Pickle checkpoints (--allow-pickle) have no headers: `make_plan` returns None.
"""

from __future__ import annotations

from dataclasses import replace

import psutil
import torch

from specexec_cli.errors import SpecxError, offload_errors
from specexec_cli.session.modelref import AUTO, SELF, open_checkpoint
from specexec_cli.session.strict import config_json

DEFAULT_CTX = 8192


def draft_dtype_name(dtype: str, draft_dtype: str) -> str:
    """The draft's dtype name: --draft-dtype when given, else the target's (auto for an nf4 target)."""
    if draft_dtype != "auto":
        if draft_dtype not in ("bf16", "fp16", "fp32"):
            raise SpecxError(f"--draft-dtype must be one of auto, bf16, fp16, fp32 (got {draft_dtype!r})")
        return draft_dtype
    return "auto" if dtype == "nf4" else dtype


def plan_device(name: str) -> str:
    """'auto' -> cuda when present; 'cuda' is allowed without a GPU (a plan for a card elsewhere)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise SpecxError(f"--device must be auto, cpu or cuda (got {name!r})")
    return name


def plan_dtypes(dtype: str, device: str, has_draft: bool, draft_dtype: str = "auto") -> tuple[str, str | None]:
    """(target, draft) dtype names: auto = bf16 on CUDA, fp32 on CPU; --draft-dtype wins for the draft."""
    auto = "fp32"
    if device == "cuda":
        from offload import accelerator_half

        auto = "bf16" if accelerator_half() == torch.bfloat16 else "fp16"
    if dtype not in ("auto", "bf16", "fp16", "fp32", "nf4"):
        raise SpecxError(f"--dtype must be one of auto, bf16, fp16, fp32, nf4 (got {dtype!r})")
    target = auto if dtype == "auto" else dtype
    draft = (auto if dtype in ("auto", "nf4") else dtype) if has_draft else None
    if has_draft and draft_dtype != "auto":
        draft = draft_dtype_name(dtype, draft_dtype)
    return target, draft


def prequantized(path) -> bool:
    """config.json carries a bitsandbytes quantization_config (a pre-quantized NF4 checkpoint; AWQ,
    GPTQ, compressed-tensors and MXFP4 stream their own packed bytes)."""
    qc = config_json(path).get("quantization_config")
    return qc is not None and not (
        isinstance(qc, dict) and qc.get("quant_method") in ("awq", "gptq", "compressed-tensors", "mxfp4")
    )


def nf4_source(path, dtype: str, device: str = "cpu"):
    """(checkpoint the loader will stream, target dtype): a 16-bit one with --dtype nf4 streams from
    its 4-bit cache when that exists, else the plan estimates it from the 16-bit headers."""
    from offload import nf4_cache_complete, nf4_cache_dir, nf4_cache_key, packing_for

    if prequantized(path):
        return path, "nf4"
    packing = packing_for(device)
    if dtype == "nf4" and nf4_cache_complete(nf4_cache_dir(path, packing), nf4_cache_key(path, packing)):
        return nf4_cache_dir(path, packing), dtype
    return path, dtype


def make_plan(
    opts, shape, budget_auto: bool, temperature: float = 0.0, gpu: str | None = None, profile: dict | None = None
):
    """MemoryPlan for `opts` and the draft TreeShape `shape`; `temperature` weighs the self-draft's
    widths, `gpu` (--gpu NAME) plans for a published card, `profile` lends its measured rates."""
    from offload.planning import PlanRequest
    from specexec_cli.session.profiles import card, cost_device_for, plan_timings, profile_matches

    if gpu is not None:
        if opts.device == "cpu":
            raise SpecxError(f"--gpu {gpu} plans for a CUDA card; drop --device cpu")
        opts = replace(opts, device="cuda", max_gpu_memory=opts.max_gpu_memory or card(gpu)["memory_gib"] << 30)
    device = plan_device(opts.device)
    cost_device = cost_device_for(device, gpu, profile)
    self_draft = opts.draft in (SELF, AUTO)
    target, draft = opts.target, opts.draft if opts.draft is not None and not self_draft else None
    if not all([ref.safe for ref in (target, draft) if ref]):
        return None  # pickle weights (--allow-pickle): no headers to plan from; HF loads them resident
    tdtype, ddtype = plan_dtypes(opts.dtype, device, draft is not None, getattr(opts, "draft_dtype", "auto"))
    sixteen_bit = not prequantized(target.path)  # else no 16-bit weights to make self-draft substitutes from
    timed, why = profile_matches(None if gpu else profile, target.path, tdtype)  # before the nf4 cache swaps the path
    tpath, tdtype = nf4_source(target.path, tdtype, device)
    if self_draft:
        # the substitutes compute in the target's compute dtype (an nf4 target: bf16/fp16 on CUDA, fp32 on CPU)
        ddtype = tdtype if tdtype != "nf4" else ("bf16" if device == "cuda" else "fp32")
    free = torch.cuda.mem_get_info()[0] if device == "cuda" and torch.cuda.is_available() else None
    ram, shortfall = for_stated_machine(
        device, opts.max_gpu_memory, opts.max_ram, free, psutil.virtual_memory().available
    )
    req = PlanRequest(
        device=device,
        dtype=tdtype,
        draft_dtype=ddtype,
        ram_free=ram,
        device_free=free,
        offload=opts.offload,
        ctx=opts.ctx,
        budget=shape.budget,
        budget_auto=budget_auto,
        max_beams=shape.max_beams,
        max_gpu_memory=opts.max_gpu_memory,
        max_ram=opts.max_ram,
        embeddings=opts.embeddings,
        self_draft=self_draft,
        draft_bits=getattr(opts, "draft_bits", None),
        sixteen_bit=sixteen_bit,
        temperature=temperature,
        memory_bps=cost_device.memory_bps,
        link_bps=cost_device.link_bps,
        bandwidth_source=cost_device.source,
        compare_self=draft is not None and sixteen_bit,
        cost_device=cost_device,
        timings=plan_timings(timed),
    )
    return _plan_checkpoints(req, opts.ctx, target, tpath, draft, why, shortfall)


def _plan_checkpoints(req, ctx: int, target, tpath, draft, why: str, shortfall: str):
    """The plan for the checkpoints, with the profile's note `why` and the stated machine's `shortfall`."""
    from offload.planning import plan_memory

    with offload_errors():
        # the opened (validated) Checkpoints the loader uses too; the 4-bit cache is the plan's alone
        tck = target.checkpoint if tpath == target.path else open_checkpoint(tpath, "--target")
        dck = draft.checkpoint if draft is not None else None
        check_window(ctx, [(tck, "--target"), (dck, "--draft")])
        plan = plan_memory(tck, dck, req)
    if why:
        plan.notes.append(why)
    if shortfall:
        plan.elsewhere = shortfall
        plan.notes.insert(0, f"planned for the machine the caps describe: {shortfall}")
    return plan


def check_window(ctx: int, checkpoints) -> None:
    """Refuse an explicit --ctx beyond a model's window (the default is capped by the plan instead)."""
    from offload.planning import arch_of

    if ctx == DEFAULT_CTX:
        return
    for ck, flag in checkpoints:
        window = arch_of(ck.config).max_positions if ck is not None else ctx
        if ctx > window:
            raise SpecxError(
                f"--ctx {ctx} is beyond the {flag} model's window of {window} positions "
                f"(max_position_embeddings in its config.json); fix: --ctx {window} or less"
            )


def for_stated_machine(
    device: str, max_gpu: int | None, max_ram: int | None, dev_free: int | None, ram_free: int
) -> tuple[int, str]:
    """(RAM to plan with, why this host differs or ""): explicit --max-ram / --max-gpu-memory describe
    the machine to plan for, which may be bigger than this one; only a real run refuses it (`require_host`)."""
    from offload import format_bytes
    from offload.planning import RAM_FRACTION

    lacks = []
    if max_ram is not None and max_ram > RAM_FRACTION * ram_free:
        lacks.append(f"--max-ram {format_bytes(max_ram)} but this host has {format_bytes(ram_free)} of RAM available")
        ram_free = int(max_ram / RAM_FRACTION) + 1
    if device == "cuda" and max_gpu is not None and (dev_free is None or max_gpu > dev_free):
        have = "no CUDA device" if dev_free is None else f"{format_bytes(dev_free)} of GPU memory free"
        lacks.append(f"--max-gpu-memory {format_bytes(max_gpu)} but this host has {have}")
    return ram_free, "; ".join(lacks)


def require_host(plan) -> None:
    """Before loading: refuse a plan that cannot fit (its reason), then one made for another machine."""
    if plan is not None and not plan.fits:
        raise SpecxError(plan.reason)
    if plan is not None and plan.elsewhere:
        raise SpecxError(
            f"this plan is for another machine ({plan.elsewhere}); fix: lower the caps to "
            "what this host has, or drop them to let specx measure it"
        )


def resolve_auto(opts, plan, replan, skipped: str = ""):
    """--draft auto: (LoadOptions, plan) with the self-draft the plan chose and one notice naming it
    (`skipped`: deps.skipped_clause); when none fits or plain decoding is modelled faster, no draft
    (`replan(opts)` plans for that)."""
    from offload.planning import PLAIN
    from specexec_cli.session import notices

    drafts = [c for c in (plan.candidates if plan is not None else []) if c["draft"] != PLAIN]
    bits = getattr(plan, "substitute_bits", None)  # build.LAYER_SKIP (0): the layer-skip draft
    name = "the layer-skip self-draft" if bits == 0 else f"the self-draft at {bits} bits"
    plain = next((c for c in (plan.candidates if plan is not None else []) if c["draft"] == PLAIN), None)
    c = (plan.choice if plan is not None else None) or {}
    faster = plain is not None and plain["tokens_per_second"] > c.get("tokens_per_second", 0)
    if plan is not None and plan.fits and plan.substitute_bits is not None and not faster:
        notices.notice(
            f"--draft auto: {name} (modelled "
            f"{c.get('tokens_per_second', 0):.2f} tokens/s, the best of {len(drafts)} "
            f"candidates; --dry-run lists them){skipped}"
        )
        return replace(opts, draft=SELF), plan
    if plan is not None and plan.fits and plan.substitute_bits is not None:
        why = (
            f"plain decoding is modelled faster ({plain['tokens_per_second']:.2f} tokens/s against "
            f"{c.get('tokens_per_second', 0):.2f} for {name})"
        )
    elif plan is not None and plan.fits:
        why = "every target layer is resident and the layer-skip draft was not modelled"
    elif plan is None:
        why = "pickle weights have no headers to plan a self-draft from"
    else:
        why = f"no self-draft fits ({plan.reason})"
    notices.notice(f"--draft auto: {why}, so decoding runs without a draft (pass --draft DIR for a small one)")
    opts = replace(opts, draft=None)
    return opts, (plan if plan is not None and plan.fits else replan(opts))
