"""GPU benchmark: 70B-shaped layers streamed to the device; pass / floor; ar vs specexec tok/s.

Contract (run by hand, on a machine with CUDA; `--smoke` runs a tiny version on CPU):
1. Writes a synthetic checkpoint of Llama-3-70B-shaped decoder layers (hidden 8192, MLP 28672,
   64 heads, 8 KV heads, bf16, random weights, std 0.02) with the embedded demo pair's 8192-token
   vocabulary and tokenizer, as many layers as --layers, the free disk (80%) and RAM allow; it
   is reused when its config matches.
2. Measures pinned host-to-device bandwidth (1 GiB pinned buffer, CUDA events, the MEDIAN of 5
   copies; on CPU: a host memcpy) and, when layers stream from disk, the disk's O_DIRECT read
   bandwidth over the checkpoint's layer files (median of 3 reads of up to 2 GiB).
3. Loads the target with every layer streamed (RAM tier when the layers fit 70% of free RAM,
   else disk) and times a forward of n tokens for n in --tokens: the MEDIAN of --repeats passes
   (the minimum is reported beside it; a best-of figure alone is biased low). floor = streamed
   bytes per pass / the bandwidth of the slowest tier on the path (PCIe for the RAM tier,
   min(disk, PCIe) for the disk tier), from the same median estimator; ratio = pass / floor.
4. Generates --max-new-tokens with `ar`, with `specexec` (demo draft, --budget), and with
   specexec and `--draft self` at each --self-bits width (built on the same loaded target, so
   every draft runs on ONE streaming plan), from the same prompt, and reports tok/s and tokens per
   pass side by side, on a plan capped at --max-gpu-memory (default 24GB) so that layers stream
   even on an 80 GB card. Random target weights make the draft's
   acceptance near zero, so this row measures specexec's overhead on this machine, NOT its
   speedup; pass --target/--draft (a real pair) for that.
Writes JSON (--out) and prints a short table.

    python bench/gpu.py --out gpu.json                    # CUDA
    python bench/gpu.py --smoke --out gpu_smoke.json      # CPU smoke run (tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload.timing import device_seconds as timed  # noqa: E402
DEMO = ROOT / "specexec_cli" / "demo"
SHAPE_70B = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8)
SHAPE_SMOKE = dict(hidden_size=256, intermediate_size=896, num_attention_heads=4, num_key_value_heads=2)


def layer_tensors(shape: dict) -> dict[str, list[int]]:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    return {"input_layernorm.weight": [h], "post_attention_layernorm.weight": [h],
            "self_attn.q_proj.weight": [h, h], "self_attn.k_proj.weight": [kv, h],
            "self_attn.v_proj.weight": [kv, h], "self_attn.o_proj.weight": [h, h],
            "mlp.gate_proj.weight": [i, h], "mlp.up_proj.weight": [i, h], "mlp.down_proj.weight": [h, i]}


def layer_count(shape: dict, out: Path, want: int) -> int:
    """As many layers as asked, 80% of the free disk and 50% of available RAM allow."""
    per = sum(math.prod(s) for s in layer_tensors(shape).values()) * 2
    disk = shutil.disk_usage(out.parent if not out.exists() else out).free
    return max(1, min(want, int(0.8 * disk) // per, int(0.5 * psutil.virtual_memory().available) // per))


def write_checkpoint(out: Path, shape: dict, layers: int, device: torch.device) -> Path:
    from safetensors.torch import save_file

    cfg = json.loads((DEMO / "target" / "config.json").read_text())
    cfg.update(shape, num_hidden_layers=layers, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
               tie_word_embeddings=False, max_position_embeddings=8192, dtype="bfloat16")
    if (out / "config.json").exists() and json.loads((out / "config.json").read_text()) == cfg:
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(dims):
        return (torch.randn(dims, generator=gen, device=device, dtype=torch.bfloat16) * 0.02).cpu()

    h, v = shape["hidden_size"], cfg["vocab_size"]
    weight_map = {}
    save_file({"model.embed_tokens.weight": rand([v, h]), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": rand([v, h])}, out / "globals.safetensors")
    weight_map.update(dict.fromkeys(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
                                    "globals.safetensors"))
    for i in range(layers):
        tensors = {f"model.layers.{i}.{n}": (torch.ones(d, dtype=torch.bfloat16) if "norm" in n else rand(d))
                   for n, d in layer_tensors(shape).items()}
        save_file(tensors, out / f"layer-{i:03d}.safetensors")
        weight_map.update(dict.fromkeys(tensors, f"layer-{i:03d}.safetensors"))
        print(f"wrote layer {i + 1}/{layers}", file=sys.stderr)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO / "target" / f, out / f)
    (out / "config.json").write_text(json.dumps(cfg))   # last: a matching config marks a complete write
    return out


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

    from offload.storage import IO_ALIGN, DirectReader, Span, aligned_empty

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


def decode_rows(target: str, draft: str, device: torch.device, budget: int, new_tokens: int,
                max_gpu: int | None, self_bits: list[int]) -> list[dict]:
    from dataclasses import replace

    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import DecodeState, GenerationConfig, generate
    from specexec_cli.session.loading import LoadOptions, encode_prompt, load_models
    from specexec_cli.session.planning import make_plan

    shape = TreeShape(budget=budget, max_depth=32)
    cuda = device.type == "cuda"   # CPU smoke: every layer from disk, so that something streams there too
    opts = LoadOptions(target=target, draft=draft, dtype="bf16", device=device.type, offload="auto" if cuda else "disk",
                       ctx=2048, max_gpu_memory=max_gpu if cuda else None, max_ram=None if cuda else 0)
    plan = make_plan(opts, shape, budget_auto=False)
    if not plan.fits:
        raise SystemExit(f"bench/gpu.py: {plan.reason}")
    if device.type == "cuda" and not (plan.ram_layers or plan.disk_layers):
        print("bench/gpu.py: note: every layer fits under --max-gpu-memory; the decode rows do not stream",
              file=sys.stderr)
    models = load_models(replace(opts, plan=plan))
    ids = encode_prompt(models.tokenizer, "def fibonacci(n):\n", False)
    runs = [("ar", "none", models), ("specexec", Path(draft).name, models)]
    runs += [("specexec", f"self-{b}bit", replace(models, draft=self_draft(models.target, opts, b))) for b in self_bits]
    rows = []
    for method, name, pair in runs:   # one target, one streaming plan: only the draft changes
        cfg = GenerationConfig(method=method, shape=shape, max_new_tokens=new_tokens)
        last = list(generate(pair, DecodeState(), ids, cfg))[-1]   # pass 0 is the prefill (first token)
        rows.append(dict(method=method, draft=name, tokens=last.new_tokens, decode_seconds=last.decode_seconds,
                         tps=last.tps, target_passes=last.pass_index,
                         tokens_per_pass=round((last.new_tokens - 1) / max(1, last.pass_index), 3)))
    return rows


def self_draft(target, opts, bits: int):
    """`--draft self --draft-bits bits` built on the ALREADY LOADED target (its streamed layers get
    substitutes), so the self-draft rows run on the same streaming plan as the shared draft's."""
    from dataclasses import replace
    from types import SimpleNamespace

    from specexec_cli.session.loading import load_self_draft

    draft = load_self_draft(target, replace(opts, draft_bits=bits), SimpleNamespace(by_component={}))
    if draft is None:
        raise SystemExit("bench/gpu.py: every target layer is resident; nothing to substitute for --self-bits")
    return draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_gpu.json"))
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/specx-bench-70b-layers"))
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--target", help="real target for the ar/specexec rows (default: the synthetic one)")
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--max-gpu-memory", default="24GB",
                    help="cap for the decode rows' plan, so that layers stream even on a large card")
    ap.add_argument("--tier", choices=["auto", "ram", "disk"], default="auto",
                    help="where the streamed layers live for the pass rows (auto: RAM when they fit 70%% of it)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, runs on CPU")
    ap.add_argument("--self-bits", default="4,3,2",
                    help="also decode with --draft self at these substitute widths ('' for none; 3, 2 need HQQ)")
    args = ap.parse_args()
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)   # its optional-CPU-kernel notice
    if not torch.cuda.is_available() and not args.smoke:
        print("bench/gpu.py: no CUDA device here; run it on a GPU machine, or pass --smoke for a tiny CPU run",
              file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shape = SHAPE_SMOKE if args.smoke else SHAPE_70B
    ckpt = args.ckpt.with_name(args.ckpt.name + "-smoke") if args.smoke else args.ckpt
    layers = min(args.layers, 4) if args.smoke else layer_count(shape, ckpt, args.layers)
    write_checkpoint(ckpt, shape, layers, device)
    gbps = link_gbps(device)
    tokens = [int(t) for t in args.tokens.split(",")]
    passes, placement, tier = pass_rows(ckpt, device, tokens, args.repeats, gbps, args.tier)
    from offload import parse_size

    cap = parse_size(args.max_gpu_memory)
    bits = [int(b) for b in args.self_bits.split(",") if b.strip()]
    decode = decode_rows(args.target or str(ckpt), args.draft, device, args.budget, args.max_new_tokens, cap, bits)
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", layers=layers,
                  shape=shape, placement=placement, passes=passes, decode=decode,
                  synthetic_target=args.target is None, estimator="median", max_gpu_memory=cap, **tier)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['device']} · {layers} layers · link {gbps:.1f} GB/s · {placement}")
    print(f"{'tokens':>7} {'pass ms':>9} {'floor ms':>9} {'ratio':>6}   (median of {args.repeats}; floor at "
          f"{tier['floor_gbps']:.2f} GB/s, the {tier['tier']} tier's slowest link)")
    for r in passes:
        print(f"{r['tokens']:>7} {1000 * r['pass_seconds']:>9.1f} {1000 * r['floor_seconds']:>9.1f} {r['ratio']:>6.2f}")
    print("  ".join(f"{r['method']}/{r['draft']}: {r['tps']:.2f} tok/s, {r['tokens_per_pass']} tok/pass" for r in decode)
          + ("  (random target: specexec overhead, not speedup)" if args.target is None else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
