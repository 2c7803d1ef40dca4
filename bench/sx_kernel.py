"""The self-draft's SX3 / SX2 / Q8A kernel blocks against Q4_1 on one linear: what ggml_kernel.COST quotes for them.

Run by hand (not a test), under the bench lock:
`flock /tmp/bench.lock python bench/sx_kernel.py [--threads 1] [--rows 1,2,4,8,16] [--out bench/results/sx_kernel.json]`.
One shape, SmolLM2-135M's gate/up (1536 x 576), as GGUF Q4_1 (random blocks, bench/gguf_kernel.py's),
SX3 and SX2 (random codes, scales and zeros packed by offload/quant/lowbit_pack.pack), Q8_0 and the same
Q8_0 bytes as Q8A (the self-draft's view of a Q8_0 head); LAYERS distinct
weights of each cycled per timing, as a decode pass reads them, so they come from memory. Per type and
row count T: the best of `--calls` timings of one pass over the LAYERS weights, per weight, in ms, on
`--threads` threads (formats/ggml_kernel.linear on the pool, as the one-call stack runs it), and at
T = 1 the seconds per packed byte relative to Q4_1's: the planner's COST factor. SX3 and SX2 multiply
8-bit activations (cpu/kernels/sx_q8.h), and so does Q8A; Q4_1 and Q8_0 fp32 ones. JSON to --out, a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the package: bench/offload.py must not shadow offload/

from gguf_kernel import random_blocks  # noqa: E402

from offload.cpu import ggml_kernel  # noqa: E402
from offload.quant import lowbit_pack as lp  # noqa: E402

N, K, LAYERS = 1536, 576, 30
Q4_1, Q8_0 = 3, 8


def sx_blocks(bits: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    per = lp.BLOCKS[lp.TYPE_OF_BITS[bits]][0]
    codes = torch.randint(0, 1 << bits, (N, K), generator=g)
    scale = torch.rand(N * K // per, generator=g) * 0.01 + 1e-3
    zero = torch.rand(N * K // per, generator=g) * ((1 << bits) - 1)
    return lp.pack(codes, scale, zero, bits, N).reshape(-1)


def best_ms(qtype: int, raws: list[torch.Tensor], t: int, calls: int) -> float:
    x = torch.randn(1, t, K)
    for w in raws:
        ggml_kernel.linear(x, w, qtype, N, pool=True)
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        for w in raws:
            ggml_kernel.linear(x, w, qtype, N, pool=True)
        best = min(best, (time.perf_counter() - t0) / len(raws))
    return best * 1e3


def measure(rows: list[int], calls: int) -> dict:
    types = {
        "Q4_1": (Q4_1, [random_blocks(Q4_1, N, K, s) for s in range(LAYERS)]),
        "SX3": (lp.SX3, [sx_blocks(3, s) for s in range(LAYERS)]),
        "SX2": (lp.SX2, [sx_blocks(2, s) for s in range(LAYERS)]),
        "Q8_0": (Q8_0, [random_blocks(Q8_0, N, K, s) for s in range(LAYERS)]),
        "Q8A": (ggml_kernel.Q8A, [random_blocks(Q8_0, N, K, s) for s in range(LAYERS)]),
    }
    out = {}
    for name, (qtype, raws) in types.items():
        out[name] = {"bytes": raws[0].numel(), "ms": {t: best_ms(qtype, raws, t, calls) for t in rows}}
    base = out["Q4_1"]["ms"][1] / out["Q4_1"]["bytes"]
    for name in out:
        out[name]["cost_per_byte_vs_q4_1"] = round(out[name]["ms"][1] / out[name]["bytes"] / base, 2)
    return out


def table(res: dict) -> str:
    rows = list(next(iter(res["types"].values()))["ms"])
    head = "| type | bytes | " + " | ".join(f"T={t} ms" for t in rows) + " | per byte vs Q4_1 (T=1) |"
    lines = [head, "|" + "---|" * (len(rows) + 3)]
    for name, r in res["types"].items():
        cells = " | ".join(f"{r['ms'][t]:.3f}" for t in rows)
        lines.append(f"| {name} | {r['bytes']} | {cells} | {r['cost_per_byte_vs_q4_1']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sx_kernel.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {"shape": [N, K], "layers": LAYERS, "threads": a.threads, "calls": a.calls}
    res["types"] = measure([int(t) for t in a.rows.split(",")], a.calls)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(table(res))


if __name__ == "__main__":
    main()
