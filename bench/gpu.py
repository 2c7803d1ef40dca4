"""GPU day: a 70B-shaped stack of a few layers streamed to the device, in phases that resume.

Contract (run by hand on a CUDA machine, one phase per command, each inside 10 minutes on an H100
with a 64 GiB disk and 128 GiB RAM; `--smoke` runs every phase with tiny shapes on the CPU):
- Shapes: Llama-3-70B's layer (hidden 8192, MLP 28672, 64 heads of head_dim 128, 8 KV heads: 8:1
  GQA) and vocabulary size (128256: embeddings and lm_head at full size, the demo tokenizer's ids),
  random bf16 weights (std 0.02); a small draft of the same vocabulary (2 layers, hidden 512). The
  shapes, the disk accounting of `write` and the checkpoint writer live in bench/gpu_stack.py.
- `write`: as many layers as --layers, 50% of available RAM and 85% of the free disk allow, where
  the disk counts EVERY file the later phases write: the 16-bit checkpoint, the nf4 cache (its
  packed layers plus its 16-bit copy of the globals), one HQQ cache per --self-bits width below 4
  (fp32 scales and zeros), and the draft. Caches go to $SPECX_CACHE, by default beside --ckpt
  (`<ckpt>-cache`) so that one disk holds and counts them all.
- `quantize`: the nf4 cache and the HQQ substitutes of every layer, on the GPU when there is one
  (offload/quant/quant_cache.py, offload/quant/lowbit.py); both caches reuse what an interrupted run left.
- `passes`: every layer streamed (RAM tier when it fits 70% of RAM), the median of --repeats
  forwards per token count, against the floor (streamed bytes / the slowest link's GB/s, pinned
  host->device measured over 1 GiB, the disk's O_DIRECT reads when the layers stream from disk).
- `decode`: `ar`, specexec with the small draft, and specexec with `--draft self` at each
  --self-bits width, all on ONE loaded target and streaming plan (capped by --max-gpu-memory, by
  default the globals + 2 layers + 4 GiB, so layers stream even on an 80 GB card): tokens/s,
  tokens per pass, stall seconds per pass (compute waiting for a streamed layer) and draft seconds
  per pass. Random weights make acceptance near zero: these rows measure costs, not speed-ups.
- State: `<ckpt>/bench-state.json` records each finished phase and its figures; `--phase all`
  runs the phases not done yet, a named phase runs (again) that one; every command rewrites --out
  with all the figures so far and prints them. A changed shape/layer count/width starts over.

    python bench/gpu.py --phase write      # then quantize, passes, decode (bench/README.md)
    python bench/gpu.py --smoke            # CPU: every phase, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.append(str(ROOT / "bench"))   # after the package: bench/offload.py must not shadow offload/

from gpu_stack import (DRAFT_70B, DRAFT_SMOKE, SHAPE_70B, SHAPE_SMOKE, layer_count,  # noqa: E402
                       layer_params, layer_tensors, write_model)  # bench/ is not a package; tools/gpuday uses these too
from offload.stream.timing import device_seconds as timed  # noqa: E402

PHASES = ("write", "quantize", "passes", "decode")


def link_gbps(device: torch.device) -> float:
    """Pinned host->device GB/s (CPU: host memcpy): 1 GiB (smoke: 64 MiB) / the median of 5 timed
    copies after one warm-up."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    times = [timed(lambda: dst.copy_(src, non_blocking=True), device) for _ in range(5)]
    return n / statistics.median(times) / 1e9


def disk_gbps(path: Path, limit: int = 2 << 30) -> float:
    """O_DIRECT read GB/s of the checkpoint's layer files (what the disk tier reads): the median
    of 3 sequential passes over up to `limit` bytes, 64 MiB requests, page cache bypassed."""
    import time

    from offload.stream.storage import IO_ALIGN, DirectReader, Span, aligned_empty

    chunk = 64 << 20
    buf, reader = aligned_empty(chunk), DirectReader()
    spans, total = [], 0
    for f in sorted(path.glob("layer-*.safetensors")):
        size = f.stat().st_size // IO_ALIGN * IO_ALIGN
        for off in range(0, size, chunk):
            n = min(chunk, size - off, limit - total)
            if n <= 0:
                break
            spans.append(Span(f, off, n, n, 0))
            total += n
    times = []
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            for span in spans:
                reader.read_span(span, buf)
            times.append(time.perf_counter() - t0)
    finally:
        reader.close()
    return total / statistics.median(times) / 1e9 if total else float("inf")


def pass_rows(path: Path, device: torch.device, tokens: list[int], repeats: int, gbps: float,
              force: str = "auto") -> tuple[list, str, dict]:
    """Median pass time per n over every-layer-streamed passes; floor from the slowest tier's GB/s."""
    from offload import OffloadedCausalLM

    layer_bytes = sum(math.prod(s) for s in layer_tensors(json.loads((path / "config.json").read_text())).values())
    n_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    in_ram = 2 * layer_bytes * n_layers < 0.7 * psutil.virtual_memory().available if force == "auto" else force == "ram"
    kw = dict(max_device_memory=0) if in_ram else dict(max_device_memory=0, max_host_memory=0)
    tier = dict(tier="ram" if in_ram else "disk", link_gbps=gbps)
    if not in_ram:
        tier["disk_gbps"] = disk_gbps(path)
    floor_gbps = tier["floor_gbps"] = gbps if in_ram else min(gbps, tier["disk_gbps"])
    model = OffloadedCausalLM.from_pretrained(path, device=device, dtype="bf16", offload=tier["tier"], **kw)
    rows = []
    try:
        with torch.no_grad():
            for n in tokens:
                x = torch.randint(0, model.config.vocab_size, (1, n), device=device)
                model(input_ids=x)   # warm-up at this size
                times = [timed(lambda: model(input_ids=x), device) for _ in range(repeats)]
                med = statistics.median(times)
                floor = model.stats.streamed_bytes_per_pass / (floor_gbps * 1e9)
                rows.append(dict(tokens=n, pass_seconds=med, pass_seconds_min=min(times), floor_seconds=floor,
                                 ratio=med / floor))
                print(f"n={n:5d} pass {1000 * med:8.1f} ms (min {1000 * min(times):8.1f})  floor {1000 * floor:8.1f} ms"
                      f"  ratio {med / floor:5.2f}", file=sys.stderr)
        return rows, model.plan.describe(), tier
    finally:
        model.close()


def phase_write(args, ctx) -> dict:
    t0 = time.perf_counter()
    layers, sizing = layer_count(ctx["shape"], args.layers, ctx["bits"], ctx["draft_shape"],
                                 [ctx["ckpt"], Path(os.environ["SPECX_CACHE"])])
    if ctx["smoke"]:
        layers = min(layers, 3)
    write_model(ctx["ckpt"], ctx["shape"], layers, ctx["device"])
    draft = dict(ctx["draft_shape"], vocab_size=ctx["shape"]["vocab_size"])
    write_model(ctx["draft"], {k: v for k, v in draft.items() if k != "num_hidden_layers"},
                draft["num_hidden_layers"], ctx["device"], seed=1)
    return dict(layers=layers, seconds=round(time.perf_counter() - t0, 1), **sizing)


def phase_quantize(args, ctx) -> dict:
    from offload.quant.lowbit import ensure_lowbit_layers
    from offload.quant.nf4 import packing_for
    from offload.quant.quant_cache import ensure_nf4_cache

    out, layers = {}, list(range(ctx["layers"]))
    t0 = time.perf_counter()
    ensure_nf4_cache(ctx["ckpt"], packing=packing_for(ctx["device"]))
    out["nf4_seconds"] = round(time.perf_counter() - t0, 1)
    for b in (b for b in ctx["bits"] if b in (3, 2)):
        t0 = time.perf_counter()
        ensure_lowbit_layers(ctx["ckpt"], layers, b,
                             lambda d, n, what: print(f"hqq{b}: {d}/{n} {what}", file=sys.stderr, flush=True))
        out[f"hqq{b}_seconds"] = round(time.perf_counter() - t0, 1)
    out["disk_used"] = sum(f.stat().st_size for d in (ctx["ckpt"], ctx["draft"], Path(os.environ["SPECX_CACHE"]))
                           if d.exists() for f in d.rglob("*") if f.is_file())
    return out


def phase_passes(args, ctx) -> dict:
    gbps = link_gbps(ctx["device"])
    rows, placement, tier = pass_rows(ctx["ckpt"], ctx["device"], [int(t) for t in args.tokens.split(",")],
                                      args.repeats, gbps, args.tier)
    return dict(rows=rows, placement=placement, **tier)


def decode_cap(args, ctx) -> int | None:
    """The decode plan's device cap: --max-gpu-memory, or globals + 2 layers + 4 GiB (layers stream)."""
    if ctx["device"].type != "cuda":
        return None
    if args.max_gpu_memory != "auto":
        from offload import parse_size

        return parse_size(args.max_gpu_memory)
    lin, norms = layer_params(ctx["shape"])
    glob = 2 * (2 * ctx["shape"]["vocab_size"] * ctx["shape"]["hidden_size"])
    return glob + 2 * 2 * (lin + norms) + (4 << 30)


def phase_decode(args, ctx) -> dict:
    from dataclasses import replace

    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import GenerationConfig
    from specexec_cli.session.loading import LoadOptions, load_models
    from specexec_cli.session.planning import make_plan
    from specexec_cli.session.prompts import encode_prompt

    device, cuda = ctx["device"], ctx["device"].type == "cuda"
    shape = TreeShape(budget=args.budget, max_depth=32)
    opts = LoadOptions(target=str(ctx["ckpt"]), draft=str(ctx["draft"]), dtype="bf16", device=device.type,
                       offload="auto" if cuda else "disk", ctx=2048, max_gpu_memory=decode_cap(args, ctx),
                       max_ram=None if cuda else 0)
    plan = make_plan(opts, shape, budget_auto=False)
    if not plan.fits:
        raise SystemExit(f"bench/gpu.py: {plan.reason}")
    models = load_models(replace(opts, plan=plan))
    ids = encode_prompt(models.tokenizer, "def fibonacci(n):\n", False)
    runs = [("ar", "none", models), ("specexec", "small-draft", models)]
    runs += [("specexec", f"self-{b}bit", replace(models, draft=self_draft(models.target, opts, b))) for b in ctx["bits"]]
    rows = []
    for method, name, pair in runs:   # one target, one streaming plan: only the draft changes
        rows.append(decode_row(pair, method, name, ids, GenerationConfig(method=method, shape=shape,
                                                                          max_new_tokens=args.max_new_tokens)))
        print(f"{method}/{name}: {rows[-1]}", file=sys.stderr, flush=True)
    return dict(rows=rows, placement=models.target.plan.describe(), budget=args.budget)


def decode_row(models, method: str, name: str, ids, cfg) -> dict:
    """tokens/s, tokens per pass, stall and draft seconds per target pass of one generation."""
    from specexec_cli.core.engine import DecodeState, generate

    stall0 = models.target.stats.stall_seconds
    draft_s = 0.0
    for ev in generate(models, DecodeState(), ids, cfg):
        draft_s += getattr(ev, "draft_seconds", 0.0)
        last = ev
    passes = max(1, last.pass_index)
    return dict(method=method, draft=name, tokens=last.new_tokens, decode_seconds=round(last.decode_seconds, 3),
                tokens_per_second=round(last.new_tokens / last.decode_seconds if last.decode_seconds > 0 else 0.0, 3),
                target_passes=last.pass_index,
                tokens_per_pass=round((last.new_tokens - 1) / passes, 3),
                stall_seconds_per_pass=round((models.target.stats.stall_seconds - stall0) / passes, 4),
                draft_seconds_per_pass=round(draft_s / passes, 4))


def self_draft(target, opts, bits: int):
    """`--draft self --draft-bits bits` built on the ALREADY LOADED target (its streamed layers get
    substitutes), so the self-draft rows run on the same streaming plan as the small draft's."""
    from dataclasses import replace
    from types import SimpleNamespace

    from specexec_cli.session.loading import load_self_draft

    draft = load_self_draft(target, replace(opts, draft_bits=bits), SimpleNamespace(by_component={}))
    if draft is None:
        raise SystemExit("bench/gpu.py: every target layer is resident; nothing to substitute for --self-bits")
    return draft


RUNNERS = {"write": phase_write, "quantize": phase_quantize, "passes": phase_passes, "decode": phase_decode}


def load_state(path: Path, key: dict) -> dict:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    return state if state.get("key") == key else {"key": key, "done": {}}


def report(state: dict) -> None:
    done = state["done"]
    if "write" in done:
        w = done["write"]
        print(f"write: {w['layers']} layers; disk planned {sum(w['planned_disk'].values()) / 2**30:.1f} GiB "
              f"of {w['free_disk'] / 2**30:.1f} GiB free ({', '.join(f'{k} {v / 2**30:.1f}' for k, v in w['planned_disk'].items())})")
    if "quantize" in done:
        print("quantize: " + ", ".join(f"{k} {v}" for k, v in done["quantize"].items()))
    if "passes" in done:
        p = done["passes"]
        print(f"passes ({p['tier']} tier, floor at {p['floor_gbps']:.2f} GB/s): " + "  ".join(
            f"n={r['tokens']} {1000 * r['pass_seconds']:.1f} ms x{r['ratio']:.2f}" for r in p["rows"]))
    if "decode" in done:
        print("| method | draft | tokens/s | tokens/pass | stall s/pass | draft s/pass |\n|---|---|---|---|---|---|")
        for r in done["decode"]["rows"]:
            print(f"| {r['method']} | {r['draft']} | {r['tokens_per_second']} | {r['tokens_per_pass']} | "
                  f"{r['stall_seconds_per_pass']} | {r['draft_seconds_per_pass']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", default="all", choices=("all",) + PHASES)
    ap.add_argument("--out", type=Path, default=Path("bench_gpu.json"))
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/specx-bench-70b-layers"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", default="1,16,64,256,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-gpu-memory", default="auto",
                    help="cap for the decode rows' plan (auto: globals + 2 layers + 4 GiB, so layers stream)")
    ap.add_argument("--tier", choices=["auto", "ram", "disk"], default="auto",
                    help="where the streamed layers live for the pass rows (auto: RAM when they fit 70%% of it)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, runs on CPU")
    ap.add_argument("--self-bits", default="4,3,2", help="--draft self widths to decode with ('' for none)")
    args = ap.parse_args()
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)   # its optional-CPU-kernel notice
    if not torch.cuda.is_available() and not args.smoke:
        print("bench/gpu.py: no CUDA device here; run it on a GPU machine, or pass --smoke for a tiny CPU run",
              file=sys.stderr)
        raise SystemExit(2)
    from specexec_cli.session.loading import quiet_transformers

    quiet_transformers()
    smoke = args.smoke
    ckpt = args.ckpt.with_name(args.ckpt.name + "-smoke") if smoke else args.ckpt
    os.environ.setdefault("SPECX_CACHE", str(ckpt.with_name(ckpt.name + "-cache")))
    bits = [int(b) for b in args.self_bits.split(",") if b.strip()]
    ctx = dict(smoke=smoke, ckpt=ckpt, draft=ckpt.with_name(ckpt.name + "-draft"), bits=bits,
               device=torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu"),
               shape=SHAPE_SMOKE if smoke else SHAPE_70B, draft_shape=DRAFT_SMOKE if smoke else DRAFT_70B)
    state_file = ckpt.with_name(ckpt.name + "-bench-state.json")
    state = load_state(state_file, dict(shape=ctx["shape"], want_layers=args.layers, bits=bits))
    todo = [p for p in PHASES if p not in state["done"]] if args.phase == "all" else [args.phase]
    for name in todo:
        if name != "write" and "write" not in state["done"]:
            raise SystemExit("bench/gpu.py: run --phase write first (then quantize, passes, decode)")
        ctx["layers"] = state["done"].get("write", {}).get("layers")
        print(f"bench/gpu.py: phase {name}", file=sys.stderr, flush=True)
        state["done"][name] = RUNNERS[name](args, ctx)
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(state, indent=1))
    result = dict(device=torch.cuda.get_device_name() if ctx["device"].type == "cuda" else "cpu",
                  shape=ctx["shape"], draft_shape=ctx["draft_shape"], synthetic_weights=True, **state["done"])
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    report(state)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
