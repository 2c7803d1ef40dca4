"""The kernel rates of a profile's `dequant` part: what the pass model prices each kernel's work at.

Contract: `probe_dequant()` -> {device, shape, <kernel>: {seconds, gbps, ...}} for every dequantizing
kernel installed on the compute device (NF4, HQQ 3-bit eager, MXFP4), the exact GGUF CPU kernel on a
CPU, and "cpu-experts" (routed experts computed on the host CPU from RAM, on CUDA machines too).
session/profiles.py turns the rates into `Device.dequant_bps`. Nothing here prints.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

DEQUANT_SHAPE = (1024, 1024)  # the weight the dequantization probe rebuilds


def timed(fn, min_seconds: float = 0.2, max_reps: int = 50, device: str = "cpu") -> float:
    """Fastest of repeated fn() calls filling ~min_seconds (after one warm-up call), at least 2: the
    minimum, as on a shared machine other processes only ever add time. On a CUDA `device` each call
    ends by waiting for it (its kernels run asynchronously)."""

    def call():
        fn()
        if device != "cpu":
            torch.cuda.synchronize(device)

    call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 2 or (time.perf_counter() - start < min_seconds and len(times) < max_reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return min(times)


def dequantizers(device: str, dtype: torch.dtype) -> dict:
    """kernel name -> a function rebuilding a DEQUANT_SHAPE weight in `dtype` as that kernel does, for
    the installed ones: bitsandbytes NF4, HQQ 3-bit eager (LowbitLinear.weight_now), MXFP4 experts
    (formats/mxfp4.dequantize_t, as Mxfp4Experts.weights)."""
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its optional-kernel notice is not the user's
    w = torch.randn(*DEQUANT_SHAPE, dtype=torch.float32) * 0.02
    out = {}
    try:
        import bitsandbytes.functional as bf

        packed, state = bf.quantize_4bit(w.to(device, dtype), quant_type="nf4")
        out["nf4-dequant"] = lambda: bf.dequantize_4bit(packed, state)
    except Exception:  # noqa: BLE001 - bitsandbytes missing or without a kernel for this device
        pass
    try:
        from offload import LowbitLinear, lowbit_quantize_weight

        q = lowbit_quantize_weight(w, 3)
        lin = LowbitLinear(
            q["W_q"].to(device), q["scale"].to(device, dtype), q["zero"].to(device, dtype), None, DEQUANT_SHAPE, 3
        )
        out["hqq-eager"] = lin.weight_now
    except Exception:  # noqa: BLE001 - hqq missing (the lowbit extra)
        pass
    from offload.formats import mxfp4_dequantize_t

    rows, cols = DEQUANT_SHAPE  # MXFP4: 16 bytes (32 weights) per group, one E8M0 scale byte per group
    blocks = torch.randint(0, 256, (rows, cols // 32, 16), dtype=torch.uint8, device=device)
    scales = torch.randint(120, 128, (rows, cols // 32), dtype=torch.uint8, device=device)
    out["mxfp4"] = lambda: mxfp4_dequantize_t(blocks, scales, dtype)  # as Mxfp4Experts.weights
    return out


def probe_dequant() -> dict:
    """Per kernel, the traffic the pass model counts (weights x compute-dtype bytes x
    passcost.dequant_elems) over the seconds to rebuild a DEQUANT_SHAPE weight."""
    from offload.planning import dequant_elems

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out: dict = dict(device=device, shape=list(DEQUANT_SHAPE))
    for kernel, fn in dequantizers(device, dtype).items():
        try:
            with torch.no_grad():
                secs = timed(fn, 0.3, 20, device)
        except Exception:  # noqa: BLE001 - a kernel this device cannot run
            continue
        traffic = DEQUANT_SHAPE[0] * DEQUANT_SHAPE[1] * (2 if device == "cuda" else 4) * dequant_elems(kernel, device)
        out[kernel] = dict(seconds=round(secs, 6), gbps=round(traffic / secs / 1e9, 3))
    if device == "cpu" and (got := probe_gguf_kernel()):
        out[got.pop("kernel")] = got
    if got := probe_cpu_experts():
        out["cpu-experts"] = got  # the host CPU's rate on a CUDA machine too (planning/experts.py)
    return out


def _last_level_cache() -> int:
    """Bytes of the CPU's largest cache (sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG" else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


def probe_cpu_experts(
    hidden: int = 2048, inter: int = 768, top_k: int = 4, repeats: int = 9, span: int | None = None
) -> dict:
    """One token routed to `top_k` CPU experts of Qwen3-30B-A3B's shape, computed as offload/arch/moe.ExpertList
    does (fp32 GEMVs): their bytes over the median seconds. The experts are views of one `span`-byte buffer
    (default twice the last-level cache, 256 MB to 1 GB), read whole before each call so the routed ones are
    out of the caches and the TLB, as after the rest of a pass."""
    from offload import Expert, ExpertList

    one = 3 * hidden * inter  # fp32 weights of one expert's gate, up and down
    span = span or min(1 << 30, max(256 << 20, 2 * _last_level_cache()))
    n = max(2 * top_k, span // (4 * one))
    flat = torch.full((n * one,), 1e-3)  # the values do not change the time; no denormals
    with torch.device("meta"):  # shapes only: the weights are bound to views of `flat` below
        experts = ExpertList(Expert(hidden, inter, torch.nn.functional.silu, ("g", "u", "d")) for _ in range(n))
    for e, ex in enumerate(experts):
        for j, lin in enumerate((ex.g, ex.u, ex.d)):
            view = flat[(3 * e + j) * hidden * inter : (3 * e + j + 1) * hidden * inter]
            lin.weight = torch.nn.Parameter(view.view_as(lin.weight), requires_grad=False)
    x, idx, w = torch.full((1, hidden), 0.5), torch.arange(top_k).view(1, top_k), torch.full((1, top_k), 1 / top_k)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first call warms torch up, untimed
            flat.sum()
            t0 = time.perf_counter()
            experts(x, idx, w)
            times.append(time.perf_counter() - t0)
    secs = statistics.median(times[1:])
    gbps = round(top_k * 4 * one / secs / 1e9, 3)
    return dict(seconds=round(secs, 6), gbps=gbps, shape=[hidden, inter], top_k=top_k, experts=n)


def probe_gguf_kernel(shape: tuple[int, int] = (8192, 4096)) -> dict | None:
    """The GGUF CPU kernel's packed bytes over the seconds of a one-token GEMV on a Q4_1 weight of
    `shape` (17 MB: past the caches); None where the kernel is off or cannot compile."""
    from offload.formats import ggml_kernel_enabled, ggml_linear
    from offload.planning import GGUF_KERNEL

    if not ggml_kernel_enabled():
        return None
    n, k = shape
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8, generator=g)  # Q4_1: d, m, 16 code bytes
    blocks[..., :4] = (torch.rand(n, k // 32, 2, generator=g) * 0.02 - 0.01).to(torch.float16).view(torch.uint8)
    raw, x = blocks.reshape(-1), torch.randn(1, k)
    secs = timed(lambda: ggml_linear(x, raw, 3, n), 0.3, 20)  # 3: GGML_TYPE_Q4_1
    return dict(
        kernel=GGUF_KERNEL, seconds=round(secs, 6), gbps=round(raw.numel() / secs / 1e9, 3), shape=[n, k], qtype="Q4_1"
    )
