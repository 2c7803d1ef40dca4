"""Benchmark: disk-tier (O_DIRECT) pass time vs the link floor.  Run by hand, not in tests.

Contract: for each model (the shared target at ../shared/models/target if present, and a random
Llama generated on the fly in a temp dir, `--layers` x `--hidden`, bf16), load it with
offload="disk", max_host_memory=0, max_device_memory=0 (every layer streams from disk each
pass), measure O_DIRECT read bandwidth of the same safetensors files in the same run for every
reader configuration (queue depth x request size, --depths x --chunks), keep the best one, give
it to the model's reader, and time passes of n tokens (n in --tokens).
floor = streamed bytes per pass / best measured bandwidth; ratio = median pass / floor (target
<= 1.10 for n <= 64). compute = the same passes with every layer in RAM (no I/O), so
pass/max = pass / max(floor, compute) shows the overlap even where the CPU, not the link, is the
bottleneck. Also per row: kernel-counted read bytes per pass (/proc/self/io, measured with the
read-ahead ring equally full at both ends of the window) / layer bytes, the link-busy fraction
and the stall seconds of the timed passes. Writes JSON (--out) and prints a table.

    python bench/offload.py --layers 8 --hidden 4096 --out bench_offload.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload import OffloadedCausalLM
from offload.formats.st_index import SafetensorsIndex
from offload.stream.storage import IO_ALIGN, DirectReader, Span, align_up, aligned_empty

READ_SPAN = 256 * 1024 * 1024  # bytes per read_span call while measuring (a large layer's size)

SHARED_TARGET = Path(__file__).resolve().parents[2] / "shared" / "models" / "target"


def make_random_llama(root: Path, layers: int, hidden: int, dtype: torch.dtype, vocab: int = 8192) -> Path:
    """Write config.json + one safetensors shard per layer (random, small std, in `dtype`)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    inter = int(hidden * 2.6875) // 256 * 256
    heads = max(1, hidden // 128)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        dtype=str(dtype).split(".")[1],
    )
    cfg.save_pretrained(root)
    shapes = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (hidden, hidden),
        "self_attn.v_proj.weight": (hidden, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    weight_map = {}

    def rand(shape):
        return (torch.randn(shape) * 0.02).to(dtype) if len(shape) > 1 else torch.ones(shape, dtype=dtype)

    for i in range(layers + 1):
        fname = f"model-{i:05d}.safetensors"
        if i < layers:
            tensors = {f"model.layers.{i}.{k}": rand(s) for k, s in shapes.items()}
        else:
            tensors = {"model.embed_tokens.weight": rand((vocab, hidden)), "model.norm.weight": rand((hidden,))}
        save_file(tensors, root / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def odirect_bandwidth(model_dir: Path, depths: list[int], chunks: list[int], budget: int) -> dict:
    """bytes/s of O_DIRECT reads of the model's files for each (queue depth, request size).

    Each config reads the same first `budget` bytes (files in order), twice; best of the two,
    because a VM's virtual disk may be cached on the host side: passes (which re-read the same
    files) would otherwise beat a cold single-read "floor"."""
    out = {}
    for depth in depths:
        for chunk in chunks:
            out[(depth, chunk)] = max(_read_all(model_dir, depth, chunk, budget) for _ in range(2))
    return out


def _read_all(model_dir: Path, depth: int, chunk: int, budget: int) -> float:
    files = SafetensorsIndex(model_dir).files
    reader = DirectReader(depth=depth, chunk=chunk)
    buf, total = aligned_empty(READ_SPAN), 0
    t0 = time.perf_counter()
    for f in files:
        size = f.stat().st_size
        for off in range(0, size, READ_SPAN):
            if total >= budget:
                break
            n = min(READ_SPAN, size - off)
            reader.read_span(Span(f, off, align_up(n, IO_ALIGN), n, 0), buf)
            total += n
    dt = time.perf_counter() - t0
    reader.close()
    return total / dt


def file_layer_bytes(model: OffloadedCausalLM) -> int:
    """Bytes of the streamed layers' tensors as stored in the files: what a pass must read."""
    return sum(sl.nbytes for d in model.store.disk.values() for sl in d.raw.slices.values())


def kernel_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes"):
                return int(line.split()[1])
    return 0


def time_passes(model: OffloadedCausalLM, n: int, repeats: int) -> tuple[list[float], dict]:
    """Pass times, plus kernel read bytes / link busy / stall over the timed passes."""
    ids = torch.randint(0, model.config.vocab_size, (1, n))
    for _ in range(2):  # warm-up (kernels, allocator, thread pools); also primes the next pass's prefetch
        model(input_ids=ids)
    pf = model.prefetcher
    pf.wait_idle()
    b0, busy0, stall0, w0 = kernel_read_bytes(), model.link_busy_seconds(), pf.stall_seconds, time.perf_counter()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=ids)
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - w0
    busy = model.link_busy_seconds() - busy0
    pf.wait_idle()  # the ring is as full as at the start: the window holds `repeats` passes of reads
    extra = dict(
        kernel_bytes_per_pass=(kernel_read_bytes() - b0) / repeats,
        link_busy_fraction=busy / wall,
        stall_s_per_pass=(pf.stall_seconds - stall0) / repeats,
    )
    return times, extra


def compute_only(model_dir: Path, dtype: torch.dtype, tokens: list[int], repeats: int) -> dict[int, float]:
    """Median pass time with every layer in host RAM arenas (no I/O at all on CPU)."""
    model = OffloadedCausalLM.from_pretrained(model_dir, dtype=dtype, offload="ram", max_device_memory=0)
    try:
        return {n: statistics.median(time_passes(model, n, repeats)[0]) for n in tokens}
    finally:
        model.close()


def bench_model(
    name: str,
    model_dir: Path,
    tokens: list[int],
    repeats: int,
    slots: int,
    dtype: torch.dtype,
    depths: list[int],
    chunks: list[int],
    probe_bytes: int,
) -> list[dict]:
    bws = odirect_bandwidth(model_dir, depths, chunks, probe_bytes)
    (depth, chunk), bw = max(bws.items(), key=lambda kv: kv[1])
    for (d, c), b in sorted(bws.items()):
        print(
            f"  O_DIRECT depth {d} x {c >> 20} MiB: {b / 1e9:.2f} GB/s{'  <- best' if (d, c) == (depth, chunk) else ''}"
        )
    compute = compute_only(model_dir, dtype, tokens, repeats)
    model = OffloadedCausalLM.from_pretrained(
        model_dir, dtype=dtype, offload="disk", max_host_memory=0, max_device_memory=0, slots=slots
    )
    model.store.reader.depth, model.store.reader.chunk = depth, chunk
    print(model.plan.describe(), f"read-ahead ring {model.store.host_slots} layers")
    layer_bytes = file_layer_bytes(model)
    rows = []
    try:
        for n in tokens:
            times, extra = time_passes(model, n, repeats)
            per_pass = model.stats.streamed_bytes_per_pass
            floor = per_pass / bw
            med = statistics.median(times)
            rows.append(
                dict(
                    model=name,
                    tokens=n,
                    pass_s=med,
                    passes_s=times,
                    floor_s=floor,
                    ratio=med / floor,
                    compute_s=compute[n],
                    ratio_vs_max=med / max(floor, compute[n]),
                    streamed_bytes_per_pass=per_pass,
                    layer_bytes_per_pass=layer_bytes,
                    kernel_over_layer=extra["kernel_bytes_per_pass"] / layer_bytes,
                    **extra,
                    odirect_bw=bw,
                    reader_depth=depth,
                    reader_chunk=chunk,
                    bandwidths={f"{d}x{c}": b for (d, c), b in bws.items()},
                    dtype=str(dtype),
                    direct_io=model.plan.direct_io,
                    slots=slots,
                    host_slots=model.store.host_slots,
                )
            )
    finally:
        model.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="file and compute dtype of the random model (CPU bf16 matmuls are very slow)",
    )
    ap.add_argument("--tmpdir", default=None, help="where to write the random model (a real disk, not tmpfs)")
    ap.add_argument("--skip-random", action="store_true")
    ap.add_argument("--depths", default="1,2,4", help="reader queue depths to measure")
    ap.add_argument("--chunks", default="4,16,64", help="reader request sizes to measure, MiB")
    ap.add_argument("--probe-mb", type=int, default=768, help="bytes read per reader configuration, MB")
    ap.add_argument("--target", default=str(SHARED_TARGET), help="model dir benchmarked before the random one")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    tokens = [int(t) for t in args.tokens.split(",")]
    dtype = getattr(torch, args.dtype)
    rows = []
    reader = dict(
        depths=[int(x) for x in args.depths.split(",")],
        chunks=[int(x) << 20 for x in args.chunks.split(",")],
        probe_bytes=args.probe_mb * 10**6,
    )
    target = Path(args.target)
    if target.exists():
        rows += bench_model(target.name, target, tokens, args.repeats, args.slots, dtype, **reader)
    else:
        print(f"skipping {target}: not found")
    if not args.skip_random:
        with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
            t0 = time.perf_counter()
            make_random_llama(Path(tmp), args.layers, args.hidden, dtype)
            print(f"random llama {args.layers}x{args.hidden} written in {time.perf_counter() - t0:.1f}s")
            rows += bench_model(
                f"random-{args.layers}x{args.hidden}", Path(tmp), tokens, args.repeats, args.slots, dtype, **reader
            )
    print(
        "| model | n | MB/pass | kernel/layer bytes | best GB/s | floor s | compute s | pass s "
        "| pass/floor | pass/max | link busy | stall s/pass |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['model']} | {r['tokens']} | {r['streamed_bytes_per_pass'] / 1e6:.1f} | {r['kernel_over_layer']:.4f} "
            f"| {r['odirect_bw'] / 1e9:.2f} | {r['floor_s']:.3f} | {r['compute_s']:.3f} | {r['pass_s']:.3f} "
            f"| {r['ratio']:.2f} | {r['ratio_vs_max']:.2f} | {r['link_busy_fraction']:.2f} | {r['stall_s_per_pass']:.3f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
