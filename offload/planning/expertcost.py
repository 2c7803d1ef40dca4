"""What a layer's routed experts cost in one pass: held apart (read from disk once routed) or in their layer.

Contract (pure arithmetic over plan.experts, planning/experts.py, and a passcost.Device; every figure modelled):
- `read_seconds(ex, i, dev)`: one routed expert of layer i read from disk: its read requests
  (`ex["expert_reads"][i]`, its file spans: six for gpt-oss's fused tensors, one for a Qwen3-MoE expert's
  adjacent matrices) x Device.disk_read_s, plus its bytes / Device.disk_bps.
- `compute_seconds(ex, i, n, dev, c)`: one distinct expert of layer i computing its n x k / d rows of a
  pass of n tokens: max(its bytes at `cpu_bps` on a CPU (memory bandwidth on a card), its FLOPs), plus,
  for experts stored MXFP4 (`ex["kernel"]`), weights x c x passcost.dequant_elems at Device.dequant_rate.
- `apart_seconds(ex, i, n, dev, c)`: d distinct experts, m = d x (1 - hit) of them missing the RAM cache,
  r = read_seconds, t = compute_seconds. With read-ahead (a cache of at least two experts: the next read
  while one computes): r + (m - 1) x max(r, t) + t + (d - m) x t; without: m x r + d x t. None of it
  overlaps the layer's attention and router, nor the next layer. A pass of more than one token whose misses
  are worth a whole read (stream/expertbulk.worth_whole, the store's rule) reads the layer's experts whole
  beside the layer before and copies each miss out: max(w, d x t) + m x 2 x bytes / memory bandwidth, w =
  the whole read's requests x disk_read_s + E x bytes / disk_bps.
- `transfer_seconds(nbytes, reads, rate, dev, disk)`: a streamed part of a layer: bytes / rate plus, from
  disk, `reads` x disk_read_s; it arrives while the previous layer computes (passcost's max per layer).
"""

from __future__ import annotations

from offload.planning.passcost import dequant_elems
from offload.stream.expertbulk import REQUEST_BYTES, worth_whole


def distinct_experts(n: int, k: int, e: int) -> float:
    """Expected distinct experts n tokens route to, top-k of e, under uniform independent routing (a prior):
    e x (1 - (1 - k/e)^n). A verify pass of a tree of n tokens reads that many per sparse layer, not n x k."""
    return e * (1.0 - (1.0 - k / e) ** max(0, n))


def read_seconds(ex: dict, i: int, dev) -> float:
    return ex["expert_reads"][i] * dev.disk_read_s + ex["expert_bytes"][i] / dev.disk_bps


def compute_seconds(ex: dict, i: int, n: int, dev, c: int) -> float:
    eb, ew, k = ex["expert_bytes"][i], ex["expert_weights"][i], ex["top_k"]
    rows = n * k / max(distinct_experts(n, k, ex["experts"]), 1e-9)  # (token, expert) pairs per distinct expert
    bps = (ex.get("cpu_bps") or dev.memory_bps) if dev.kind == "cpu" else dev.memory_bps
    kernel = ex.get("kernel", "none")
    dequant = ew * c * dequant_elems(kernel, dev.kind) / dev.dequant_rate(kernel) if kernel != "none" else 0.0
    return max(eb / bps, 2.0 * rows * ew / dev.flops(c)) + dequant


def apart_seconds(ex: dict, i: int, n: int, dev, c: int) -> float:
    if not ex["expert_bytes"][i]:
        return 0.0
    d = distinct_experts(n, ex["top_k"], ex["experts"])
    m = d * (1.0 - ex.get("hit", 0.0))
    r, t = read_seconds(ex, i, dev), compute_seconds(ex, i, n, dev, c)
    if ex.get("cache_experts", 0) < 2 or m < 1.0:  # one at a time (or at most one read: nothing to overlap)
        return m * r + d * t
    reads, eb, e = ex["expert_reads"][i], ex["expert_bytes"][i], ex["experts"]
    if n > 1 and worth_whole(m, reads, eb, reads, e * eb, REQUEST_BYTES):  # whole, ahead, beside the layer before
        w = reads * dev.disk_read_s + e * eb / dev.disk_bps
        return max(w, d * t) + m * 2.0 * eb / dev.memory_bps
    return r + (m - 1.0) * max(r, t) + t + (d - m) * t


def transfer_seconds(nbytes: float, reads: int, rate: float, dev, disk: bool) -> float:
    if not rate:
        return 0.0
    return nbytes / rate + (reads * dev.disk_read_s if disk else 0.0)
