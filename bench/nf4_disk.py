"""Disk tier, nf4 (warm 4-bit cache) vs bf16: kernel-counted bytes read and wall time per pass.

Usage (CPU-heavy: run under the shared lock):
    python bench/nf4_disk.py --target /tmp/target-xl --out nf4_disk.json

Both models stream every decoder layer from disk (O_DIRECT) with the same ring (2 device slots,
2 host slots, so reads happen inside the pass, not all ahead of it). For each `--tokens` size,
passes alternate bf16, nf4, bf16, nf4, ... on the same input (1 token: plain decoding; 32: a
verified tree).
Per pass: wall time of the forward, and the growth of /proc/self/io `read_bytes` (bytes the
kernel fetched from storage for this process) from the pass's start until that model's
read-ahead for its next pass has finished: in steady state exactly one pass worth of layers.
The nf4 cache is built (timed) if it is cold, then checked warm (a second lookup must not rebuild).
Prints a table and writes JSON with the ratios the issue asks for (nf4/bf16 bytes vs the bf16
layer bytes in the checkpoint; nf4/bf16 median pass time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload import OffloadedCausalLM
from offload.formats.st_index import SafetensorsIndex
from offload.quant.nf4 import packing_for
from offload.quant.quant_cache import cache_dir, cache_key, ensure_nf4_cache, is_complete


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def layer_bytes(path: Path) -> int:
    """Bytes of every decoder-layer tensor in the checkpoint (the bf16 layers)."""
    index = SafetensorsIndex(path)
    return sum(e.nbytes for n, e in index.entries.items() if n.startswith("model.layers."))


def one_pass(model, ids) -> tuple[float, int]:
    r0, t0 = read_bytes(), time.perf_counter()
    model(input_ids=ids)
    seconds = time.perf_counter() - t0
    model.prefetcher.wait_idle()  # this model's read-ahead for its next pass, inside its window
    return seconds, read_bytes() - r0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("/tmp/target-xl"))
    ap.add_argument("--passes", type=int, default=3, help="measured passes per model (after 2 warm-ups)")
    ap.add_argument("--tokens", default="1,32", help="tokens per pass, comma-separated (each measured separately)")
    ap.add_argument("--out", type=Path, default=Path("nf4_disk.json"))
    args = ap.parse_args()

    torch.manual_seed(0)
    packing = packing_for("cpu")  # the cache OffloadedCausalLM uses for dtype="nf4" on this CPU
    built = not is_complete(cache_dir(args.target, packing), cache_key(args.target, packing))
    t0 = time.perf_counter()
    cache = ensure_nf4_cache(
        args.target, progress=lambda d, t, w: print(f"  {w} ({d}/{t})", file=sys.stderr), packing=packing
    )
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert ensure_nf4_cache(args.target, packing=packing) == cache
    warm_lookup_s = time.perf_counter() - t0

    ring = dict(offload="disk", slots=2, host_slots=2)
    models = {
        "bf16": OffloadedCausalLM.from_pretrained(args.target, dtype=torch.bfloat16, **ring),
        "nf4": OffloadedCausalLM.from_pretrained(args.target, dtype="nf4", **ring),
    }
    assert all(not d.convert for d in models["nf4"].store.disk.values()), "an nf4 disk layer converts"
    bf16_layers = layer_bytes(args.target)
    rec = {
        "target": str(args.target),
        "cache": str(cache),
        "cache_packing": packing,
        "cache_built_now": built,
        "cache_build_seconds": build_s,
        "warm_cache_lookup_seconds": warm_lookup_s,
        "passes": args.passes,
        "bf16_layer_bytes": bf16_layers,
        "torch_threads": torch.get_num_threads(),
        "direct_io": {k: m.plan.direct_io for k, m in models.items()},
        "bf16_converts_per_pass": any(d.convert for d in models["bf16"].store.disk.values()),
        "by_tokens": {},
    }
    print(f"{'tokens':>6} {'dtype':6} {'pass s (median)':>16} {'read MB/pass':>13} {'x bf16 layer bytes':>19}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        ids = torch.randint(0, models["bf16"].config.vocab_size, (1, tokens))
        results = {k: {"seconds": [], "read_bytes": []} for k in models}
        for rnd in range(args.passes + 2):
            for name, model in models.items():
                s, b = one_pass(model, ids)
                if rnd >= 2:
                    results[name]["seconds"].append(s)
                    results[name]["read_bytes"].append(b)
        med = {
            k: {"seconds": statistics.median(v["seconds"]), "read_bytes": statistics.median(v["read_bytes"])}
            for k, v in results.items()
        }
        rec["by_tokens"][tokens] = {
            "per_pass": results,
            "median": med,
            "nf4_read_bytes_over_bf16_layer_bytes": med["nf4"]["read_bytes"] / bf16_layers,
            "bf16_read_bytes_over_bf16_layer_bytes": med["bf16"]["read_bytes"] / bf16_layers,
            "nf4_pass_over_bf16_pass": med["nf4"]["seconds"] / med["bf16"]["seconds"],
        }
        for k, v in med.items():
            print(
                f"{tokens:6} {k:6} {v['seconds']:16.3f} {v['read_bytes'] / 1e6:13.1f} "
                f"{v['read_bytes'] / bf16_layers:19.3f}"
            )
        r = rec["by_tokens"][tokens]
        print(
            f"{tokens:6} nf4/bf16 pass time {r['nf4_pass_over_bf16_pass']:.3f} (limit 0.5); nf4 bytes / bf16 "
            f"layer bytes {r['nf4_read_bytes_over_bf16_layer_bytes']:.3f} (limit 0.3)"
        )
    args.out.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"cache build {build_s:.1f}s ({'built now' if built else 'warm'}); JSON: {args.out}")
    for m in models.values():
        m.close()


if __name__ == "__main__":
    main()
