"""Per-token log-probabilities of emitted tokens, from logits a pass already computed (no extra pass).

Contract: `token_logprobs(logits, rows, tokens, k)`: log_softmax of the RAW logits (float32; before
temperature, top-k, top-p and any grammar mask, as OpenAI and vLLM report them) at row rows[i], the
distribution tokens[i] was drawn from; on the logits' device, one counted (R, 1 + 2k) copy to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specexec_cli.core.transfers import to_host


@dataclass
class TokenLogprob:
    """One emitted token's log-probability under the target, and the k most likely alternatives."""

    token: int  # the emitted token id
    logprob: float  # log p(token) under the target's raw logits (natural log, <= 0)
    top: list[tuple[int, float]] = field(default_factory=list)  # k (token id, logprob) pairs, most likely first


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], k: int) -> list[TokenLogprob]:
    """(n, V) logits on any device -> one TokenLogprob per (rows[i], tokens[i]) with its top-k."""
    if not tokens:
        return []
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    tok = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)  # (R, V)
    k = max(0, min(int(k), lp.shape[-1]))
    cols = [lp.gather(1, tok[:, None])]  # (R, 1)
    if k:
        top = torch.topk(lp, k, dim=-1)  # ids travel as float64 next to the values (exact)
        cols += [top.values, top.indices]
    host = to_host(torch.cat([c.double() for c in cols], dim=1))  # (R, 1 + 2k)
    out = []
    for r, t in enumerate(tokens):
        pairs = [(int(host[r, 1 + k + j]), float(host[r, 1 + j])) for j in range(k)]
        out.append(TokenLogprob(int(t), float(host[r, 0]), pairs))
    return out
