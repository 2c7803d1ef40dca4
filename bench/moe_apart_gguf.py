"""A mixture-of-experts GGUF's routed experts read on demand against whole-layer streaming: bytes and ms per pass.

Usage: `flock -x /tmp/bench.lock python bench/moe_apart_gguf.py [--out bench/results/moe_apart_gguf.json]
[--dir DIR] [--outtype q8_0|q4_k_m] [--experts 24 --top-k 2 --layers 4 --hidden 512 --inter 384]
[--tokens 1,8,32] [--rounds 5] [--batch 4]`.

A seeded Qwen3-MoE (bench/moe_apart.py's shape and seed: default 4 layers of 24 experts, top-2, hidden 512,
expert intermediate 384) with tests/test_gguf_moe.py's byte-level vocabulary is written to GGUF by llama.cpp's
converter (`--outtype q8_0`; `q4_k_m`: its F16 file requantized by llama-quantize, experts in Q4_K/Q6_K where
their rows are 256-wide multiples, else llama-quantize's fallback type) under `--dir` (the disk, not tmpfs), once
per shape, and loaded twice with every layer on disk on the CPU: experts held apart (`experts="auto"`, no plan:
each disk layer streams its attention+router part and the routed experts' rows of the fused `ffn_*_exps`
tensors are read when routed, into a cache of one layer's experts, and computed from their quantized bytes by
the GGUF kernel) and whole layers (`experts="layers"`). Each round runs, for each pass size, `--batch` passes
of each model on the same fresh random ids (no KV cache), the two interleaved, all but each model's first pass
timed, 0.5 s apart (bench/moe_apart.py's schedule). Per pass: ms (perf_counter) and bytes read
(`stats.streamed_bytes_per_pass`); each pass's greedy id must agree between the two. Reported: medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload import OffloadedCausalLM  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
from docblock import md_table  # noqa: E402  (bench/docblock.py)
from moe_apart import checkpoint, interleaved  # noqa: E402  (the seeded safetensors Qwen3-MoE, the timed rounds)


def gguf_checkpoint(args) -> Path:
    """bench/moe_apart.py's seeded Qwen3-MoE as a GGUF of `--outtype` (a directory holding it), written once."""
    from tests.test_gguf_moe import byte_level_tokenizer, convert

    src = checkpoint(args, "qwen3_moe")
    out = src.with_name(f"{src.name}_gguf_{args.outtype}")
    if (out / "model.gguf").exists():
        return out
    staged = src.with_name(src.name + "_gguf_src")  # the checkpoint's files and a vocabulary for the converter
    staged.mkdir(exist_ok=True)
    for f in src.iterdir():
        if not (staged / f.name).exists():
            (staged / f.name).symlink_to(f)
    byte_level_tokenizer().save_pretrained(staged)
    out.mkdir(exist_ok=True)
    convert(staged, out / "model.gguf", args.outtype)
    for f in out.glob("*-f16.gguf"):
        f.unlink()  # q4_k_m's intermediate F16 file
    return out


def measure(args) -> dict:
    path = gguf_checkpoint(args)
    models = {
        mode: OffloadedCausalLM.from_pretrained(path, offload="disk", experts=mode) for mode in ("auto", "layers")
    }
    assert models["auto"].experts is not None and models["layers"].experts is None
    samples = interleaved(models, args)
    cells = []
    for n in args.tokens:
        row = dict(tokens=n)
        for mode, key in (("auto", "apart"), ("layers", "layers")):
            ms, nbytes, whole = zip(*samples[(mode, n)])
            row[f"{key}_ms"], row[f"{key}_mb"] = statistics.median(ms), statistics.median(nbytes) / 1e6
            row[f"{key}_whole"] = statistics.median(whole)  # layers whose experts a pass read whole, ahead
        cells.append(row)
        print(json.dumps(row), flush=True)
    store = models["auto"].experts
    expert = next(iter(store.experts.values()))
    out = dict(
        file_mb=(path / "model.gguf").stat().st_size / 1e6,
        expert_mb=sum(s.nbytes for s in expert.raw.slices.values()) / 1e6,  # one expert's stored bytes
        cache_experts=store.capacity,
        direct_io=models["auto"].plan.direct_io,
        cells=cells,
    )
    for m in models.values():
        m.close()
    return out


def block(r: dict) -> str:
    rows = [
        [
            c["tokens"],
            f"{c['layers_mb']:.1f}",
            f"{c['apart_mb']:.1f}",
            f"{c['apart_mb'] / c['layers_mb']:.2f}",
            f"{c['layers_ms']:.0f}",
            f"{c['apart_ms']:.0f}",
            f"{c['layers_ms'] / c['apart_ms']:.2f}x",
        ]
        for c in r["cells"]
    ]
    head = ["tokens per pass", "MB read: whole layers", "experts apart", "ratio", "ms: whole layers", "experts apart"]
    return (
        f"`{r['command']}` ({r['threads']} threads, load average {r['load_average'][0]}): a seeded Qwen3-MoE GGUF "
        f"({r['outtype']}, {r['layers']} layers x {r['experts']} experts of {r['expert_mb']:.2f} MB, top-{r['top_k']}, "
        f"{r['file_mb']:.0f} MB), every layer on disk ({'O_DIRECT' if r['direct_io'] else 'buffered reads'}), experts "
        f"apart (a cache of {r['cache_experts']}) against whole layers, interleaved, medians of {r['rounds']} rounds x "
        f"{r['batch'] - 1} passes:\n\n" + md_table(head + ["speed-up"], rows)
    )


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "moe_apart_gguf.json")
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "specx-bench")
    ap.add_argument("--outtype", choices=("q8_0", "q4_k_m"), default="q8_0")
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=384)
    ap.add_argument("--tokens", type=ints, default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4, help="back-to-back passes per model, the first untimed")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    r = measure(args)
    r.update(
        command="python bench/moe_apart_gguf.py " + " ".join(sys.argv[1:]),
        machine=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        load_average=[round(x, 2) for x in os.getloadavg()],
        outtype=args.outtype,
        **{k: getattr(args, k) for k in ("experts", "top_k", "layers", "hidden", "inter", "rounds", "batch")},
    )
    args.out.write_text(json.dumps(r, indent=1) + "\n")
    print(block(r))


if __name__ == "__main__":
    main()
