"""Dequantization per layer: bytes moved per parameter and seconds, GGUF types (eager and compiled) vs nf4.

Usage: `flock /tmp/bench.lock python bench/dequant.py [--out bench/results/dequant.json] [--repeats 3]
[--hidden 1024 --intermediate 4096 --kv 256] [--readme]`.

One decoder layer of a Llama-shaped model (q, k, v, o, gate, up, down; default a 15.2M-parameter layer,
hidden 1024, intermediate 4096, 256-wide K/V) is stored in each GGUF type with random blocks (finite
half-precision scales), and as bitsandbytes NF4, then dequantized into bf16 (the 16-bit weight a
CUDA pass multiplies with). Q4_K_M is llama.cpp's mix at its heavier end: v and down in Q6_K, the
rest Q4_K. Each row reports, per kernel on this machine:
- seconds per layer: median of `--repeats` runs over the 7 linears, after one warm-up run (the
  compiled kernel's one-off compile time is its own column);
- bytes moved per parameter, counted from the tensors the kernel touches:
  eager (and nf4): a TorchDispatchMode sees every aten op; each op moves the bytes of its tensor
  inputs plus its non-view outputs (views and reshapes move nothing; an in-place op's destination
  counts once). That is the traffic of eager execution, op by op, with no cache reuse assumed.
  compiled: Inductor's kernels are opaque to the dispatcher, so the count is the call's packed input
  bytes, plus its output, plus twice every other buffer the compiled call allocates (each written once
  and read back at least once). The buffers are counted where the generated code allocates them: its
  `empty_strided_cpu` is torch._C._dynamo.guards._empty_strided_cpu, which this script wraps before
  anything compiles (the generated module binds the name when it loads).
- x of the 16-bit weight: bytes moved / (2 bytes x parameters): 1.0 would be writing the weight alone.
Writes JSON; `--readme` rewrites the block `<!-- bench:dequant -->` (`block(result)`: the command, the
machine's load and the table, all from the JSON) on the pages bench/manifest.py lists for it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload.formats import gguf_quants as gq  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
from docblock import md_table  # noqa: E402  (bench/docblock.py)

HALF_AT = {gq.Q8_0: (0,), gq.Q4_0: (0,), gq.Q4_K: (0, 2), gq.Q5_K: (0, 2), gq.Q6_K: (208,)}
TYPES = {"Q4_0": gq.Q4_0, "Q8_0": gq.Q8_0, "Q4_K": gq.Q4_K, "Q5_K": gq.Q5_K, "Q6_K": gq.Q6_K}


def linears(hidden: int, inter: int, kv: int) -> dict[str, tuple[int, int]]:
    return {
        "q": (hidden, hidden),
        "k": (kv, hidden),
        "v": (kv, hidden),
        "o": (hidden, hidden),
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
    }


def random_blocks(qtype: int, rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    per, size = gq.BLOCK[qtype]
    b = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in HALF_AT[qtype]:
        half = (rng.standard_normal(b.shape[:2]) * 0.01).astype(np.float16)
        b[..., off : off + 2] = half.view(np.uint8).reshape(*b.shape[:2], 2)
    return torch.from_numpy(b.reshape(rows, -1))


class Traffic(TorchDispatchMode):
    """Sums the bytes every aten op reads and writes (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return out  # a view: no bytes move
        seen = set()
        flat = list(args) + list((kwargs or {}).values())
        tensors = [t for a in flat for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        outs = out if isinstance(out, (list, tuple)) else [out]
        for t in tensors + [o for o in outs if isinstance(o, torch.Tensor)]:
            if id(t) not in seen:
                seen.add(id(t))
                self.bytes += t.numel() * t.element_size()
        return out


_BUFFERS = {"on": False, "bytes": 0}  # bytes of the buffers compiled code allocated while "on"


def _count_buffers() -> None:
    """Wrap the allocator Inductor's generated CPU code calls, so its buffers can be counted."""
    guards = torch._C._dynamo.guards
    real = guards._empty_strided_cpu

    def counted(size, stride, dtype):
        t = real(size, stride, dtype)
        if _BUFFERS["on"]:
            _BUFFERS["bytes"] += t.untyped_storage().nbytes()
        return t

    guards._empty_strided_cpu = counted


def allocated_bytes(fn) -> int:
    """Bytes of every buffer compiled code allocates while `fn` runs."""
    _BUFFERS.update(on=True, bytes=0)
    try:
        fn()
    finally:
        _BUFFERS["on"] = False
    return _BUFFERS["bytes"]


def gguf_layer(shapes, types: dict[str, int], rng) -> list[tuple[torch.Tensor, int, tuple[int, int]]]:
    return [(random_blocks(types[name], *shape, rng), types[name], shape) for name, shape in shapes.items()]


def run_gguf(layer, kernel: str, repeats: int) -> dict:
    import os

    os.environ[gq.KERNEL_ENV] = kernel

    def once():
        return [gq.dequantize(raw, qt, shape, torch.bfloat16) for raw, qt, shape in layer]

    t0 = time.perf_counter()
    once()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    params = sum(s[0] * s[1] for _, _, s in layer)
    packed = sum(raw.numel() for raw, _, _ in layer)
    if kernel == "eager":
        with Traffic() as tr:
            once()
        moved = tr.bytes
    else:
        assert gq.kernel_status() is None, gq.kernel_status()
        moved = packed + 2 * allocated_bytes(once) - 2 * params  # input + out + 2 x (allocations - out)
    sec = statistics.median(times)
    return dict(
        kernel=kernel,
        params=params,
        packed_bytes=packed,
        seconds_per_layer=sec,
        compile_seconds=max(0.0, first - sec) if kernel == "compiled" else 0.0,
        bytes_per_param=moved / params,
        x_weight=moved / (2 * params),
    )


def run_nf4(shapes, repeats: int) -> dict | None:
    try:
        import bitsandbytes.functional as bnbf
    except ImportError:
        return None
    torch.manual_seed(0)
    layer = [
        bnbf.quantize_4bit(
            torch.randn(*s, dtype=torch.bfloat16) * 0.02, quant_type="nf4", blocksize=64, compress_statistics=True
        )
        for s in shapes.values()
    ]

    def once():
        return [bnbf.dequantize_4bit(q, state) for q, state in layer]

    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    with Traffic() as tr:
        once()
    params = sum(a * b for a, b in shapes.values())
    return dict(
        kernel="bitsandbytes",
        params=params,
        packed_bytes=sum(q.numel() for q, _ in layer),
        seconds_per_layer=statistics.median(times),
        compile_seconds=0.0,
        bytes_per_param=tr.bytes / params,
        x_weight=tr.bytes / (2 * params),
    )


def table(result: dict) -> str:
    head = ["type", "kernel", "packed bytes / param", "bytes moved / param", "x the bf16 weight", "s / layer"]
    rows = [
        [r["type"], r["kernel"], f"{r['packed_bytes'] / r['params']:.3f}", f"{r['bytes_per_param']:.2f}"]
        + [f"{r['x_weight']:.2f}", f"{r['seconds_per_layer']:.3f}", f"{r['compile_seconds']:.1f}"]
        for r in result["rows"]
    ]
    return md_table(head + ["compile s"], rows)


def block(result: dict) -> str:
    """The docs block: the command, threads and load average of the run, the layer's size, the table."""
    params = sum(a * b for a, b in result["layer"].values())
    return (
        f"`{result['command']}` on this CPU ({result['threads']} threads, load average "
        f"{result['load_average'][0]} when it finished), one {params / 1e6:.1f}M-parameter layer into bf16:\n\n"
        + table(result)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/dequant.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--kernels", default="eager,compiled")
    ap.add_argument("--readme", action="store_true")
    args = ap.parse_args()
    _count_buffers()
    shapes = linears(args.hidden, args.intermediate, args.kv)
    rng = np.random.default_rng(0)
    rows = []
    mixes = {name: {k: qt for k in shapes} for name, qt in TYPES.items()}
    mixes["Q4_K_M"] = {k: gq.Q6_K if k in ("v", "down") else gq.Q4_K for k in shapes}
    for name, types in mixes.items():
        layer = gguf_layer(shapes, types, rng)
        for kernel in args.kernels.split(","):
            row = dict(type=name, **run_gguf(layer, kernel, args.repeats))
            rows.append(row)
            print(
                f"{name:7s} {kernel:9s} {row['bytes_per_param']:6.2f} B/param ({row['x_weight']:.2f}x) "
                f"{row['seconds_per_layer']:.3f} s/layer",
                flush=True,
            )
    nf4 = run_nf4(shapes, args.repeats)
    if nf4 is not None:
        rows.append(dict(type="nf4", **nf4))
    result = dict(
        command="python bench/dequant.py " + " ".join(sys.argv[1:]),
        device="cpu",
        machine=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        load_average=[round(x, 2) for x in __import__("os").getloadavg()],  # a shared machine's noise
        torch=torch.__version__,
        layer=shapes,
        rows=rows,
    )
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    if args.readme:
        import manifest  # bench/manifest.py: the block's pages

        manifest.write("dequant", block(result))


if __name__ == "__main__":
    main()
