"""Hardware probes, t_target(n) / draft-step measurement, and profile JSON read/write.

Contract: `probe_hardware(folder)` returns the machine part of a profile: CPU, RAM, GPUs with pinned
host→device bandwidth, disk read bandwidth and per-request latency of `folder`, matmul throughput per
dtype, each device's memory bandwidth, and tools/kernelprobes.py's kernel rates. `build_profile`
assembles the versioned dict of profiles/README.md. Nothing here prints; errors are SpecxError.
"""

from __future__ import annotations

import functools
import mmap
import os
import platform
import socket
import tempfile
import time
from pathlib import Path

import torch

from specexec_cli.session.profiles import SCHEMA, VERSION
from specexec_cli.tools import kernelprobes

CHUNK = 8 << 20  # disk read size: large enough to reach sequential bandwidth
LATENCY_READS = 64  # single-page reads timed for the disk's per-read latency (their median)


def probe_cpu() -> dict:
    import psutil

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return dict(
        model=name,
        physical_cores=psutil.cpu_count(logical=False),
        logical_cores=psutil.cpu_count(),
        usable_cores=usable,
        torch_threads=torch.get_num_threads(),
    )


def probe_memory() -> dict:
    import psutil

    vm = psutil.virtual_memory()
    return dict(total_bytes=vm.total, available_bytes=vm.available)


def probe_gpus(copy_bytes: int = 512 << 20) -> list[dict]:
    """Name, memory and pinned host→device bandwidth (one large copy, fastest of a few)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        host = torch.empty(copy_bytes, dtype=torch.uint8).pin_memory()
        dev = torch.empty(copy_bytes, dtype=torch.uint8, device=f"cuda:{i}")
        copy = functools.partial(dev.copy_, host, non_blocking=True)
        gbps = round(copy_bytes / kernelprobes.timed(copy, 0.5, 10, f"cuda:{i}") / 1e9, 3)
        out.append(dict(index=i, name=props.name, total_bytes=props.total_memory, h2d_pinned_gbps=gbps))
    return out


def _read_direct(paths: list[Path], total: int) -> tuple[int, float, str]:
    """Read up to `total` bytes from `paths` in CHUNK reads; O_DIRECT if possible, else buffered."""
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    done, secs, method = 0, 0.0, "o_direct"
    while done < total:
        for path in paths:
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if method == "o_direct" else 0)
            try:
                fd = os.open(path, flags)
            except OSError:
                if method != "o_direct":
                    raise
                method = "buffered"
                fd = os.open(path, os.O_RDONLY)
            try:
                size, off = os.fstat(fd).st_size, 0
                t0 = time.perf_counter()
                while off < size and done < total:
                    try:
                        n = os.preadv(fd, [buf], off)
                    except OSError:  # EINVAL: O_DIRECT unsupported on this filesystem
                        if method != "o_direct":
                            raise
                        method = "buffered"
                        os.close(fd)
                        fd = os.open(path, os.O_RDONLY)
                        continue
                    if n <= 0:
                        break
                    off, done = off + n, done + n
                secs += time.perf_counter() - t0
            finally:
                os.close(fd)
            if done >= total:
                break
    buf.close()
    return done, secs, method


def probe_disk(folder: Path, nbytes: int = 256 << 20) -> dict:
    """Read bandwidth of the disk under `folder`: its *.safetensors (else a temporary `nbytes` file),
    read up to `nbytes` with O_DIRECT (past the page cache); a buffered fallback is noted."""
    folder = Path(folder)
    files = sorted(p for p in folder.glob("*.safetensors") if p.stat().st_size >= 64 << 10)
    tmp = None
    note = ""
    if not files:
        try:
            fd, name = tempfile.mkstemp(prefix=".specx-probe-", dir=folder)
        except OSError:
            return dict(
                path=str(folder), read_gbps=None, method="none", note="folder not writable and no weights to read"
            )
        tmp = Path(name)
        with os.fdopen(fd, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(max(1, nbytes >> 20)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        files = [tmp]
    try:
        done, secs, method = _read_direct(files, nbytes)
        latency = read_latency(files[0]) if method == "o_direct" else None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    if method == "buffered":
        note = "O_DIRECT unsupported here; buffered reads may be served by the page cache (optimistic)"
    gbps = round(done / secs / 1e9, 3) if secs > 0 else None
    return dict(path=str(folder), read_gbps=gbps, read_latency_s=latency, method=method, bytes_read=done, note=note)


def read_latency(path: Path, reads: int = LATENCY_READS) -> float | None:
    """Seconds per O_DIRECT read request (passcost.Device.disk_read_s): the median of `reads` single 4 KiB
    reads at spread offsets of `path` (their transfer is ~1 us at NVMe rates). None where O_DIRECT cannot
    open the file or it is under one page."""
    page = 4096
    buf = mmap.mmap(-1, page)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return None
    try:
        pages = os.fstat(fd).st_size // page
        if pages < 1:
            return None
        times = []
        for k in range(reads):  # steps of a prime number of pages: offsets spread over the file, none cached
            off = (k * 7919 % pages) * page
            t0 = time.perf_counter()
            os.preadv(fd, [buf], off)
            times.append(time.perf_counter() - t0)
    except OSError:  # EINVAL: O_DIRECT unsupported on this filesystem
        return None
    finally:
        os.close(fd)
        buf.close()
    times.sort()
    return round(times[len(times) // 2], 7)


def probe_matmul() -> dict:
    """Dense matmul GFLOP/s for bf16 and fp32 on the compute device (a smaller bf16 matrix on CPU,
    where bf16 can be ~50x slower)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = {"bf16": 4096 if device == "cuda" else 384, "fp32": 4096 if device == "cuda" else 1024}
    out: dict = dict(device=device, sizes=sizes)
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        size = sizes[name]
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        secs = kernelprobes.timed(functools.partial(torch.matmul, a, b), 0.3, 20, device)
        out[f"{name}_gflops"] = round(2 * size**3 / secs / 1e9, 2)
    return out


def copy_bandwidth(device: str, nbytes: int = 256 << 20) -> dict:
    """Memory bandwidth of `device`: 2 x `nbytes` (read + write) over the fastest of repeated copies
    within it (CPU: RAM to RAM)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    secs = kernelprobes.timed(functools.partial(dst.copy_, src), 0.5, 20, device)
    name = torch.cuda.get_device_name() if device == "cuda" else probe_cpu()["model"]
    del src, dst
    return dict(name=name, gbps=round(2 * nbytes / secs / 1e9, 3), bytes=nbytes, method="copy_ read + write")


def probe_device_memory(nbytes: int = 256 << 20) -> dict:
    """{"cpu": copy_bandwidth, "cuda": too when present}: offload/planning/draftcost.py's bandwidth."""
    out = {"cpu": copy_bandwidth("cpu", nbytes)}
    if torch.cuda.is_available():
        out["cuda"] = copy_bandwidth("cuda", max(nbytes, 1 << 30))
    return out


def probe_hardware(folder: Path | None, disk_bytes: int = 256 << 20) -> dict:
    return dict(
        cpu=probe_cpu(),
        memory=probe_memory(),
        gpus=probe_gpus(),
        disk=probe_disk(folder or Path.cwd(), disk_bytes),
        matmul=probe_matmul(),
        device_memory=probe_device_memory(),
        dequant=kernelprobes.probe_dequant(),
    )


def build_profile(
    hardware: dict, models_part: dict | None, recommended: dict | None, node_calibration: dict | None = None
) -> dict:
    """The profile dict; `node_calibration` (calprobe.py) is stored only when it was measured, and
    `models_part`'s `floors` (modeltimes.measure) at the top level, where session/profiles.cost_device_for
    reads them for any target, only when some floor was."""
    from specexec_cli import __version__

    floors = (models_part or {}).get("floors")
    if models_part is not None:
        models_part = {k: v for k, v in models_part.items() if k != "floors"}

    prof = dict(
        schema=SCHEMA,
        version=VERSION,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        hostname=socket.gethostname(),
        specx_version=__version__,
        torch_version=torch.__version__,
        **hardware,
        models=models_part,
        recommended=recommended,
    )
    if node_calibration:
        prof["node_calibration"] = node_calibration
    if floors:
        prof["floors"] = floors
    return prof


def recommend(models_part: dict | None, max_depth: int = 64) -> dict:
    """The budget/depth the chooser picks from these timings and the prior acceptance curve."""
    from specexec_cli.core.budget import make_tuner
    from specexec_cli.core.draft import TreeShape

    tuner = make_tuner(
        {"models": models_part} if models_part else None, TreeShape(64, max_depth), torch.cuda.is_available()
    )
    return dict(
        budget=tuner.shape.budget,
        max_depth=tuner.shape.max_depth,
        timing=tuner.timing.source,
        expected_tokens_per_pass=round(tuner.expected_tokens(tuner.shape.budget), 3),
    )
