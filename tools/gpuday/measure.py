"""The run's timing phases: the card's figures, t_target(n) per format, draft step times.

Contract (each function returns the phase's JSON dict; `ctx` holds device, out, smoke):
- `probe`: pinned host->device GB/s (1 GiB, median of 5), device copy GB/s (read + write counted,
  1 GiB), dense bf16 matmul FLOP/s (8192^3; fp32 with TF32 off beside it). CPU smoke: tiny sizes.
- `passes(fmt)`: the 70B-shaped stack (stack.py) loaded with every decoder layer in pinned RAM
  (offload="ram", max_device_memory=0), a `past`-token prefix in the cache (4096; smoke 32), then per
  n = 1, 2, 4 ... 2048 (smoke: 1, 4, 16) a random tree of n nodes (stack.tree_parents) under its tree
  mask: one warm-up pass, then `repeats` passes back to back with the cache cropped back after each,
  timed as one span between synchronizes: the period includes each pass's whole layer stream (slots
  the prefetcher fills before the clock starts are matched by those it fills for the pass after it
  stops). fmt: "bf16", "nf4" (the nf4 cache of the bf16 stack), "q4k" (a GGUF Q4_K_M file).
- `draft`: a 1B-shaped bf16 draft (resident) forward over b tree tokens on a `past` prefix, and one
  70B-shaped layer's seven linears as self-draft substitutes (nf4: bitsandbytes; 3/2-bit: HQQ, the
  kernel specx picks) over b tokens. Every row carries predict.py's prediction and its weight-read
  floor (`read_floor_s`: the bytes one forward reads, weights + KV, or the substitutes' packed bytes,
  at the probe's measured device memory rate): what the forward would cost if bytes were its bound.
"""

from __future__ import annotations

import statistics
import time

import torch

from offload.stream.timing import device_seconds
from tools.gpuday import predict, stack

NS = [1 << k for k in range(12)]
SMOKE_NS = [1, 4, 16]
BEAMS = [1, 8, 32, 64, 128]
SMOKE_BEAMS = [1, 8]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def probe(ctx: dict) -> dict:
    dev, smoke = ctx["device"], ctx["smoke"]
    n = (16 << 20) if smoke else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    link = n / statistics.median(device_seconds(lambda: dst.copy_(src, non_blocking=True), dev) for _ in range(5))  # noqa: F821 - bound above; pyflakes reads the `del` below as unbinding
    a = torch.ones(n, dtype=torch.uint8, device=dev)
    mem = 2 * n / statistics.median(device_seconds(lambda: dst.copy_(a), dev) for _ in range(5))  # noqa: F821 - likewise
    del src, dst, a
    out = dict(link_bps=link, memory_bps=mem, link_bytes=n)
    size = 256 if smoke else 8192
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        x = torch.randn(size, size, device=dev, dtype=dtype)
        y = torch.randn(size, size, device=dev, dtype=dtype)
        x @ y
        secs = statistics.median(device_seconds(lambda: x @ y, dev) for _ in range(5))
        out[f"{name}_flops"] = 2 * size**3 / secs
    out["matmul_size"] = size
    out["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return out


def target_path(ctx: dict, fmt: str):
    """The stack for `fmt` (written on first use under --out/stack) and the load dtype."""
    shape = stack.SMOKE_TARGET if ctx["smoke"] else stack.TARGET
    root = ctx["out"] / "stack"
    if fmt == "q4k":
        return stack.write_q4k(root / "q4k.gguf", shape, ctx["layers"]), "bf16"
    path = stack.write_bf16(root / "bf16", shape, ctx["layers"], ctx["device"])
    return path, ("nf4" if fmt == "nf4" else "bf16")


def tree_mask(n: int, past: int, dtype, device):
    """(ids, positions, mask) of a random n-node tree on `past` committed tokens."""
    from specexec_cli.core.tree import ancestors, attention_mask

    parents = stack.tree_parents(n, seed=n)
    anc = ancestors(parents, torch.arange(n))
    anc = torch.where(anc >= 0, anc + past, anc)
    mask = attention_mask(past, anc, torch.arange(n) + past, past + n, dtype, device)
    ids = torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(n))
    return ids, stack.depth_of(parents) + past, mask


def passes(ctx: dict, fmt: str) -> dict:
    from offload import OffloadedCausalLM
    from specexec_cli.core import kvcache
    from specexec_cli.core.tree import causal_mask

    dev, smoke, card = ctx["device"], ctx["smoke"], ctx["card"]
    shape = stack.SMOKE_TARGET if smoke else stack.TARGET
    past, ns, repeats = (32, SMOKE_NS, 2) if smoke else (4096, NS, 3)
    path, dtype = target_path(ctx, fmt)
    model = OffloadedCausalLM.from_pretrained(path, device=dev, dtype=dtype, offload="ram", max_device_memory=0)
    rows = []
    try:
        cdtype = kvcache.model_dtype(model)
        cache = kvcache.new_cache()
        kvcache.reserve(cache, model, past + max(ns))
        prefix = torch.randint(1, 500, (past,), generator=torch.Generator().manual_seed(0))
        kvcache.forward(model, cache, prefix, torch.arange(past), causal_mask(0, past, cdtype, dev), last_only=True)
        for n in ns:
            ids, pos, mask = tree_mask(n, past, cdtype, dev)

            def one():
                kvcache.forward(model, cache, ids, pos, mask)
                kvcache.crop(cache, past)

            one()  # warm-up at this size
            sync(dev)
            t = time.perf_counter()
            for _ in range(repeats):
                one()
            sync(dev)
            period = (time.perf_counter() - t) / repeats
            streamed = model.stats.streamed_bytes_per_pass
            pred = predict.target_pass(card, fmt, shape, ctx["layers"], n, past, streamed)
            rows.append(dict(n=n, seconds=period, streamed_bytes=streamed, predicted=pred))
        return dict(
            fmt=fmt,
            layers=ctx["layers"],
            past=past,
            repeats=repeats,
            shape=shape,
            plan=model.plan.describe(),
            rows=rows,
        )
    finally:
        model.close()


def draft(ctx: dict) -> dict:
    return dict(small=small_draft(ctx), substitutes=substitutes(ctx))


def small_draft(ctx: dict) -> dict:
    """One forward of a resident 1B-shaped bf16 draft over b tree tokens on a `past` prefix."""
    from offload import OffloadedCausalLM
    from specexec_cli.core import kvcache
    from specexec_cli.core.tree import causal_mask

    dev, smoke, card = ctx["device"], ctx["smoke"], ctx["card"]
    shape = stack.SMOKE_DRAFT if smoke else stack.DRAFT
    past, beams = (32, SMOKE_BEAMS) if smoke else (4096, BEAMS)
    path = stack.write_bf16(ctx["out"] / "stack" / "draft", shape, shape["layers"], dev, seed=1)
    model = OffloadedCausalLM.from_pretrained(path, device=dev, dtype="bf16", offload="none")
    rows = []
    try:
        cdtype = kvcache.model_dtype(model)
        cache = kvcache.new_cache()
        kvcache.reserve(cache, model, past + max(beams))
        prefix = torch.randint(1, 500, (past,), generator=torch.Generator().manual_seed(0))
        kvcache.forward(model, cache, prefix, torch.arange(past), causal_mask(0, past, cdtype, dev), last_only=True)
        weight = sum(p.numel() * p.element_size() for p in model.parameters())
        weight -= shape["vocab_size"] * shape["hidden_size"] * 2  # the input embedding is only looked up
        for b in beams:
            ids, pos, mask = tree_mask(b, past, cdtype, dev)

            def one():
                kvcache.forward(model, cache, ids, pos, mask)
                kvcache.crop(cache, past)

            one()
            secs = statistics.median(device_seconds(one, dev) for _ in range(5))
            kv = predict.kv_bytes(shape, shape["layers"], past + b)
            flops = shape["layers"] * (
                stack.gemm_flops(shape, b) + stack.attention_flops(shape, b, past)
            ) + stack.head_flops(shape, b)
            rows.append(
                dict(
                    b=b,
                    seconds=secs,
                    read_floor_s=(weight + kv) / card["memory_bps"],
                    predicted=predict.draft_step(card, weight, kv, 0, flops),
                )
            )
        return dict(shape=shape, past=past, weight_bytes=weight, rows=rows)
    finally:
        model.close()


def _linears(shape: dict) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's seven linears, in the order they run."""
    t = stack._bench_gpu().layer_tensors(shape)
    return [tuple(d) for n, d in t.items() if len(d) == 2]


def _substitute(w: torch.Tensor, bits: int, dev: torch.device, compute: torch.dtype):
    """One weight as the self-draft's substitute linear: NF4 (bitsandbytes) at 4 bits, else HQQ."""
    if bits == 4:
        from offload.quant.nf4 import Nf4Linear, quantize_nf4

        packed, state = quantize_nf4(w, dev, compute)
        lin = Nf4Linear(w.shape[1], w.shape[0], False, compute)
        lin.weight = torch.nn.Parameter(packed, requires_grad=False)
        lin.quant_state = state
        return lin
    from offload.quant.lowbit import LowbitLinear, quantize_weight

    q = quantize_weight(w, bits)
    return LowbitLinear(
        q["W_q"].to(dev), q["scale"].to(dev, compute), q["zero"].to(dev, compute), None, tuple(w.shape), bits
    )


def substitutes(ctx: dict) -> dict:
    """One 70B-shaped layer's seven linears as 4/3/2-bit substitutes, over b tokens (linears only)."""
    from offload.planning.membytes import substitute_kernel
    from offload.planning.passcost import dequant_bytes

    dev, smoke, card = ctx["device"], ctx["smoke"], ctx["card"]
    shape = stack.SMOKE_TARGET if smoke else stack.TARGET
    compute = torch.bfloat16 if dev.type == "cuda" else torch.float32
    beams = SMOKE_BEAMS if smoke else BEAMS
    gen = torch.Generator(device=dev).manual_seed(2)
    out = {}
    for bits in ctx["bits"]:
        lins = [
            _substitute(torch.randn(d, generator=gen, device=dev, dtype=compute) * 0.02, bits, dev, compute)
            for d in _linears(shape)
        ]
        packed = sum(b.numel() * b.element_size() for m in lins for b in list(m.buffers()) + list(m.parameters()))
        numel = stack.layer_numel(shape)
        kernel = substitute_kernel(bits, dev.type)
        rows = []
        for b in beams:
            xs = {i: torch.randn(b, i, generator=gen, device=dev, dtype=compute) for _, i in _linears(shape)}

            def one():
                with torch.inference_mode():
                    for m, (_, i) in zip(lins, _linears(shape)):  # noqa: F821 - bound in the loop; `del lins` below
                        m(xs[i])

            one()
            secs = statistics.median(device_seconds(one, dev) for _ in range(5))
            rows.append(
                dict(
                    b=b,
                    seconds=secs,
                    read_floor_s=packed / card["memory_bps"],
                    predicted=predict.draft_step(
                        card, packed, 0, dequant_bytes(predict.arch(shape, 1), kernel, 2, b, dev.type), 2.0 * b * numel
                    ),
                )
            )
        from offload.quant.fused import fused_status

        out[str(bits)] = dict(kernel=kernel, packed_bytes=packed, rows=rows, fused_status=fused_status())
        del lins
    return out
