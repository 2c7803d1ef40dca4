"""Benchmark: disk-tier (O_DIRECT) pass time vs the link floor.  Run by hand, not in tests.

Contract: for each model (the shared target at ../shared/models/target if present, and a random
Llama generated on the fly in a temp dir, `--layers` x `--hidden`, bf16), load it with
offload="disk", max_host_memory=0, max_device_memory=0 (every layer streams from disk each
pass), measure O_DIRECT read bandwidth of the same safetensors files in the same run, and time
passes of n tokens (n in --tokens). floor = streamed bytes per pass / measured bandwidth;
ratio = median pass time / floor (target <= 1.10 for n <= 64). compute = the same passes with
every layer in RAM (no I/O), so pass/max = pass / max(floor, compute) shows the overlap even
where the CPU, not the link, is the bottleneck. Writes JSON (--out) and prints a table.

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

from offload import OffloadedCausalLM  # noqa: E402
from offload.st_index import SafetensorsIndex  # noqa: E402
from offload.storage import IO_ALIGN, READ_CHUNK, DirectReader, Span, aligned_empty, align_up  # noqa: E402

SHARED_TARGET = Path(__file__).resolve().parents[2] / "shared" / "models" / "target"


def make_random_llama(root: Path, layers: int, hidden: int, dtype: torch.dtype, vocab: int = 8192) -> Path:
    """Write config.json + one safetensors shard per layer (random, small std, in `dtype`)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    inter = int(hidden * 2.6875) // 256 * 256
    heads = max(1, hidden // 128)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                      tie_word_embeddings=True, max_position_embeddings=4096, dtype=str(dtype).split(".")[1])
    cfg.save_pretrained(root)
    shapes = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
              "self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (hidden, hidden),
              "self_attn.v_proj.weight": (hidden, hidden), "self_attn.o_proj.weight": (hidden, hidden),
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter)}
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


def odirect_bandwidth(model_dir: Path, runs: int = 2) -> float:
    """Best bytes/s over `runs` full O_DIRECT reads of every safetensors file (64 MiB requests).

    Best-of-runs because a VM's virtual disk may be cached on the host side: passes (which
    re-read the same files) would otherwise beat a cold single-read "floor"."""
    return max(_read_all(model_dir) for _ in range(runs))


def _read_all(model_dir: Path) -> float:
    files = SafetensorsIndex(model_dir).files
    reader, buf, total = DirectReader(), aligned_empty(READ_CHUNK), 0
    t0 = time.perf_counter()
    for f in files:
        size = f.stat().st_size
        for off in range(0, size, READ_CHUNK):
            n = min(READ_CHUNK, size - off)
            reader.read_span(Span(f, off, align_up(n, IO_ALIGN), n, 0), buf)
            total += n
    dt = time.perf_counter() - t0
    reader.close()
    return total / dt


def time_passes(model: OffloadedCausalLM, n: int, repeats: int) -> list[float]:
    ids = torch.randint(0, model.config.vocab_size, (1, n))
    for _ in range(2):     # warm-up (kernels, allocator, thread pools); also primes the next pass's prefetch
        model(input_ids=ids)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=ids)
        times.append(time.perf_counter() - t0)
    return times


def compute_only(model_dir: Path, dtype: torch.dtype, tokens: list[int], repeats: int) -> dict[int, float]:
    """Median pass time with every layer in host RAM arenas (no I/O at all on CPU)."""
    model = OffloadedCausalLM.from_pretrained(model_dir, dtype=dtype, offload="ram", max_device_memory=0)
    try:
        return {n: statistics.median(time_passes(model, n, repeats)) for n in tokens}
    finally:
        model.close()


def bench_model(name: str, model_dir: Path, tokens: list[int], repeats: int, slots: int,
                dtype: torch.dtype) -> list[dict]:
    bw = odirect_bandwidth(model_dir)
    compute = compute_only(model_dir, dtype, tokens, repeats)
    model = OffloadedCausalLM.from_pretrained(model_dir, dtype=dtype, offload="disk",
                                              max_host_memory=0, max_device_memory=0, slots=slots)
    print(model.plan.describe())
    rows = []
    try:
        for n in tokens:
            times = time_passes(model, n, repeats)
            per_pass = model.stats.streamed_bytes_per_pass
            floor = per_pass / bw
            med = statistics.median(times)
            rows.append(dict(model=name, tokens=n, pass_s=med, passes_s=times, floor_s=floor,
                             ratio=med / floor, compute_s=compute[n], ratio_vs_max=med / max(floor, compute[n]),
                             streamed_bytes_per_pass=per_pass, odirect_bw=bw, dtype=str(dtype),
                             direct_io=model.plan.direct_io, slots=slots))
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
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="file and compute dtype of the random model (CPU bf16 matmuls are very slow)")
    ap.add_argument("--tmpdir", default=None, help="where to write the random model (a real disk, not tmpfs)")
    ap.add_argument("--skip-random", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    tokens = [int(t) for t in args.tokens.split(",")]
    dtype = getattr(torch, args.dtype)
    rows = []
    if SHARED_TARGET.exists():
        rows += bench_model("shared-target", SHARED_TARGET, tokens, args.repeats, args.slots, dtype)
    else:
        print(f"skipping shared target: {SHARED_TARGET} not found")
    if not args.skip_random:
        with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
            t0 = time.perf_counter()
            make_random_llama(Path(tmp), args.layers, args.hidden, dtype)
            print(f"random llama {args.layers}x{args.hidden} written in {time.perf_counter() - t0:.1f}s")
            rows += bench_model(f"random-{args.layers}x{args.hidden}", Path(tmp), tokens, args.repeats,
                                args.slots, dtype)
    print(f"{'model':<20}{'n':>5}{'MB/pass':>9}{'O_DIRECT GB/s':>14}{'floor s':>9}{'compute s':>10}"
          f"{'pass s':>8}{'pass/floor':>11}{'pass/max':>9}")
    for r in rows:
        print(f"{r['model']:<20}{r['tokens']:>5}{r['streamed_bytes_per_pass'] / 1e6:>9.1f}"
              f"{r['odirect_bw'] / 1e9:>14.2f}{r['floor_s']:>9.3f}{r['compute_s']:>10.3f}{r['pass_s']:>8.3f}"
              f"{r['ratio']:>11.2f}{r['ratio_vs_max']:>9.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
