"""Prometheus counters of `specx serve` (`GET /metrics`), as views of the requests' RunStats.

Contract: `request`, `finished` (one generation's RunStats), `refused`, `forest_pass` and `observe`
(a HISTOGRAMS latency) count; `render(worker)` gives the text exposition format (version 0.0.4) with
the live queue depth and the prompt cache's figures. Thread-safe; no client library.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

HELP = {
    "specx_requests_total": ("counter", "Finished requests by endpoint and outcome."),
    "specx_prompt_tokens_total": ("counter", "Prompt tokens of all requests."),
    "specx_cached_prompt_tokens_total": ("counter", "Prompt tokens reused from the KV caches (not prefilled)."),
    "specx_prompt_cache_hit_ratio": ("gauge", "Cached prompt tokens / prompt tokens since start (0 before any)."),
    "specx_prefill_tokens_total": ("counter", "Tokens prefilled."),
    "specx_completion_tokens_total": ("counter", "Generated tokens."),
    "specx_target_passes_total": ("counter", "Target forward passes after the prefill."),
    "specx_draft_tokens_proposed_total": ("counter", "Draft tree nodes the target verified."),
    "specx_draft_tokens_accepted_total": ("counter", "Generated tokens that came from the draft's tree."),
    "specx_pass_seconds_total": ("counter", "Seconds spent in target passes (draft + verify)."),
    "specx_prefill_seconds_total": ("counter", "Seconds spent prefilling."),
    "specx_tokens_per_pass": ("gauge", "Generated tokens per target pass, over all requests."),
    "specx_queue_depth": ("gauge", "Requests waiting for the worker."),
    "specx_busy": ("gauge", "1 while a request is generating."),
    "specx_running_requests": ("gauge", "Requests generating now (up to --parallel)."),
    "specx_forest_passes_total": ("counter", "Target passes shared by the requests decoding at once (--parallel)."),
    "specx_forest_requests_per_pass": ("gauge", "Requests per shared target pass, on average (--parallel)."),
    "specx_forest_tokens_per_pass": ("gauge", "Tokens all requests got per shared target pass (--parallel)."),
    "specx_ready": ("gauge", "1 once the models are loaded."),
    "specx_prompt_cache_requests_total": (
        "counter",
        "Requests that consulted the prompt cache (host-RAM KV snapshots).",
    ),
    "specx_prompt_cache_hits_total": ("counter", "Requests that restored a snapshot from the prompt cache."),
    "specx_prompt_cache_restored_tokens_total": ("counter", "Prompt tokens restored from the prompt cache."),
    "specx_prompt_cache_saves_total": ("counter", "Snapshots kept in the prompt cache."),
    "specx_prompt_cache_evictions_total": ("counter", "Snapshots evicted to make room."),
    "specx_prompt_cache_refused_total": ("counter", "Snapshots not kept (too short, too large, or no room)."),
    "specx_prompt_cache_entries": ("gauge", "Snapshots in the prompt cache."),
    "specx_prompt_cache_bytes": ("gauge", "Host bytes the prompt cache's snapshots take."),
    "specx_prompt_cache_capacity_bytes": ("gauge", "Host bytes the prompt cache may take (--cache-ram)."),
}


REFUSED = ("specx_refused_requests_total", "Requests answered with an error, by HTTP status and error type.")
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)  # seconds (upper bounds)
HISTOGRAMS = {
    "specx_time_to_first_token_seconds": "Seconds from a generation request's arrival to its first token.",
    "specx_request_seconds": "Seconds from a generation request's arrival to its last token.",
}


class Histogram:
    """Cumulative-bucket histogram (Prometheus `le` semantics: a bucket counts values <= its bound)."""

    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)  # per bucket, the last = above every bound (+Inf only)
        self.sum, self.count = 0.0, 0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.sum, self.count = self.sum + value, self.count + 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip([*map(str, BUCKETS), "+Inf"], self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return out + [f"{name}_sum {round(self.sum, 6)}", f"{name}_count {self.count}"]


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()
        self.totals: Counter = Counter()
        self.refusals: Counter = Counter()  # (status, error type) -> answers
        self.histograms = {name: Histogram() for name in HISTOGRAMS}

    def request(self, endpoint: str, outcome: str) -> None:
        with self.lock:
            self.requests[(endpoint, outcome)] += 1

    def refused(self, status: int, kind: str) -> None:
        with self.lock:
            self.refusals[(int(status), kind)] += 1

    def observe(self, name: str, seconds: float) -> None:
        with self.lock:
            self.histograms[name].add(seconds)

    def forest_pass(self, requests: int, tokens: int) -> None:
        """One target pass shared by `requests` requests that got `tokens` tokens from it (scheduler.py)."""
        with self.lock:
            self.totals["specx_forest_passes_total"] += 1
            self.totals["forest_requests"] += requests
            self.totals["forest_tokens"] += tokens

    def finished(self, stats, prompt_tokens: int, cached_tokens: int) -> None:
        view = stats.speculative()
        with self.lock:
            t = self.totals
            t["specx_prompt_tokens_total"] += prompt_tokens
            t["specx_cached_prompt_tokens_total"] += cached_tokens
            t["specx_prefill_tokens_total"] += stats.prompt_tokens
            t["specx_completion_tokens_total"] += stats.new_tokens
            t["specx_target_passes_total"] += stats.target_passes
            t["specx_draft_tokens_proposed_total"] += view["draft_tokens_proposed"]
            t["specx_draft_tokens_accepted_total"] += view["draft_tokens_accepted"]
            t["specx_pass_seconds_total"] += sum(stats.pass_seconds)
            t["specx_prefill_seconds_total"] += stats.prefill_seconds
            t["pass_tokens"] += sum(stats.pass_tokens)

    def render(self, worker) -> str:
        with self.lock:
            values = {k: v for k, v in self.totals.items() if k in HELP}
            passes = self.totals["specx_target_passes_total"]
            values["specx_tokens_per_pass"] = self.totals["pass_tokens"] / passes if passes else 0.0
            prompt = self.totals["specx_prompt_tokens_total"]
            values["specx_prompt_cache_hit_ratio"] = (
                self.totals["specx_cached_prompt_tokens_total"] / prompt if prompt else 0.0
            )
            shared = self.totals["specx_forest_passes_total"]
            values["specx_forest_requests_per_pass"] = self.totals["forest_requests"] / shared if shared else 0.0
            values["specx_forest_tokens_per_pass"] = self.totals["forest_tokens"] / shared if shared else 0.0
            requests = dict(self.requests)
            extra = [f"# HELP {REFUSED[0]} {REFUSED[1]}", f"# TYPE {REFUSED[0]} counter"]
            extra += [f'{REFUSED[0]}{{status="{s}",type="{t}"}} {n}' for (s, t), n in sorted(self.refusals.items())]
            for name, text in HISTOGRAMS.items():
                extra += [f"# HELP {name} {text}", f"# TYPE {name} histogram", *self.histograms[name].lines(name)]
        values.update(
            specx_queue_depth=worker.queue_depth(),
            specx_busy=int(worker.running > 0),
            specx_running_requests=worker.running,
            specx_ready=int(worker.state == "ready"),
        )
        cache = getattr(getattr(worker, "session", None), "prompt_cache", None)
        if cache is not None:
            values.update({f"specx_{k}": v for k, v in cache.metrics().items()})
        lines = []
        for name, (kind, text) in HELP.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            if name == "specx_requests_total":
                lines += [f'{name}{{endpoint="{e}",outcome="{o}"}} {n}' for (e, o), n in sorted(requests.items())]
            else:
                value = values.get(name, 0)
                lines.append(f"{name} {value if isinstance(value, int) else round(value, 6)}")
        return "\n".join(lines + extra) + "\n"
