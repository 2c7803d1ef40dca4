"""What the "split" expert placement costs on this CPU beside the modes it stands in for: ms per pass, interleaved.

Usage: `flock -x /tmp/bench.lock python bench/moe_split.py [--dir DIR] [--tokens 1,8,32] [--rounds 5] [--batch 4]
[--out FILE.json]`.

bench/moe_apart.py's seeded Qwen3-MoE (4 layers of 24 experts of 2.4 MB, top-2, fp32, saved into `--dir`, on the
disk, written once: moe_apart's default) is loaded four times on the CPU (offload/stream/splitexperts.py's code path is the one a CUDA card runs; on
a CPU the device and the CPU tier are the same memory and the moves do nothing): every layer resident
(`offload="none"`, `experts="layers"`) beside `experts="split"` with every expert in RAM (`expert_cache=0`:
llama.cpp --cpu-moe's placement), and every layer on disk with its routed experts read on demand
(`offload="disk"`, `experts="on-demand"`) beside `experts="split"` with every expert on disk (`max_host_memory=0`:
the dense parts resident, the routed experts read when routed into a cache of one layer's experts). Passes as
moe_apart.interleaved runs them (no KV cache, fresh random ids each round, the models interleaved with a pause
between, each model's first pass of a batch untimed; every pass's greedy id must agree across the four). Printed:
the median ms and MB read per pass, and the ratios split-RAM / resident and split-disk / on-demand. Nothing is
modelled here and no page carries these figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package

import moe_apart  # noqa: E402  (bench/moe_apart.py: the checkpoint and the interleaved passes)


def measure(args) -> dict:
    """{tokens: {mode: (median ms, median MB read)}} of the four loads (see the module docstring)."""
    from offload import OffloadedCausalLM

    path, load = moe_apart.checkpoint(args), OffloadedCausalLM.from_pretrained
    models = {
        "resident": load(path, offload="none", experts="layers"),
        "split-ram": load(path, experts="split", expert_cache=0),
        "on-demand": load(path, offload="disk", experts="on-demand"),
        "split-disk": load(path, experts="split", expert_cache=0, max_host_memory=0),
    }
    try:
        assert not any(models["split-ram"].split.disk.values()) and models["split-disk"].experts is not None
        samples = moe_apart.interleaved(models, args)
    finally:
        for m in models.values():
            m.close()
    return {
        n: {
            mode: (
                statistics.median(s[0] for s in samples[(mode, n)]),  # (ms, bytes read, ...)
                statistics.median(s[1] for s in samples[(mode, n)]) / 1e6,
            )
            for mode in models
        }
        for n in args.tokens
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "specx-bench", help="the checkpoint's home")
    ap.add_argument("--tokens", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="also write the medians as JSON")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.experts, args.top_k, args.layers, args.hidden, args.inter = 24, 2, 4, 512, 384
    result = measure(args)
    for n, row in result.items():
        cells = "  ".join(f"{mode} {ms:.1f} ms ({mb:.1f} MB)" for mode, (ms, mb) in row.items())
        ram = row["split-ram"][0] / row["resident"][0]
        disk = row["split-disk"][0] / row["on-demand"][0]
        print(f"{n:>3} tokens: {cells}  split-ram/resident {ram:.2f}x  split-disk/on-demand {disk:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({str(n): row for n, row in result.items()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
