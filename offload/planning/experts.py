"""Mixture-of-experts targets in the plan: each layer's attention+shared part and its routed experts
placed apart, and a pass priced by the DISTINCT experts its tokens route to.

Contract (pure arithmetic over config.json, the headers and a passcost.Device; every figure modelled):
- `moe_shape(ck, lay, req, bits, dense_bits)` -> MoeShape, None for a dense model: E, top-k and per layer
  one routed expert's bytes and weights (tensors with ".experts." in the name; 0 for a dense MLP layer) and
  the rest's ("dense"), in the plan's dtype or at `bits` / `dense_bits` per weight (another format's).
- Routing is a prior: expertcost.distinct_experts, uniform and independent; measured routing counts
  replace it through `hit_share` (real routers are skewed: fewer distinct experts, more hits).
- `expert_plan(ck, lay, req, plan)` -> the JSON `plan.experts` (None for a dense model); the loader's
  experts="auto" follows its mode, and every mode runs (`runs`):
  "on-demand" (where stream/expertstore.splits_experts allows it, and its modelled tokens/s beats whole
  layers': both kept, `on_demand_tokens_per_second` and `layers_tokens_per_second`; memplan plans again with
  whole layers' sizes where it chose whole layers): a disk layer streams its dense part only and its routed
  experts (`disk_experts`) are read once routed into a RAM cache of `cache_experts` (`cache_bytes`, device
  component "expert_cache"; expertstore.cache_capacity; an LRU, so its `hit` is the uniform prior), priced
  by expertcost.apart_seconds; resident and RAM layers keep theirs (`ram_experts`).
  "split" (CUDA, something streams and it models faster; llama.cpp's --n-cpu-moe): every dense part on the
  card, `gpu_experts` cached there, then `ram_experts` in RAM, then `disk_experts` (`*_ids` per layer:
  splitexperts.tier_order); the disk tier's RAM cache holds one layer's experts; uncached experts run on
  the CPU or, from `stream_from` tokens on, through `expert_staging` (2 x top-k experts) on the card
  (planning/splitcost.py), whichever models faster (`routed`).
  "layers": the plan's whole-layer placement; a layer computes only its routed experts.
- `pass_terms(a, plan, dev, n, ctx, c)` -> passcost.PassTerms of a pass of n tokens under plan.experts: the
  dense part as passcost prices a layer plus `experts` seconds (distinct experts x their tier's bytes over
  its rate, or their FLOPs if longer, plus MXFP4 dequantization). `mode_seconds(...)`: that pass in either
  mode (the benchmark's figures); `chose_whole_layers(ex)`: it weighed both and chose whole layers.
- The CPU expert rate (`_cpu_rate`): `Device.dequant_bps["cpu-experts"]` where measured or stated, else on
  a CPU device its memory bandwidth, else the CPU_EXPERTS prior.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from offload.planning.expertcost import apart_seconds, compute_seconds, distinct_experts, transfer_seconds
from offload.planning.membytes import arch_of, compute_bytes, dtype_bytes
from offload.planning.passcost import PassTerms, attention_seconds, device_of, floor_term, linear_weights, model_ctx
from offload.planning.request import STATIC_SLACK, cuda_margin, ram_cap
from offload.planning.splitcost import split_seconds, stream_from
from offload.stream.expertstore import cache_capacity, splits_experts, streams_whole
from offload.stream.splitexperts import tier_ids, tier_order

CPU_READ_SHARE = 0.5
"""Share of its DIMMs' peak bandwidth a desktop CPU reads weights at in a one-token GEMV, from published
llama.cpp runs: a dense 3B of 1.93 GB at 11.8 tok/s on an i7-8700 (DDR4-2666 dual channel, 42.7 GB/s peak):
0.53 (inventivehq.com/blog/moe-on-cpu-benchmark); gpt-oss-120b with every expert on a 14900K's CPU at 25.6
tok/s, 1.9 GB of routed MXFP4 experts a token of DDR5-5600's 89.6 GB/s: 0.54 (gokawiil.com/article/74814)."""

DDR5_DESKTOP_PEAK = 80e9  # bytes/s: DDR5-5000 dual channel (2 x 8 bytes x 5000 MT/s), a desktop's memory

CPU_EXPERTS = dict(bps=CPU_READ_SHARE * DDR5_DESKTOP_PEAK, flops=200e9)
"""Prior for routed experts computed on a CUDA machine's host CPU: a DDR5 desktop read at CPU_READ_SHARE of
its peak (40 GB/s) and ~200 GFLOP/s of AVX-512; not measured (bench/moe_experts.py measures this CPU)."""

SOURCES_PRIOR = "prior: a DDR5 desktop CPU (experts.CPU_EXPERTS)"


@dataclass(frozen=True)
class MoeShape:
    experts: int  # routed experts per sparse layer (E)
    top_k: int  # experts each token routes to
    expert_bytes: list[int]  # per layer: bytes of ONE routed expert (0: a dense MLP layer)
    expert_weights: list[int]  # per layer: weights of one routed expert (for FLOPs)
    dense_bytes: list[int]  # per layer: everything but the routed experts
    shared_intermediate: int  # a shared expert's intermediate size (Qwen2-MoE), else 0


def moe_shape(ck, lay, req, bits: float | None = None, dense_bits: float | None = None) -> MoeShape | None:
    """The checkpoint's experts (see the contract), None for a dense model; with `dense_bits` the rest's
    vectors (norms, biases) stay in the plan's dtype, as a GGUF K-quant stores attention beside its experts."""
    c = ck.config.get("text_config") or ck.config
    e = int(c.get("num_local_experts") or c.get("num_experts") or 0)
    k = int(c.get("num_experts_per_tok") or c.get("experts_per_token") or 0)
    if e < 2 or k < 1:
        return None
    packed = isinstance(ck.config.get("quantization_config"), dict)
    elem = 0.5 if req.dtype == "nf4" else dtype_bytes(req.dtype)
    n = len(lay.packed)
    stored, weights, other = [0.0] * n, [0] * n, [0.0] * n  # per layer: experts' bytes and weights, the rest's bytes
    for name, t in ck.tensors.items():
        if not name.startswith("model.layers."):
            continue
        i, numel = int(name.split(".", 3)[2]), math.prod(t.shape)
        if ".experts." in name:
            stored[i] += t.nbytes if packed else numel * elem
            # MXFP4 (formats/mxfp4.py): a block byte holds two weights, its scales none
            weights[i] += numel * 2 if name.endswith("_blocks") else 0 if name.endswith("_scales") else numel
        elif dense_bits:  # a matrix at dense_bits per weight, a vector in the plan's dtype
            other[i] += numel * (dense_bits / 8 if len(t.shape) > 1 else elem)
    ew = [w // e for w in weights]
    eb = [int(ew[i] * bits / 8) if bits else int(stored[i]) // e for i in range(n)]
    if dense_bits:
        dense = [int(b) for b in other]
    else:  # the layer's planned bytes (its arena, aligned) less its experts'
        dense = [max(0, lay.packed[i] - int(stored[i])) for i in range(n)]
    return MoeShape(e, k, eb, ew, dense, int(c.get("shared_expert_intermediate_size") or 0))


def hit_share(counts: list[int] | None, cached: int, e: int) -> float:
    """Share of routed tokens the `cached` hottest of `e` experts serve: from measured routing `counts`
    (tokens per (layer, expert), flattened), else the uniform prior cached / e."""
    if not counts or sum(counts) == 0:
        return min(1.0, cached / e)
    return sum(sorted(counts, reverse=True)[:cached]) / sum(counts)


def _cpu_rate(dev) -> tuple[float, float, str]:
    measured = (getattr(dev, "dequant_bps", None) or {}).get("cpu-experts")
    if measured:
        return measured, CPU_EXPERTS["flops"], (dev.sources or {}).get("dequant", "measured")
    if dev.kind == "cpu":
        return dev.memory_bps, dev.flops32, (dev.sources or {}).get("memory_bps", "prior")
    return CPU_EXPERTS["bps"], CPU_EXPERTS["flops"], SOURCES_PRIOR


def _split_bytes(shape: MoeShape, req, plan, routing: list[int] | None) -> dict | None:
    """Device, host and disk bytes of the "split" placement, or None where the dense parts do not fit."""
    drop = ("resident_layers", "staging_slots", "dequantized_layers", "dequantized_draft", "cuda_context")
    fixed = {k: v for k, v in plan.device_bytes.items() if k not in drop}
    sparse = [i for i, b in enumerate(shape.expert_bytes) if b]
    eb = max(shape.expert_bytes)
    dev = {**fixed, "attention_shared": sum(shape.dense_bytes), "expert_staging": 2 * shape.top_k * eb}
    margin = cuda_margin(dev, True)
    room = plan.device_capacity - sum(dev.values()) - margin
    if room < 0:
        return None
    total = shape.experts * len(sparse)
    cached = min(total, int(room / (1 + STATIC_SLACK)) // eb)  # the hottest first; evenly under the prior
    dev["expert_cache"] = cached * eb
    dev["cuda_context"] = margin + int(STATIC_SLACK * dev["expert_cache"])
    other_host = sum(v for k, v in plan.host_bytes.items() if k not in ("ram_layers", "stage_buffers", "read_buffers"))
    room_host = max(0, ram_cap(req) - other_host)
    ram = min(total - cached, room_host // eb)
    if ram < total - cached:  # some on disk: their RAM cache (one layer's experts) comes out of the RAM tier's room
        ram = min(total - cached, max(0, room_host - shape.experts * eb) // eb)
    cache = min(shape.experts, total - cached - ram)
    ids = tier_ids(tier_order(sparse, shape.experts, routing), len(shape.expert_bytes), cached, ram)
    return dict(
        device_bytes=dev,
        host_bytes={"experts_ram": ram * eb, "expert_cache": cache * eb},
        cache_experts=cache,
        disk_bytes=(total - cached - ram) * eb,
        gpu_experts=cached,
        ram_experts=ram,
        disk_experts=total - cached - ram,
        hit=hit_share(routing, cached, total),
        fits=sum(dev.values()) <= plan.device_capacity,
        **{f"{tier}_ids": v for tier, v in ids.items()},
    )


def _cache_room(req, plan) -> int:
    """Host bytes the RAM cache of on-demand experts may take: what --max-ram leaves after the RAM-tier
    layers (and resident ones, CPU auto), none with --offload disk, else what the RAM cap leaves."""
    if req.max_ram is not None:
        used = plan.host_bytes.get("ram_layers", 0)
        used += plan.device_bytes.get("resident_layers", 0) if req.offload == "auto" else 0
        return max(0, req.max_ram - used)
    if req.offload == "disk":
        return 0
    return max(0, ram_cap(req) - sum(plan.device_bytes.values()) - sum(plan.host_bytes.values()))


def _on_demand(shape: MoeShape, lay, req, plan) -> dict:
    disk = [i for i in plan.disk_layers if shape.expert_bytes[i]]
    sparse = sum(1 for b in shape.expert_bytes if b)
    on_disk = shape.experts * len(disk)
    slot = max((lay.expert_slot[i] for i in disk), default=0)
    cache = cache_capacity(shape.experts, on_disk, slot, _cache_room(req, plan))
    return dict(
        ram_experts=shape.experts * (sparse - len(disk)),
        disk_experts=on_disk,
        cache_experts=cache,
        cache_bytes=cache * slot,
        hit=hit_share(None, cache, on_disk) if on_disk else 0.0,  # an LRU cache, not the hottest: the prior
        routing="uniform (prior)",
        runs=True,
    )


def routed_seconds(ex: dict, i: int, n: int, dev, c: int, on_disk: bool = False) -> tuple[float, str]:
    """(seconds, "gpu" | "cpu" | "stream" | "disk") of layer i's routed experts in a pass of n tokens (plan.experts
    `ex`); `on_disk`: layer i's experts are read on demand ("on-demand" mode), the cache's misses from disk."""
    if not ex["expert_bytes"][i]:
        return 0.0, ""
    if ex["mode"] == "split":  # uncached experts on the CPU or streamed to the card, whichever is faster
        return split_seconds(ex, i, n, dev, c)
    if on_disk:  # read once routed, the next read while one computes (expertcost.py)
        return apart_seconds(ex, i, n, dev, c), "disk"
    # on a CPU device the experts compute at the CPU expert rate (_cpu_rate)
    d = distinct_experts(n, ex["top_k"], ex["experts"])
    return d * compute_seconds(ex, i, n, dev, c), "gpu" if dev.kind == "cuda" else "cpu"


def pass_terms(a, plan, dev, n: int, ctx: int, c: int):
    ex = plan.experts
    split, held = ex["mode"] == "split", ex["mode"] == "on-demand"
    ram, disk = (set(), set()) if split else (set(plan.ram_layers), set(plan.disk_layers))
    dense_a = replace(a, intermediate=ex["shared_intermediate"] if ex["sparse_layers"] else a.intermediate)
    dense_flops = 2 * linear_weights(dense_a) * n / dev.flops(c)
    attn = attention_seconds(a, n, ctx, c, dev)
    total = stream = gemm = experts = 0.0
    routed = set()
    for i, size in enumerate(plan.layer_bytes):
        rate = dev.link_bps if i in ram else dev.disk_bps if i in disk else 0.0
        apart = held and i in disk and ex["expert_bytes"][i] > 0  # its dense part streams, its experts on demand
        reads = (ex["dense_reads"] if apart else ex["layer_reads"])[i] if ex["layer_reads"] else 0  # counted: splits
        transfer = transfer_seconds(ex["dense_bytes"][i] if apart else size, reads, rate, dev, i in disk)
        if ex["expert_bytes"][i]:
            layer_gemm = max(dense_flops, ex["dense_bytes"][i] / dev.memory_bps)
        else:
            layer_gemm = max(2 * linear_weights(a) * n / dev.flops(c), size / dev.memory_bps)
        ex_s, how = routed_seconds(ex, i, n, dev, c, apart)
        routed.add(how)
        total += max(transfer, layer_gemm + attn + ex_s)
        stream, gemm, experts = stream + transfer, gemm + layer_gemm, experts + ex_s
    head = max(2 * n * a.hidden * a.vocab / dev.flops(c), a.hidden * a.vocab * c / dev.memory_bps)
    term = floor_term(plan, n)
    floor, attn_s = getattr(dev, term), len(plan.layer_bytes) * attn
    bound = "stream" if stream > gemm + experts + attn_s else "experts" if experts > gemm else "compute"
    ran = "+".join(sorted(h for h in routed if h))
    return PassTerms(
        n, ctx, stream, gemm, 0.0, attn_s, head, floor, floor + head + total, bound, dev.flops(c), experts, ran, term
    )


def _tokens_per_second(a, plan, dev, ex: dict, c: int, ctx: int) -> float:
    return 1.0 / pass_terms(a, replace(plan, experts=ex), dev, 1, ctx, c).seconds


def expert_plan(
    ck, lay, req, plan, routing: list[int] | None = None, bits: float | None = None, dense_bits: float | None = None
) -> dict | None:
    """plan.experts for this MoE checkpoint (see the contract); None for a dense model. `bits` / `dense_bits`
    (moe_shape): a format the loader may not read, for comparisons with other programs' published runs."""
    plan, shape = getattr(plan, "replaced", None) or plan, moe_shape(ck, lay, req, bits, dense_bits)  # split: whole
    if shape is None:
        return None
    dev, a, c = device_of(req), arch_of(ck.config), compute_bytes(req)
    bps, flops, src = _cpu_rate(dev)
    base = dict(
        experts=shape.experts,
        top_k=shape.top_k,
        sparse_layers=sum(1 for b in shape.expert_bytes if b),
        expert_bytes=shape.expert_bytes,
        expert_weights=shape.expert_weights,
        dense_bytes=shape.dense_bytes,
        shared_intermediate=shape.shared_intermediate,
        expert_reads=list(lay.expert_reads),
        dense_reads=list(lay.dense_reads),
        layer_reads=list(lay.layer_reads),
        kernel="mxfp4" if a.method == "mxfp4" else "none",
        cpu_bps=bps,
        cpu_flops=flops,
        cpu_source=src,
        routing="measured" if routing else "uniform (prior)",
        mode="layers",
        runs=True,
    )
    ctx = model_ctx(plan)
    base["layers_tokens_per_second"] = _tokens_per_second(a, plan, dev, base, c, ctx)
    base["tokens_per_second"] = base["layers_tokens_per_second"]
    # packed linears stream with their layer (MXFP4 experts and a GGUF's, rows of fused tensors, do not)
    packed = req.dtype == "nf4" or streams_whole(ck.config)
    if plan.disk_layers and bits is None and splits_experts(ck.config.get("model_type"), req.device, packed):
        held = {**base, **_on_demand(shape, lay, req, plan), "mode": "on-demand"}
        held["tokens_per_second"] = _tokens_per_second(a, plan, dev, held, c, ctx)
        base["on_demand_tokens_per_second"] = held["on_demand_tokens_per_second"] = held["tokens_per_second"]
        base["on_demand"] = {k: held[k] for k in ("ram_experts", "disk_experts", "cache_experts", "cache_bytes", "hit")}
        # THE choice (the loader follows it): apart only where it models faster, on layers sized apart
        return held if lay.apart and held["tokens_per_second"] > base["layers_tokens_per_second"] else base
    streams = bool(plan.ram_layers or plan.disk_layers)
    split = _split_bytes(shape, req, plan, routing) if req.device == "cuda" and streams else None
    if split and split["fits"]:
        cand = {**base, **split, "mode": "split"}
        cand["stream_from"] = stream_from(cand, dev, c)  # the loader's per-layer threshold
        cand["tokens_per_second"] = _tokens_per_second(a, plan, dev, cand, c, ctx)
        if cand["tokens_per_second"] > base["layers_tokens_per_second"]:
            return cand
    return base


def mode_seconds(a, plan, dev, n: int, ctx: int, c: int, mode: str) -> float:
    ex = {**plan.experts, **(plan.experts.get("on_demand") or {}), "mode": mode}
    return pass_terms(a, replace(plan, experts=ex), dev, n, ctx, c).seconds


def chose_whole_layers(ex: dict | None) -> bool:
    return bool(ex) and "on_demand_tokens_per_second" in ex and ex["mode"] == "layers"


def expert_notes(ex: dict | None) -> list[str]:
    """The dry run's notes on the expert placement (modelled figures labelled)."""
    if not ex:
        return []
    head = (
        f"experts: {ex['experts']} per layer, top-{ex['top_k']}, {ex['sparse_layers']} sparse layers; "
        f"a pass is priced by the distinct experts its tokens route to ({ex['routing']} routing)"
    )
    if ex["mode"] == "on-demand":
        return [
            head,
            (
                f"experts apart (run): disk layers stream their attention+shared part only; their "
                f"{ex['disk_experts']} routed experts are read from disk once the router chose them (only those), "
                f"into a RAM cache of {ex['cache_experts']} experts (most recently used kept), and computed on the "
                f"CPU; the {ex['ram_experts']} experts of resident and RAM layers stay in their layers: "
                f"chosen, {ex['tokens_per_second']:.2f} tokens/s plain (modelled) against "
                f"{ex['layers_tokens_per_second']:.2f} with whole layers streamed (modelled)"
            ),
        ]
    if ex["mode"] != "split" and "on_demand_tokens_per_second" in ex:
        return [
            head,
            (
                f"experts with their layers (chosen): whole disk layers stream, {ex['tokens_per_second']:.2f} "
                f"tokens/s plain (modelled), against {ex['on_demand_tokens_per_second']:.2f} with the routed "
                f"experts read from disk once routed (modelled: {max(ex['expert_reads'])} reads per expert, "
                "serialized after the router, where a whole layer's read overlaps the layer before)"
            ),
        ]
    if ex["mode"] != "split":
        return [head + f"; whole layers placed as above: {ex['tokens_per_second']:.2f} tokens/s plain (modelled)"]
    first = min((n for n in ex.get("stream_from") or [] if n), default=None)
    big = f"; passes of {first}+ tokens copy them to the card and compute there" if first else ""
    return [
        head,
        (
            f"experts split (as llama.cpp --n-cpu-moe): attention+shared of every layer on the card, "
            f"{ex['gpu_experts']} experts cached on the card, {ex['ram_experts']} experts in RAM, computed on the CPU "
            f"({ex['cpu_bps'] / 1e9:.0f} GB/s, {ex['cpu_source']}), {ex['disk_experts']} on disk: "
            f"{ex['tokens_per_second']:.2f} tokens/s plain (modelled; whole layers streamed: "
            f"{ex['layers_tokens_per_second']:.2f}); run: the loader places them so, nothing streams whole layers" + big
        ),
    ]
