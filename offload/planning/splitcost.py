"""The "split" placement's uncached routed experts per pass: computed on the CPU, or streamed to the card.

Contract (pure arithmetic over plan.experts `ex` of mode "split", planning/experts.py, and a passcost.Device;
every figure modelled). Per sparse layer i, d = distinct_experts(n, k, E) of a pass of n tokens split by tier
shares (g cached on the card: the hit share; r in RAM, s on disk: the rest by their counts):
- `split_seconds(ex, i, n, dev, c)` -> (seconds, "cpu" | "stream"): the cached share on the card (bytes over
  its memory rate, or FLOPs, whichever is longer) plus the cheaper of cpu = max(d r bytes at `cpu_bps`, the
  uncached pairs' FLOPs at `cpu_flops`) + d s bytes at the disk's rate, and stream = d s bytes at the disk's
  rate + d (1 - g) bytes over the link into the staging area + their compute on the card: copy then compute,
  as stream/splitexperts.py runs it (llama.cpp's op offload; no overlap counted).
- `stream_from(ex, dev, c)` -> per layer the smallest n whose stream term wins (None: a dense MLP layer, or
  never up to MAX_TOKENS): plan.experts["stream_from"], which the loader follows.
"""

from __future__ import annotations

from offload.planning.expertcost import distinct_experts

MAX_TOKENS = 1 << 16  # a pass larger than this is not searched for the threshold


def split_seconds(ex: dict, i: int, n: int, dev, c: int) -> tuple[float, str]:
    eb, ew, k = ex["expert_bytes"][i], ex["expert_weights"][i], ex["top_k"]
    d = distinct_experts(n, k, ex["experts"])
    flops = 2.0 * n * k * ew  # every routed (token, expert) pair once
    g = ex.get("hit", 0.0)  # the routed experts' share already on the card
    ram, on_disk = ex.get("ram_experts", 0), ex.get("disk_experts", 0)
    rest = max(ram + on_disk, 1)
    r, s = (1 - g) * ram / rest, (1 - g) * on_disk / rest  # the RAM and disk shares of the rest
    on_gpu = max(d * g * eb / dev.memory_bps, g * flops / dev.flops(c))
    disk = d * s * eb / dev.disk_bps
    cpu = max(d * r * eb / ex["cpu_bps"], (1 - g) * flops / ex["cpu_flops"]) + disk
    on_card = max(d * (1 - g) * eb / dev.memory_bps, (1 - g) * flops / dev.flops(c))
    stream = disk + d * (1 - g) * eb / dev.link_bps + on_card
    return on_gpu + min(cpu, stream), "cpu" if cpu <= stream else "stream"


def stream_from(ex: dict, dev, c: int) -> list[int | None]:
    """Per layer the smallest pass (tokens) that streams its uncached experts (see the contract): the first
    power of two where streaming wins, then bisected below it (the stream term's lead grows with n)."""
    out: list[int | None] = []
    seen: dict[tuple[int, int], int | None] = {}
    for i, (eb, ew) in enumerate(zip(ex["expert_bytes"], ex["expert_weights"])):
        if eb and (eb, ew) not in seen:
            wins = lambda n, i=i: split_seconds(ex, i, n, dev, c)[1] == "stream"  # noqa: E731
            hi = 1
            while hi <= MAX_TOKENS and not wins(hi):
                hi *= 2
            lo = hi // 2  # loses (or 0)
            while hi <= MAX_TOKENS and hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if wins(mid) else (mid, hi)
            seen[(eb, ew)] = hi if hi <= MAX_TOKENS else None
        out.append(seen[(eb, ew)] if eb else None)
    return out
