"""`gpu_day.py run`'s "moe" phase: what issue 55's modelled MoE plans only assume, measured on the box.

Contract (`moe(ctx)` returns the phase's JSON dict; `ctx` holds device, out, smoke and the probe's `card`):
- The checkpoint, built on the box into <out>/work/moe (nothing big travels): a seeded Qwen3-MoE saved by
  transformers, SHAPE (a slice of Qwen3-30B-A3B: 8 layers, hidden 2048, 32 query heads / 4 KV heads of 128,
  64 experts of moe_intermediate 768, top-8, a 32000-token vocabulary; bf16: 9.4 MB an expert, 5.4 GB in
  all), removed when the phase ends (the later phases' scratch needs the disk). `--smoke`: SMOKE_SHAPE
  (2 layers, 4 experts, top-2, fp32) on the CPU.
- Passes: n = 1, 8, 32 tokens, no KV cache (as bench/moe_apart.py runs them: a pass over n fresh random
  ids), one warm-up pass per n and mode, then up to ROUNDS rounds with the modes interleaved on the same
  ids; the median per (mode, n) and the bytes it streamed. Modes: "layers" (whole layers streamed from
  pinned RAM: offload="ram", max_device_memory=0, experts="layers") and "split" (experts="split",
  expert_cache = CACHE_SHARE of the experts on the device, evenly), once offload/stream/splitexperts.py
  exists; without it the split row says "not run: split not available" (a load it refuses: "not run: "
  and its message; a load or pass that raises: "failed: " and the error, the other mode timed on, and the
  phase fails at its end with its data kept). The last row's greedy id of every pass must agree between the modes, or differ only
  at a near tie (the whole-layer run's two logits within NEAR_TIE of its logits' standard deviation:
  bf16 on the CPU and on the card round differently); otherwise the phase fails (its data kept).
- Floors: a pass of a tiny model (hidden 64: its kernels take microseconds) timed against its kernels'
  time, floor = wall - kernels: the device's busy time in torch.profiler's trace (`specx profile`'s
  modeltimes.busy_seconds: the union of its kernel and copy spans) against the median wall time of
  unprofiled passes; on the CPU (smoke only) the aten ops' spans against the profiled pass's own wall
  time (profiling slows CPU ops, not a card's kernels). Three models: 80 dense Llama layers
  resident (what passcost.PRIORS' 10 ms CUDA forward_floor_s states), and SHAPE's layers, experts and
  top-k tiny, resident and streamed from RAM, at the passes' n. A trace without kernels (no CUPTI) gives
  no floor (None), and the model keeps the prior's.
- CPU experts: the host CPU computing routed experts as bench/moe_experts.py measures them (its ExpertList
  layer of SHAPE's experts in the run's dtype, caches flushed, uniform top-k routing): bytes/s of the
  distinct routed experts at one token and FLOP/s at FLOP_TOKENS tokens, beside `specx profile`'s own
  probe (kernelprobes.probe_cpu_experts, fp32) and experts.CPU_EXPERTS' priors (40 GB/s, 200 GFLOP/s).
- Modelled: planning/experts.mode_seconds of each pass (ctx 0) on the plan `--offload ram` makes for the
  checkpoint, placed as the loader placed it (split: the cache the run asked for, its hit share uniform),
  on the Device the probe phase's rates give (predict.device: floors and CPU experts at their priors),
  and again with this phase's measured floor (the tiny MoE's, resident for split, streamed for layers)
  and CPU rates in their place.
- Bounded: the phase stops timing rounds once BOUND_S seconds have passed since it began (the checkpoint's
  build included); every n keeps at least its warm-up and one round. The rounds run are in the JSON.
"""

from __future__ import annotations

import importlib.util
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from offload.planning.passcost import PRIORS
from offload.stream.timing import device_seconds
from specexec_cli.tools.modeltimes import busy_seconds
from tools.gpuday import predict
from tools.gpuday.phases import PhaseError

ROOT = Path(__file__).resolve().parents[2]
SHAPE = dict(
    layers=8,
    hidden_size=2048,
    moe_intermediate_size=768,
    num_experts=64,
    num_experts_per_tok=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=32000,
)
SMOKE_SHAPE = dict(SHAPE, layers=2, hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
SMOKE_SHAPE.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
TINY = dict(hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY.update(vocab_size=256)
DENSE_LAYERS = 80  # the layers passcost.PRIORS["cuda"]["forward_floor_s"] is stated for
TOKENS = (1, 8, 32)
ROUNDS = 5
CACHE_SHARE = 0.25  # of each layer's experts cached on the device in the split
NEAR_TIE = 0.05  # greedy ids may differ where the two logits are this close (x the logits' std)
FLOP_TOKENS = 256  # tokens of the CPU experts' FLOP/s cell: every expert routed many rows
BOUND_S = 90.0


def _bench(name: str):
    """bench/<name>.py as a module (bench/ is no package; bench/offload.py must not hide offload)."""
    spec = importlib.util.spec_from_file_location(f"specx_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write(path: Path, shape: dict, layers: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Path:
    """A seeded checkpoint saved by transformers: Qwen3-MoE where `shape` has experts, else Llama; weights
    initialized on `device` (the card builds 5 GB in seconds), reused when complete (`.done` is written last)."""
    import transformers

    if (path / ".done").exists():
        return path
    dims = {k: v for k, v in shape.items() if k != "layers"}
    if "num_experts" in shape:
        cfg = transformers.Qwen3MoeConfig(
            **dims, intermediate_size=shape["moe_intermediate_size"], num_hidden_layers=layers, norm_topk_prob=True
        )
    else:
        dims.pop("moe_intermediate_size", None)
        cfg = transformers.LlamaConfig(**dims, intermediate_size=2 * shape["hidden_size"], num_hidden_layers=layers)
    cfg.tie_word_embeddings = False
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(path)
    (path / ".done").touch()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return path


def _load(path: Path, dev: torch.device, dtype: torch.dtype, **kw):
    from offload import OffloadedCausalLM

    return OffloadedCausalLM.from_pretrained(path, device=dev, dtype=dtype, **kw)


def _pass(model, ids: torch.Tensor):
    return model(input_ids=ids[None].to(model.input_device), use_cache=False).logits[0, -1].float()


def floors(ctx: dict, dtype: torch.dtype) -> dict:
    """Per tiny model (see the contract): wall, kernels' time and floor of a pass at each n."""
    dev, root = ctx["device"], ctx["out"] / "moe"
    layers = 4 if ctx["smoke"] else DENSE_LAYERS
    shape = ctx["moe_shape"]
    moe = {k: shape[k] for k in ("num_experts", "num_experts_per_tok")}
    dense = write(root / "tiny-dense", TINY, layers, dtype, dev)
    sparse = write(root / "tiny-moe", dict(TINY, **moe), shape["layers"], dtype, dev)
    stream = {"offload": "ram", "max_device_memory": 0, "experts": "layers"}
    cases = (
        ("dense", layers, "resident", dense, {"offload": "none"}),
        ("moe", shape["layers"], "resident", sparse, {"offload": "none"}),
        ("moe", shape["layers"], "streamed", sparse, stream),
    )
    out = []
    for kind, count, where, path, kw in cases:
        model = _load(path, dev, dtype, **kw)
        try:
            rows = []
            for n in TOKENS:
                ids = torch.randint(1, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(n))
                _pass(model, ids)  # warm-up
                wall = statistics.median(device_seconds(lambda: _pass(model, ids), dev) for _ in range(ROUNDS))
                busy, profiled, spans = busy_seconds(lambda: _pass(model, ids), dev)
                base = wall if dev.type == "cuda" else profiled  # a CPU's op spans are the profiled pass's
                floor = base - busy if spans else None  # None: the profiler traced no kernel (no CUPTI)
                rows.append(dict(n=n, wall_s=wall, profiled_s=profiled, kernels_s=busy, spans=spans, floor_s=floor))
        finally:
            model.close()
        out.append(dict(kind=kind, layers=count, placement=where, rows=rows))
    return dict(cases=out, prior_s=PRIORS[dev.type]["forward_floor_s"], prior_layers=DENSE_LAYERS)


def cpu_experts(ctx: dict, dtype: torch.dtype) -> dict:
    """The host CPU's routed-expert rates (see the contract), with bench/moe_experts.py's layer and cells."""
    from offload.planning.experts import CPU_EXPERTS
    from specexec_cli.tools.kernelprobes import probe_cpu_experts

    mx, s, smoke = _bench("moe_experts"), ctx["moe_shape"], ctx["smoke"]
    e, k, h, i = s["num_experts"], s["num_experts_per_tok"], s["hidden_size"], s["moe_intermediate_size"]
    layer = mx.build(e, h, i, dtype)
    flush = torch.ones((16 if smoke else 1024) * 2**20 // 4)
    gen = torch.Generator().manual_seed(1)
    every = torch.arange(e)[:, None]  # warm-up: each expert once
    layer(torch.zeros(e, h, dtype=dtype), every, torch.ones(e, 1, dtype=dtype))
    expert_bytes = 3 * h * i * dtype.itemsize
    cells = []
    for n in TOKENS + (FLOP_TOKENS,):
        r = mx.cell(layer, flush, gen, n, k, 3 if smoke else ROUNDS, h, dtype)
        secs = r["ms"] / 1e3
        cells.append(dict(r, bps=r["distinct"] * expert_bytes / secs, flops=2.0 * n * k * 3 * h * i / secs))
    probe = probe_cpu_experts(**(dict(hidden=256, inter=128, span=8 << 20) if smoke else {}))
    return dict(
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        expert_bytes=expert_bytes,
        cells=cells,
        bps=cells[0]["bps"],
        flops=cells[-1]["flops"],
        profile_probe=probe,
        prior_bps=CPU_EXPERTS["bps"],
        prior_flops=CPU_EXPERTS["flops"],
    )


def split_unavailable() -> str | None:
    """Why experts="split" cannot run here (None: it can be tried)."""
    if importlib.util.find_spec("offload.stream.splitexperts") is None:
        return "split not available"
    return None


def models(ctx: dict, path: Path, dtype: torch.dtype, cached: int) -> tuple[dict, dict]:
    """({mode: loaded model}, {mode: why not run}) for "layers" and "split"."""
    from offload import OffloadError

    dev = ctx["device"]
    loaded = {"layers": _load(path, dev, dtype, offload="ram", max_device_memory=0, experts="layers")}
    why = {}
    if (reason := split_unavailable()) is not None:
        why["split"] = f"not run: {reason}"
    else:
        try:
            loaded["split"] = _load(path, dev, dtype, experts="split", expert_cache=cached)
        except OffloadError as err:  # refused (e.g. on a CPU): said, not faked
            why["split"] = f"not run: {str(err).splitlines()[0]}"
        except Exception as err:  # noqa: BLE001 - the whole-layer figures still count; the phase fails at its end
            why["split"] = failed(err)
    return loaded, why


def failed(err: Exception) -> str:
    return f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"


def timed(ctx: dict, loaded: dict, why: dict, t0: float) -> tuple[dict, list]:
    """{(mode, n): [(seconds, bytes streamed)]} and the passes whose greedy ids differ (see the contract). A
    mode whose pass raises is timed no further (`why` says so): the other's figures still count."""
    dev, vocab = ctx["device"], ctx["moe_shape"]["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    samples, differ = {(m, n): [] for m in loaded for n in TOKENS}, []
    for n in TOKENS:
        warm = torch.randint(1, vocab, (n,), generator=gen)
        for r in range(ROUNDS + 1):  # round 0: the warm-up, untimed
            if r > 1 and not ctx["smoke"] and time.perf_counter() - t0 > BOUND_S:
                break
            ids, logits = torch.randint(1, vocab, (n,), generator=gen) if r else warm, {}
            for mode, m in list(loaded.items()):
                box = []
                try:
                    secs = device_seconds(lambda: box.append(_pass(m, ids)), dev)
                except Exception as err:  # noqa: BLE001 - see the docstring
                    why[mode] = failed(err)
                    del loaded[mode]
                    continue
                if r:
                    samples[(mode, n)].append((secs, m.stats.streamed_bytes_per_pass))
                    logits[mode] = box[0]
            ref = logits.get("layers")
            for mode, lg in logits.items() if ref is not None else ():
                a, b = int(ref.argmax()), int(lg.argmax())
                if a != b:
                    differ.append(dict(n=n, mode=mode, ids=[a, b], margin=float((ref[a] - ref[b]) / ref.std())))
    return samples, differ


def modelled(ctx: dict, path: Path, placement, cached: int, measured: dict) -> dict:
    """{mode: {n: (priors' seconds, measured priors' seconds)}} by experts.mode_seconds (see the contract)."""
    import psutil

    from offload.formats import open_checkpoint
    from offload.planning.experts import mode_seconds
    from offload.planning.membytes import arch_of
    from offload.planning.memplan import PlanRequest, plan_memory

    dev, smoke = ctx["device"], ctx["smoke"]
    device = predict.device(ctx["card"])
    ck = open_checkpoint(path)
    free = torch.cuda.mem_get_info()[0] if dev.type == "cuda" else None
    req = PlanRequest(
        device=dev.type,
        dtype="fp32" if smoke else "bf16",
        draft_dtype=None,
        ram_free=psutil.virtual_memory().available,
        device_free=free,
        offload="ram",
        cost_device=device,
    )
    plan = plan_memory(ck, None, req)
    where = dict(resident=placement.resident, ram_layers=placement.ram_layers, disk_layers=placement.disk_layers)
    total = plan.experts["experts"] * plan.experts["sparse_layers"]
    split = dict(gpu_experts=cached, ram_experts=total - cached, disk_experts=0, hit=cached / total)
    plans = {"layers": replace(plan, **where), "split": replace(plan, experts={**plan.experts, **split})}
    rates = dict(cpu_bps=measured["cpu"]["bps"], cpu_flops=measured["cpu"]["flops"])
    cases = measured["floors"]["cases"]
    floor = {c["placement"]: {r["n"]: r["floor_s"] for r in c["rows"]} for c in cases if c["kind"] == "moe"}
    a, c, out = arch_of(ck.config), 4 if smoke else 2, {}
    for mode, p in plans.items():
        mine = replace(p, experts={**p.experts, **rates})
        key = "resident" if mode == "split" else "streamed"
        out[mode] = {
            n: (
                mode_seconds(a, p, device, n, 0, c, mode),
                mode_seconds(a, mine, floored(device, floor[key][n]), n, 0, c, mode),
            )
            for n in TOKENS
        }
    return dict(seconds=out, plan_mode=plan.experts["mode"], plan_runs=plan.experts["runs"])


def moe(ctx: dict) -> dict:
    """The phase (see the contract); its checkpoints are removed when it ends, ok or not."""
    try:
        return measure(ctx)
    finally:
        shutil.rmtree(ctx["out"] / "moe", ignore_errors=True)


def floored(device, floor: float | None):
    """The Device with a measured forward floor (none traced: its prior's)."""
    return device if floor is None else replace(device, forward_floor_s=max(0.0, floor))


def measure(ctx: dict) -> dict:
    t0 = time.perf_counter()
    dev, smoke = ctx["device"], ctx["smoke"]
    shape = ctx.setdefault("moe_shape", SMOKE_SHAPE if smoke else SHAPE)
    dtype = torch.float32 if smoke else torch.bfloat16
    path = write(ctx["out"] / "moe" / "qwen3-moe", shape, shape["layers"], dtype, dev)
    built = time.perf_counter() - t0
    measured = dict(cpu=cpu_experts(ctx, dtype), floors=floors(ctx, dtype))
    cached = round(CACHE_SHARE * shape["num_experts"]) * shape["layers"]
    loaded, why = models(ctx, path, dtype, cached)
    everything = dict(loaded)  # timed() drops a mode that fails
    try:
        placement = loaded["layers"].plan
        samples, differ = timed(ctx, loaded, why, t0)
    finally:
        for m in everything.values():
            m.close()
    try:
        model = modelled(ctx, path, placement, cached, measured)
    except Exception as err:  # noqa: BLE001 - e.g. no probe: the measured figures are still written
        why["modelled"], model = failed(err), dict(seconds={}, plan_mode=None)
    rows = []
    for mode in ("layers", "split"):
        for n in TOKENS:
            row, got = dict(mode=mode, n=n), samples.get((mode, n))
            if got:
                row.update(seconds=statistics.median(s for s, _ in got), streamed_bytes=got[-1][1], rounds=len(got))
            else:
                row["not_run"] = why.get(mode, "not run")
            row["modelled_s"], row["modelled_measured_s"] = model["seconds"].get(mode, {}).get(n, (None, None))
            rows.append(row)
    out = dict(
        shape=shape,
        dtype=str(dtype).removeprefix("torch."),
        checkpoint_bytes=sum(f.stat().st_size for f in path.glob("*.safetensors")),
        expert_bytes=3 * shape["hidden_size"] * shape["moe_intermediate_size"] * dtype.itemsize,
        cache_experts=cached,
        cache_share=CACHE_SHARE,
        build_s=built,
        bound_s=BOUND_S,
        rows=rows,
        differ=differ,
        ids_equal=not differ,
        failed={m: w for m, w in why.items() if w.startswith("failed")},
        plan_mode=model["plan_mode"],
        cpu=measured["cpu"],
        floors=measured["floors"],
        seconds=time.perf_counter() - t0,
    )
    if out["failed"]:
        raise PhaseError(f"moe: {out['failed']}", out)
    if far := [d for d in differ if d["margin"] > NEAR_TIE]:
        raise PhaseError(f"moe: greedy ids differ beyond a near tie: {far[:3]}", out)
    return out
