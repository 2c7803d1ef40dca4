"""What the "split" expert placement costs on this CPU beside the modes it stands in for: ms per pass, interleaved.

Usage: `flock -x /tmp/bench.lock python bench/moe_split.py [--dir DIR] [--tokens 1,8,32,256] [--rounds 5]
[--batch 4] [--out FILE.json]`.

bench/moe_apart.py's seeded Qwen3-MoE (4 layers of 24 experts of 2.4 MB, top-2, fp32, saved into `--dir`, on the
disk, written once: moe_apart's default) is loaded five times on the CPU (offload/stream/splitexperts.py's code path is the one a CUDA card runs; on
a CPU the device and the CPU tier are the same memory and the moves do nothing): every layer resident
(`offload="none"`, `experts="layers"`) beside `experts="split"` with every expert in RAM (`expert_cache=0`:
llama.cpp --cpu-moe's placement), and every layer on disk with its routed experts read on demand
(`offload="disk"`, `experts="on-demand"`) beside `experts="split"` with every expert on disk (`max_host_memory=0`:
the dense parts resident, the routed experts read when routed into a cache of one layer's experts); both split
loads compute their RAM/disk experts on the CPU at every size (a plan-shaped `memplan` whose stream_from is
None). A fifth, split-stream, is split-ram streaming every pass (stream_from 1): each routed expert is copied into
the staging area and computed from there, which on a CPU device is a memcpy into RAM and the same CPU compute,
so split-stream / split-ram is the copy's cost here (on a card it is the PCIe copy against the CPU's compute,
which this machine cannot measure). Passes as
moe_apart.interleaved runs them (no KV cache, fresh random ids each round, the models interleaved with a pause
between, each model's first pass of a batch untimed; every pass's greedy id must agree across all five). Printed:
the median ms and MB read per pass, and the ratios split-RAM / resident, split-disk / on-demand and split-stream /
split-ram. Nothing is
modelled here and no page carries these figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package

import moe_apart  # noqa: E402  (bench/moe_apart.py: the checkpoint and the interleaved passes)


def measure(args) -> dict:
    """{tokens: {mode: (median ms, median MB read)}} of the four loads (see the module docstring)."""
    from offload import OffloadedCausalLM

    path, load = moe_apart.checkpoint(args), OffloadedCausalLM.from_pretrained

    def plan(stream_from):  # the loader reads plan.experts["stream_from"] (per layer) and plan.embeddings
        return SimpleNamespace(
            experts={"mode": "split", "stream_from": [stream_from] * args.layers}, embeddings="device"
        )

    models = {
        "resident": load(path, offload="none", experts="layers"),
        "split-ram": load(path, experts="split", expert_cache=0, memplan=plan(None)),
        "on-demand": load(path, offload="disk", experts="on-demand"),
        "split-disk": load(path, experts="split", expert_cache=0, max_host_memory=0, memplan=plan(None)),
        "split-stream": load(path, experts="split", expert_cache=0, memplan=plan(1)),
    }
    try:
        assert not any(models["split-ram"].split.disk.values()) and models["split-disk"].experts is not None
        samples = moe_apart.interleaved(models, args)
        copies = {mode: m.split.staging.copies for mode, m in models.items() if m.split is not None}
        assert copies["split-stream"] > 0 and copies["split-ram"] == copies["split-disk"] == 0, copies
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
    ap.add_argument("--tokens", default="1,8,32,256")
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
        stream = row["split-stream"][0] / row["split-ram"][0]
        print(
            f"{n:>3} tokens: {cells}  split-ram/resident {ram:.2f}x  split-disk/on-demand {disk:.2f}x  "
            f"split-stream/split-ram {stream:.2f}x"
        )
    if args.out:
        args.out.write_text(json.dumps({str(n): row for n, row in result.items()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
