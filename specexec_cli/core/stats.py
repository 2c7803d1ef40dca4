"""Run statistics: data first, display second.

Contract: `RunStats` accumulates `engine.StepEvent`s and never prints: `to_json()` is the
`--stats-json` record, `summary_line()` the plain line for non-TTY stderr. Wall seconds;
tokens_per_second excludes the prefill.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch


def peak_memory_bytes() -> dict:
    """Peak device memory (CUDA) and current process RSS (host)."""
    import psutil

    out = {"host_rss_bytes": psutil.Process().memory_info().rss}
    if torch.cuda.is_available():
        out["device_peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


@dataclass
class RunStats:
    """Totals over one generate() call (one `run`, one chat turn, or a chat session)."""

    config: dict = field(default_factory=dict)  # method, budget, max_depth, sampling, seed, ...
    prompt_tokens: int = 0  # tokens prefilled
    token_ids: list[int] = field(default_factory=list)  # generated ids, prefill token included
    target_passes: int = 0  # target forward passes after the prefill
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time after the prefill
    draft_seconds: float = 0.0  # tree growth + cache trimming
    target_seconds: float = 0.0  # target verification passes
    pass_tokens: list[int] = field(default_factory=list)  # tokens emitted by each pass
    pass_seconds: list[float] = field(default_factory=list)  # draft + target time of each pass
    draft_pass_seconds: list[float] = field(default_factory=list)  # tree-growth time of each pass
    tree_sizes: list[int] = field(default_factory=list)
    tree_depths: list[int] = field(default_factory=list)
    streamed_bytes: int = 0  # target weight bytes streamed over the decode (offload only)
    link_busy: list[float] = field(default_factory=list)  # per pass: link busy s / step wall s (offload only)
    stall: list[float] = field(default_factory=list)  # per pass: s the target waited for a streamed layer
    host_transfers: int = 0  # host<->device copies made by the target passes' steps (transfers.py)
    host_transfer_bytes: int = 0  # their payload bytes
    prefill_streams: int = 0  # target passes spent on prefills (each one full weight stream when offloaded)
    draft_accepted: int = 0  # emitted tokens that came from the draft's tree (StepEvent.accepted)
    finish: str | None = None

    def add(self, ev) -> None:
        self.token_ids.extend(ev.tokens)
        self.prefill_seconds = ev.prefill_seconds
        self.decode_seconds = ev.decode_seconds
        self.finish = ev.finish
        if ev.pass_index == 0:
            self.prompt_tokens += ev.prompt_tokens
            self.prefill_streams += getattr(ev, "prefill_streams", 0)
            return
        self.target_passes += 1
        self.draft_seconds += ev.draft_seconds
        self.target_seconds += ev.target_seconds
        self.pass_tokens.append(len(ev.tokens))
        self.draft_accepted += ev.accepted
        self.pass_seconds.append(ev.draft_seconds + ev.target_seconds)
        self.draft_pass_seconds.append(ev.draft_seconds)
        self.tree_sizes.append(ev.tree_size)
        self.tree_depths.append(ev.tree_depth)
        self.host_transfers += getattr(ev, "host_transfers", 0)
        self.host_transfer_bytes += getattr(ev, "host_transfer_bytes", 0)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_pass(self) -> float:
        return sum(self.pass_tokens) / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def accept_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.pass_tokens).items()))

    @property
    def link_busy_fraction(self) -> float:
        """Mean over passes of (time the weight stream moved bytes ÷ wall time of the step, draft included)."""
        return sum(self.link_busy) / len(self.link_busy) if self.link_busy else 0.0

    @property
    def streamed_gbps(self) -> float:
        return self.streamed_bytes / self.target_seconds / 1e9 if self.target_seconds > 0 else 0.0

    def overlap(self) -> dict:
        """Mean seconds per pass the target stalled for a streamed layer, against the draft's tree growth."""
        n = len(self.stall)
        draft = self.draft_pass_seconds[-n:] if n else []
        return dict(
            passes=n,
            stall_seconds_per_pass=round(sum(self.stall) / n, 5) if n else 0.0,
            draft_seconds_per_pass=round(sum(draft) / n, 5) if n else 0.0,
        )

    def to_json(self) -> dict:
        rec = dict(self.config)
        rec.update(
            prompt_tokens=self.prompt_tokens,
            new_tokens=self.new_tokens,
            token_ids=list(self.token_ids),
            target_passes=self.target_passes,
            tokens_per_pass=round(self.tokens_per_pass, 4),
            wall_seconds=round(self.prefill_seconds + self.decode_seconds, 4),
            prefill_seconds=round(self.prefill_seconds, 4),
            decode_seconds=round(self.decode_seconds, 4),
            draft_seconds=round(self.draft_seconds, 4),
            target_seconds=round(self.target_seconds, 4),
            tokens_per_second=round(self.tokens_per_second, 3),
            accept_histogram={str(k): v for k, v in self.accept_histogram.items()},
            pass_seconds=[round(s, 5) for s in self.pass_seconds],
            draft_seconds_per_pass=[round(s, 5) for s in self.draft_pass_seconds],
            mean_tree_size=round(sum(self.tree_sizes) / len(self.tree_sizes), 2) if self.tree_sizes else 0,
            streamed_bytes=self.streamed_bytes,
            finish_reason=self.finish,
            prefill_streams=self.prefill_streams,
            **peak_memory_bytes(),
        )
        rec["streamed_bytes_per_pass"] = self.streamed_bytes // self.target_passes if self.target_passes else 0
        if self.link_busy:
            rec.update(
                link_busy_fraction=round(self.link_busy_fraction, 4),
                stall_seconds=round(sum(self.stall), 4),
                link_busy_per_pass=[round(x, 4) for x in self.link_busy],
                stall_seconds_per_pass=[round(x, 4) for x in self.stall],
            )
            rec["overlap"] = self.overlap()
        passes = max(self.target_passes, 1)
        rec["host_transfers_per_pass"] = round(self.host_transfers / passes, 2)
        rec["host_transfer_bytes_per_pass"] = round(self.host_transfer_bytes / passes, 1)
        return rec

    def speculative(self) -> dict:
        """The speculative-decoding view `specx serve` attaches to responses (field `specx`)."""
        return dict(
            tokens_per_pass=round(self.tokens_per_pass, 4),
            target_passes=self.target_passes,
            draft_tokens_proposed=sum(self.tree_sizes),
            draft_tokens_accepted=self.draft_accepted,
            prefill_tokens=self.prompt_tokens,
            prefill_seconds=round(self.prefill_seconds, 4),
            decode_seconds=round(self.decode_seconds, 4),
            pass_seconds=round(sum(self.pass_seconds), 4),
            draft_seconds=round(self.draft_seconds, 4),
            target_seconds=round(self.target_seconds, 4),
            tokens_per_second=round(self.tokens_per_second, 3),
            method=self.config.get("method"),
            budget=self.config.get("budget"),
        )

    def summary_line(self) -> str:
        cfg = self.config
        return (
            f"specx: {self.new_tokens} tokens in {self.decode_seconds:.2f}s "
            f"({self.tokens_per_second:.2f} tok/s), {self.tokens_per_pass:.2f} tokens/pass over "
            f"{self.target_passes} target passes, method {cfg.get('method')} budget {cfg.get('budget')}, "
            f"draft {self.draft_seconds:.2f}s target {self.target_seconds:.2f}s prefill {self.prefill_seconds:.2f}s"
        )


class LinkMeter:
    """Per-step link accounting for an offloaded target (a no-op for a resident one): `step(stats, ev)`
    after every `RunStats.add` appends busy ÷ wall and the stall between two decoding events."""

    def __init__(self, target):
        self.busy = getattr(target, "link_busy_seconds", None)
        self.prefetcher = getattr(target, "prefetcher", None)
        self.last: tuple[float, float, float] | None = None

    def step(self, stats: RunStats, ev) -> None:
        if self.busy is None or not getattr(self.prefetcher, "order", None):
            return
        now = time.perf_counter()
        snap = (now, self.busy(now), self.prefetcher.stall_seconds)
        if self.last is not None and ev.pass_index > 0:
            wall = snap[0] - self.last[0]
            stats.link_busy.append((snap[1] - self.last[1]) / wall if wall > 0 else 0.0)
            stats.stall.append(snap[2] - self.last[2])
        self.last = snap
