"""Routed experts computed on the CPU from RAM: time against the routed experts' bytes, measured and modelled.

Usage: `flock -s /tmp/bench.lock python bench/moe_experts.py [--out bench/results/moe_experts.json]
[--experts 64 --hidden 1024 --inter 1024 --dtype fp32] [--tokens 1,2,4,8,16,32] [--topk 1,2,4,8]
[--repeats 5] [--doc]`.

One mixture-of-experts layer's routed experts as specx computes them on a CPU today: offload/arch/moe.py's
`ExpertList` (per-expert nn.Linear gate/up/down, SwiGLU), whose forward runs only the experts some token
routed to. Its weights (default 64 experts x 3 x 1024 x 1024 in fp32, 805 MB) are far beyond the
CPU's last-level cache, and before every timed call a buffer of `--flush` MB is read so that no
expert is still cached. For each (top-k, tokens) cell, each repeat draws a fresh uniform routing
(every token its own top-k of the experts, seeded), times one forward, and counts the distinct experts
routed: routed MB = distinct experts x one expert's bytes. Reported per cell: the median ms, the mean
routed MB, and the speed model's figure (offload/planning/experts.routed_seconds, mode "layers" on a CPU
device) at this machine's rates: read bandwidth (a `--flush`-sized sum, timed) and fp32 matmul FLOP/s
(one 1024^3 matmul), with the model's expected distinct experts (uniform routing); and the same figure at
the CPU expert rate `specx profile` measures and stores (tools/kernelprobes.probe_cpu_experts, run here on the
same threads), which is what a profiled plan prices CPU experts at. The experts are NOT
computed by a packed kernel here: they are dense fp32 (or bf16) nn.Linear matmuls, one expert at a time,
over the routed tokens' rows. One torch thread by default (`--threads`): on a shared 2-core machine two
threads wait on each other's busy core and time the scheduler, not the experts. A least-squares line ms = a + b x MB over the cells says how well time
follows the routed bytes (R^2) and at what rate (1 / b). Writes JSON; `--doc` rewrites the block
`<!-- bench:moe-experts -->` on the pages bench/manifest.py lists for it (`block(result)`, from the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload.arch.moe import Expert, ExpertList  # noqa: E402
from offload.planning.experts import distinct_experts, routed_seconds  # noqa: E402
from offload.planning.passcost import device_for  # noqa: E402
from specexec_cli.tools.kernelprobes import probe_cpu_experts  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
from docblock import md_table  # noqa: E402  (bench/docblock.py)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0) -> ExpertList:
    torch.manual_seed(seed)
    act = torch.nn.SiLU()
    layer = ExpertList(Expert(hidden, inter, act, ("gate_proj", "up_proj", "down_proj")) for _ in range(experts))
    return layer.to(dtype).requires_grad_(False)


def route(gen: torch.Generator, tokens: int, k: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform routing: each token's top-k distinct experts, softmax-normalized random weights."""
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    w = torch.softmax(torch.rand(tokens, k, generator=gen), dim=-1)
    return idx, w


def read_rate(buf: torch.Tensor, repeats: int = 3) -> float:
    """Bytes/s of one streaming read of `buf` (a sum), the best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * buf.element_size() / best


def matmul_rate(dtype: torch.dtype, n: int = 1024) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t = time.perf_counter()
    for _ in range(3):
        a @ b
    return 3 * 2 * n**3 / (time.perf_counter() - t)


def cell(layer, flush, gen, tokens: int, k: int, repeats: int, hidden: int, dtype) -> dict:
    """Median ms of one forward over fresh uniform routings, and the distinct experts each routed."""
    times, distinct = [], []
    for _ in range(repeats):
        idx, w = route(gen, tokens, k, len(layer))
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        flush.sum()  # evict the experts from the caches
        t = time.perf_counter()
        layer(x, idx, w.to(dtype))
        times.append(time.perf_counter() - t)
        distinct.append(len(set(idx.flatten().tolist())))
    return dict(tokens=tokens, top_k=k, ms=1e3 * statistics.median(times), distinct=statistics.mean(distinct))


def fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = a + b x and its R^2."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return dict(intercept_ms=a, ms_per_mb=b, r2=1 - res / ss if ss else 1.0)


def modelled_ms(args, expert_bytes: int, tokens: int, k: int, mem_bps: float, flops: float, c: int, bps=None) -> float:
    """The speed model's routed-experts seconds of this layer (experts.routed_seconds, a CPU device), its
    experts read at `bps` (the profile's CPU expert rate), else at the memory's read rate."""
    dev = device_for("cpu", memory_bps=mem_bps, flops32=flops, flops16=flops)
    ex = dict(
        mode="layers",
        cpu_bps=bps or mem_bps,
        experts=args.experts,
        top_k=k,
        expert_bytes=[expert_bytes],
        expert_weights=[3 * args.hidden * args.inter],
    )
    return 1e3 * routed_seconds(ex, 0, tokens, dev, c)[0]


def run(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    dtype = DTYPES[args.dtype]
    layer = build(args.experts, args.hidden, args.inter, dtype)
    c = torch.finfo(dtype).bits // 8
    expert_bytes = 3 * args.hidden * args.inter * c
    flush = torch.ones(args.flush * 2**20 // 4, dtype=torch.float32)
    mem_bps, flops = read_rate(flush), matmul_rate(dtype)
    probe = probe_cpu_experts()  # what `specx profile` stores as the CPU expert rate, on these threads
    gen = torch.Generator().manual_seed(1)
    every = torch.arange(args.experts)[:, None]  # warm-up: each expert once
    layer(torch.zeros(args.experts, args.hidden, dtype=dtype), every, torch.ones(args.experts, 1, dtype=dtype))
    cells = []
    for k in args.topk:
        for n in args.tokens:
            r = cell(layer, flush, gen, n, k, args.repeats, args.hidden, dtype)
            r["routed_mb"] = r["distinct"] * expert_bytes / 1e6
            r["expected_distinct"] = distinct_experts(n, k, args.experts)
            r["modelled_ms"] = modelled_ms(args, expert_bytes, n, k, mem_bps, flops, c)
            r["profiled_ms"] = modelled_ms(args, expert_bytes, n, k, mem_bps, flops, c, probe["gbps"] * 1e9)
            cells.append(r)
            print(json.dumps(r), flush=True)
    line = fit([r["routed_mb"] for r in cells], [r["ms"] for r in cells])
    return dict(
        command="python bench/moe_experts.py " + " ".join(sys.argv[1:]),
        machine=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        load_average=[round(x, 2) for x in os.getloadavg()],
        experts=args.experts,
        hidden=args.hidden,
        inter=args.inter,
        dtype=args.dtype,
        expert_mb=expert_bytes / 1e6,
        read_gbps=mem_bps / 1e9,
        matmul_gflops=flops / 1e9,
        profile_cpu_experts=probe,
        fit=line,
        cells=cells,
    )


def table(result: dict) -> str:
    rows = [
        [
            r["top_k"],
            r["tokens"],
            f"{r['distinct']:.1f}",
            f"{r['expected_distinct']:.1f}",
            f"{r['routed_mb']:.0f}",
            f"{r['ms']:.1f}",
            f"{r['routed_mb'] / r['ms']:.2f}",
            f"{r['modelled_ms']:.1f}",
            f"{r['modelled_ms'] / r['ms']:.2f}",
            f"{r['profiled_ms']:.1f}",
            f"{r['profiled_ms'] / r['ms']:.2f}",
        ]
        for r in result["cells"]
    ]
    head = [
        "top-k",
        "tokens",
        "distinct experts",
        "expected (uniform)",
        "routed MB",
        "ms measured",
        "GB/s routed",
        "ms modelled",
        "modelled ÷ measured",
        "ms modelled, profile's rate",
        "÷ measured",
    ]
    return md_table(head, rows)


def block(result: dict) -> str:
    """The docs block: the command, the machine's load, the layer, the rates, the table and the fit."""
    f = result["fit"]
    return (
        f"`{result['command']}` on this CPU ({result['threads']} thread{'s' if result['threads'] != 1 else ''}, load average "
        f"{result['load_average'][0]} when it finished): {result['experts']} experts of "
        f"{result['expert_mb']:.1f} MB ({result['dtype']}, hidden {result['hidden']}, expert intermediate "
        f"{result['inter']}) computed by `ExpertList` (dense matmuls, no packed kernel), caches flushed before "
        f"every call; modelled at this machine's measured read rate {result['read_gbps']:.1f} GB/s and "
        f"{result['matmul_gflops']:.0f} GFLOP/s, and at the CPU expert rate `specx profile` measures and stores "
        f"(tools/kernelprobes.probe_cpu_experts, in the same run: {result['profile_cpu_experts']['gbps']:.1f} GB/s):\n\n"
        + table(result)
        + "\n\n"
        f"Least squares over the cells: ms = {f['intercept_ms']:.2f} + {f['ms_per_mb']:.4f} x routed MB "
        f"(R² = {f['r2']:.3f}; {1 / f['ms_per_mb']:.1f} GB/s of routed experts)."
    )


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "moe_experts.json")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--tokens", type=ints, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--topk", type=ints, default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--flush", type=int, default=1024, help="MB read before each timed call")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--doc", action="store_true", help="rewrite <!-- bench:moe-experts --> from the JSON")
    args = ap.parse_args()
    result = run(args)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(block(result))
    if args.doc:
        import manifest  # bench/manifest.py: the block's pages

        manifest.write("moe-experts", block(result))


if __name__ == "__main__":
    main()
