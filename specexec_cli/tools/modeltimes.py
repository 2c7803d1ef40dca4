"""`specx profile --target`: the model part of a profile, measured through the path a run takes.

Contract: `measure(flags, max_tokens, progress)` plans and loads the target as `specx run` would with
the same flags (session/options.plan_for_cli + load_planned), then times t_target(n) for n = 1, 2, 4,
... up to min(max_tokens, 4096, the plan's largest pass) (`target_passes`) and each draft a run could
take (`draft_configs`, each planned and loaded on its own): a tree-growth step and whole trees at
TREE_BUDGETS (`time_draft`), and draft seconds per pass of real decoding (`time_draft_in_runs`); a
mixture-of-experts target's `routing` (`count_routing`). It records the placement ([resident, RAM,
disk] layers), resolved target path and dtype the timings hold for (session/profiles.profile_matches,
offload/planning/draftcost.py), and under `floors` ({device: ...}, lifted to the profile's top level by
profiler.build_profile) the per-forward floors passcost.Device prices: `floor_seconds` of a 1-token
target pass (forward_floor_s) and of the first draft's step (step_floor_s), where `floor_measurable`.
Nothing here prints; errors are SpecxError.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from pathlib import Path

import torch

from specexec_cli.core import draftstep, kvcache
from specexec_cli.core.draft import DraftContext, TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.core.tree import causal_mask

CONTEXT_TOKENS = 64  # committed tokens in the cache while timing a pass (a short conversation)
WARMUP = 2  # untimed passes before each timed size (caches, allocator, page cache, threads)
TREE_BUDGETS = (16, 64, 256, 1024)  # draft tree sizes timed (the dry run's budgets)
SLOW_CALL = 2.0  # seconds: a call this slow is timed once (its noise is small against it)
ROUTING_TOKENS = 256  # sample tokens whose routing a mixture-of-experts target's profile counts
FLOOR_ROUNDS = 5  # profiled calls whose medians give a floor
SAMPLE = "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n        print(name)\n"


def median_time(fn, min_seconds: float = 0.3, max_reps: int = 15, warmup: int = WARMUP) -> float:
    """Median of repeated fn() calls filling ~min_seconds (at least 3; one when a warm call takes over
    SLOW_CALL seconds) after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while (
        not times
        or (len(times) < 3 and times[0] < SLOW_CALL)
        or (time.perf_counter() - start < min_seconds and len(times) < max_reps)
    ):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def context_ids(tokenizer) -> list[int]:
    return (tokenizer(SAMPLE * 8)["input_ids"] * 4)[:CONTEXT_TOKENS]


def target_passes(models):
    """pass_of(n): a call running one target pass over n new tokens on a CONTEXT_TOKENS-token cache
    (cropped back after each)."""
    m, dtype = models.target, kvcache.model_dtype(models.target)
    ids = context_ids(models.tokenizer)
    cache, ctx = kvcache.new_cache(), len(ids)
    kvcache.forward(m, cache, torch.tensor(ids), torch.arange(ctx), causal_mask(0, ctx, dtype, m.device))

    def pass_of(n: int):
        toks = torch.tensor((ids * (n // max(ctx, 1) + 1))[:n])

        def one_pass():
            kvcache.forward(m, cache, toks, torch.arange(ctx, ctx + n), causal_mask(ctx, n, dtype, m.device))
            kvcache.crop(cache, ctx)

        return one_pass

    return pass_of


def _wall(fn, dev: torch.device) -> float:
    """Seconds of fn() on `dev`, the card's queue drained before and after on CUDA."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def busy_seconds(fn, dev: torch.device) -> tuple[float, float, int]:
    """(seconds the device was busy during fn(), fn()'s wall seconds under the profiler, spans seen): the
    union of the kernel and copy spans in torch.profiler's trace on CUDA; on a CPU the aten ops' spans (the
    work, without the dispatch between ops; not the leaves alone: an op's own work beside its children, as
    SDPA's beside its allocations, counts)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read as the profiler first starts: no start/stop lines on stderr
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        wall = _wall(fn, dev)
    if dev.type == "cuda":
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.name.startswith("aten::")]  # nested spans merge below
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:  # union of intervals, in microseconds
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy / 1e6, wall, len(spans)


def floor_seconds(fn, dev: torch.device, rounds: int = FLOOR_ROUNDS) -> dict | None:
    """{floor_s, wall_s, busy_s} of fn() after one untimed call: medians over `rounds` calls. wall_s is an
    unprofiled call's seconds; on CUDA floor_s = wall - the kernel and copy spans (busy_seconds; profiling
    slows the host, not the card). On a CPU the profiler slows the ops and the gaps between them alike, so
    the profiled call gives the SHARE of its wall outside any op span: floor_s = wall x (1 - busy / profiled
    wall), busy_s = wall - floor_s. None where the trace holds no spans (no CUPTI)."""
    fn()
    rows = []
    for _ in range(rounds):
        busy, profiled, spans = busy_seconds(fn, dev)
        if not spans:
            return None
        wall = _wall(fn, dev)
        floor = wall - busy if dev.type == "cuda" else wall * (1 - busy / profiled)
        rows.append((max(0.0, floor), wall, wall - max(0.0, floor)))
    return {k: round(statistics.median(r[i] for r in rows), 7) for i, k in enumerate(("floor_s", "wall_s", "busy_s"))}


def floor_measurable(model, plan) -> bool:
    """Whether a pass's busy spans hold all its work and transfers, so that wall - busy is its floor alone:
    not where layers stream from disk or routed experts are read on demand or computed on the host (the
    reads and the host's expert work are no spans), nor on a CPU where specx's C kernels multiply GGUF
    blocks (offload/cpu: ctypes calls, no aten ops); on CUDA a copy over the link is a span."""
    from offload.formats import ggml_kernel_enabled

    if plan is not None and (plan.disk_layers or (plan.experts or {}).get("mode", "layers") != "layers"):
        return False
    if torch.device(model.device).type == "cuda":
        return True
    # a linear the kernel may serve: its GGUF type (PackedLinear, KernelLowbitLinear) or PackedHead's qtype
    packed = any(getattr(m, "ggml_type", None) is not None or hasattr(m, "qtype") for m in model.modules())
    return not (packed and ggml_kernel_enabled())


def count_routing(models, tokens: int = ROUTING_TOKENS) -> dict | None:
    """{tokens, experts, layers, counts} of one target pass over `tokens` sample tokens: per sparse layer
    the tokens routed to each expert (from the top-k indices each experts module is called with),
    `counts` flattened layer by layer as planning/experts.hit_share takes them. None for a dense target."""
    m = models.target
    e = getattr(m.config, "num_local_experts", None) or getattr(m.config, "num_experts", None)
    mods = [
        (int(re.search(r"layers\.(\d+)\.", n).group(1)), mod) for n, mod in m.named_modules() if n.endswith(".experts")
    ]
    if not e or not mods:
        return None
    counts = {i: torch.zeros(e, dtype=torch.long) for i, _ in mods}

    def counter(i):
        def pre(_mod, args, kwargs):  # (hidden (T, H), top-k indices (T, K), weights), positional or named
            idx = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if "ind" in k)
            counts[i].add_(torch.bincount(idx.flatten().cpu(), minlength=e + 1)[:e])

        return pre

    ids = torch.tensor((models.tokenizer(SAMPLE * 16)["input_ids"] * tokens)[:tokens])
    hooks = [mod.register_forward_pre_hook(counter(i), with_kwargs=True) for i, mod in mods]
    try:
        n, dtype = len(ids), kvcache.model_dtype(m)
        kvcache.forward(m, kvcache.new_cache(), ids, torch.arange(n), causal_mask(0, n, dtype, m.device))
    finally:
        for h in hooks:
            h.remove()
    layers = sorted(counts)
    return dict(tokens=len(ids), experts=e, layers=layers, counts=[c for i in layers for c in counts[i].tolist()])


def time_draft(models, budgets, beams: int, max_depth: int = 64, floor: bool = False) -> dict:
    """{step_seconds: one draft step over `beams` nodes, grow_seconds: {budget: one whole tree}, max_beams},
    through core/draftstep.run (CUDA graphs replayed) over a draft cache reserved as a run's is; `floor`:
    also `step_floor`, the step's floor_seconds (None where the trace held no spans)."""
    from specexec_cli.core.draft import grow_tree

    d, dtype = models.draft, kvcache.model_dtype(models.draft)
    ids = context_ids(models.tokenizer)
    ctx = len(ids) - 1
    cache = kvcache.new_cache()
    if models.kv_rows is not None and not models.shared_kv:  # as core/state.reserve_caches (uncounted)
        kvcache.reserve(cache, d, max(models.kv_rows[1], ctx + 2 * max(budgets, default=0) + beams + 1))
    kvcache.forward(d, cache, torch.tensor(ids[:-1]), torch.arange(ctx), causal_mask(0, ctx, dtype, d.device))
    toks, pos = torch.tensor((ids * 4)[:beams]), torch.arange(ctx, ctx + beams)

    def step():  # one tree level: `beams` nodes that see the context and themselves
        draftstep.run(d, cache, toks, pos, ctx, None)
        kvcache.crop(cache, ctx)

    grow = {}
    for b in budgets:

        def tree():
            grow_tree(d, cache, DraftContext(ctx, ids[-1:], ctx), TreeShape(b, max_depth, beams), SamplingParams())
            kvcache.crop(cache, ctx)

        grow[str(b)] = round(median_time(tree, 0.3, 5, 1), 6)
    out = dict(step_seconds=round(median_time(step), 6), grow_seconds=grow, max_beams=beams)
    if floor:
        out["step_floor"] = floor_seconds(step, torch.device(d.device))
    return out


def time_draft_in_runs(models, budgets, beams: int, passes: int = 4) -> dict:
    """{budget: median draft seconds per pass} of real specexec decoding (T = 0): what a run's
    --stats-json draft_seconds counts (growth, scoring, cache trimming); one untimed pass first."""
    ids = context_ids(models.tokenizer)
    out = {}
    for b in budgets:
        cfg = GenerationConfig(method="specexec", shape=TreeShape(b, 64, beams), max_new_tokens=10_000)
        secs = []
        for ev in generate(models, DecodeState(), ids, cfg):
            if ev.pass_index >= 2:  # pass 0 is the prefill, pass 1 the warm-up
                secs.append(ev.draft_seconds)
            if len(secs) >= passes:
                break
        if secs:
            out[str(b)] = round(statistics.median(secs), 6)
    return out


def draft_configs(draft: str | None) -> list[tuple[str | None, int | None, str]]:
    """(--draft, --draft-bits, timing key) of every draft to time: the target alone first when no draft."""
    from specexec_cli.session.deps import BITS_NEED, installed

    if draft is None:
        return [(None, None, "")]
    if draft == "self":
        return [("self", b, f"self-{b}") for b in (4, 3, 2) if installed(BITS_NEED[b])]
    return [(draft, None, "small")]


def plan_and_load(flags: dict, draft, bits, progress):
    """(models, plan, cfg) planned and loaded as `specx run` with these flags would."""
    from specexec_cli.session.options import ModelFlags, generation_config, load_planned, plan_for_cli

    method = "specexec" if draft else "ar"
    cfg = generation_config(
        method, "auto", 64, flags.get("max_beams", 32), 32, 16, 0.0, None, None, 0, flags.get("device", "auto")
    )
    bits_flag = str(bits) if bits else "auto"  # `flags`: the `specx profile` flags, each a ModelFlags field
    run = ModelFlags(**{**flags, "draft": draft, "method": method, "draft_bits": bits_flag, "temperature": 0.0})
    opts, plan, cfg = plan_for_cli(run, cfg)
    return load_planned(opts, plan, progress), plan, cfg


def measure(flags: dict, max_tokens: int, progress=None, calibration_tokens: int = 0) -> tuple[dict, dict | None]:
    """(the profile's "models" part (see the contract), its node calibration: session/calprobe.py's
    on the first pair with a draft, `calibration_tokens` per probe prompt; None without either)."""
    from specexec_cli.session.calprobe import measure_calibration
    from specexec_cli.session.loading import close_models
    from specexec_cli.session.modelref import ModelRef

    configs = draft_configs(flags.get("draft"))
    out: dict = dict(
        target=flags["target"],
        target_resolved=str(Path(flags["target"]).expanduser().resolve()),
        draft=flags.get("draft"),
        context_tokens=CONTEXT_TOKENS,
        draft_timings={},
        floors={},
    )
    node_calibration = None
    # one ModelRef for every load: the target is resolved, opened and tokenized once
    pickle, trust = flags.get("allow_pickle", False), flags.get("trust_remote_code", False)
    flags = {**flags, "target": ModelRef("--target", flags["target"], pickle, trust)}
    for i, (draft, bits, key) in enumerate(configs):
        models, plan, cfg = plan_and_load(flags, draft, bits, progress)
        try:
            if i == 0:
                limit = min(max_tokens, 4096, models.ctx_limit - CONTEXT_TOKENS, plan.pass_tokens if plan else 4096)
                ns = [1 << k for k in range(max(0, limit).bit_length()) if 1 << k <= limit]
                if progress:
                    progress(0, len(configs) + 1, f"target passes, 1 to {ns[-1]} tokens")
                pass_of = target_passes(models)
                out["target_seconds"] = {str(n): round(median_time(pass_of(n)), 6) for n in ns}
                dev = torch.device(models.target.device)
                if floor_measurable(models.target, plan) and (f := floor_seconds(pass_of(1), dev)):
                    out["floors"][dev.type] = dict(target=out["target"], **_named(f, "forward"))
                out["placement"] = [len(plan.resident), len(plan.ram_layers), len(plan.disk_layers)] if plan else None
                out["plan_dtype"] = plan_dtype(flags)
                out["device"] = str(getattr(models.target, "device", flags.get("device", "auto")))
                if routing := count_routing(models):
                    out["routing"] = routing
                if draft is not None and calibration_tokens > 0:
                    node_calibration = measure_calibration(models, calibration_tokens, progress)
            if draft is not None:
                if progress:
                    progress(i + 1, len(configs) + 1, f"draft trees ({key})")
                budgets = [b for b in TREE_BUDGETS if b <= max(TREE_BUDGETS[0], max_tokens)]
                first = not out["draft_timings"] and floor_measurable(models.draft, plan)
                timing = time_draft(models, budgets, cfg.shape.max_beams, floor=first)
                if step := timing.pop("step_floor", None):
                    out["floors"].setdefault(torch.device(models.draft.device).type, {}).update(_named(step, "step"))
                out["draft_timings"][key] = timing
                out["draft_timings"][key]["pass_seconds"] = time_draft_in_runs(models, budgets, cfg.shape.max_beams)
        finally:
            close_models(models)
    first = next(iter(out["draft_timings"].values()), None)
    if first:  # what core/budget.TimingModel.from_profile reads (the first draft timed)
        out["draft_step_seconds"], out["draft_grow_seconds"] = first["step_seconds"], first["grow_seconds"]
        out["max_beams"], out["max_depth"] = first["max_beams"], 64
    return out, node_calibration


def _named(floor: dict, kind: str) -> dict:
    """floor_seconds' {floor_s, wall_s, busy_s} as the profile's {kind_floor_s, kind_wall_s, kind_busy_s}."""
    return {f"{kind}_{k}": v for k, v in floor.items()}


def plan_dtype(flags: dict) -> str:
    """The target dtype the plan resolved (what session/profiles.profile_matches compares)."""
    from specexec_cli.session.planning import plan_device, plan_dtypes

    device = plan_device(flags.get("device", "auto"))
    return plan_dtypes(flags.get("dtype", "auto"), device, False)[0]
