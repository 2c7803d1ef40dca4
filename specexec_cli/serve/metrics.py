"""Prometheus counters of `specx serve` (`GET /metrics`), as views of the requests' RunStats.

Contract: `Metrics.request(endpoint, outcome)` counts finished requests, `Metrics.finished(stats,
prompt_tokens, cached_tokens)` adds one generation's `stats.RunStats`, and `render(worker)` gives
the text exposition format (version 0.0.4) with the live queue depth. Thread-safe; no client library.
"""

from __future__ import annotations

import threading
from collections import Counter

HELP = {
    "specx_requests_total": ("counter", "Finished requests by endpoint and outcome."),
    "specx_prompt_tokens_total": ("counter", "Prompt tokens of all requests."),
    "specx_cached_prompt_tokens_total": ("counter", "Prompt tokens reused from the KV caches (not prefilled)."),
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
    "specx_ready": ("gauge", "1 once the models are loaded."),
}


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()
        self.totals: Counter = Counter()

    def request(self, endpoint: str, outcome: str) -> None:
        with self.lock:
            self.requests[(endpoint, outcome)] += 1

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
            requests = dict(self.requests)
        values.update(specx_queue_depth=worker.queue_depth(), specx_busy=int(worker.busy),
                      specx_ready=int(worker.state == "ready"))  # fmt: skip
        lines = []
        for name, (kind, text) in HELP.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            if name == "specx_requests_total":
                lines += [f'{name}{{endpoint="{e}",outcome="{o}"}} {n}' for (e, o), n in sorted(requests.items())]
            else:
                value = values.get(name, 0)
                lines.append(f"{name} {value if isinstance(value, int) else round(value, 6)}")
        return "\n".join(lines) + "\n"
