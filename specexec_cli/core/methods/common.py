"""Pieces shared by the sampled-tree methods: method settings and the multi-step residual rule.

Contract:
- `MethodSettings.of(cfg)` reads the method options `with_settings` stored in `GenerationConfig.extra`.
- Multi-step speculative sampling (SpecInfer, arXiv 2305.09781; Sequoia, arXiv 2402.12374) at a node
  with target p and draft q, children x_1..x_k drawn from q WITHOUT replacement
  (q_1 = q, q_{i+1} = norm(q_i with x_i zeroed)):
      for i = 1..k: accept x_i with prob min(1, p_i(x_i) / q_i(x_i)); else p_{i+1} = norm(max(0, p_i - q_i))
      if every child is rejected, emit a sample of the last residual p_{k+1}.
  Step i is one round of ordinary speculative sampling (target p_i, draft q_i); a rejected x_i has
  p_{i+1}(x_i) = 0, so zeroing it in q loses nothing: the emitted token is an exact sample of p.
- Decoding runs the rule on the device for every node at once (`static_choices`, one (n,) copy per
  pass, walked by verify.walk): children by Gumbel-top-k of q (CHILDREN stream of sampling.py's hash),
  acceptance uniforms from ACCEPT, the final residual by the race with RESIDUAL; each stream is keyed
  by the children's absolute position (fresh randomness given the emitted prefix: lossless).
  `sample_children`/`choose_child` are the host version (Sequoia's acceptance measurement).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specexec_cli.core.sampling import ACCEPT, RESIDUAL, PositionNoise, SamplingParams, process_logits, race_uniform
from specexec_cli.core.transfers import to_host
from specexec_cli.core.tree import VerifyTree
from specexec_cli.core.verify import Acceptance, walk


@dataclass(frozen=True)
class MethodSettings:
    """Options of the extra methods, carried in GenerationConfig.extra."""

    gamma: int = 5  # chain: draft tokens proposed per target pass
    branching: tuple[int, ...] = ()  # specinfer: children per node at each level; () = derived from budget
    sequoia_profile: str | None = None  # JSON file caching Sequoia's acceptance vectors (used if it exists)

    @classmethod
    def of(cls, cfg) -> MethodSettings:
        extra = getattr(cfg, "extra", None) or {}
        return cls(
            gamma=int(extra.get("gamma", cls.gamma)),
            branching=tuple(int(b) for b in extra.get("branching", ())),
            sequoia_profile=extra.get("sequoia_profile"),
        )


def with_settings(cfg, **options):
    """A copy of `cfg` whose `extra` holds `options` (None values are dropped)."""
    extra = {**(getattr(cfg, "extra", None) or {}), **{k: v for k, v in options.items() if v is not None}}
    return replace(cfg, extra=extra)


def flag_options(gamma: int, branching: str | None, profile) -> dict:
    """CLI flags → `with_settings` options (γ, branching widths, the profile that caches Sequoia's vector)."""
    if gamma < 1:
        raise ValueError(f"--gamma must be >= 1 (got {gamma})")
    widths = parse_branching(branching) if branching else None
    return dict(gamma=gamma, branching=widths, sequoia_profile=str(profile) if profile else None)


def parse_branching(text: str) -> tuple[int, ...]:
    """'4,2,2,1' → (4, 2, 2, 1); raises ValueError with the fix on bad input."""
    try:
        widths = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"--branching must be comma-separated integers like 4,2,2,1 (got {text!r})") from None
    if not widths or min(widths) < 1:
        raise ValueError(f"--branching needs at least one level and widths >= 1 (got {text!r})")
    return widths


def without(q: torch.Tensor, x: int) -> torch.Tensor:
    """q with token x removed, renormalised: the distribution of the next draw without replacement."""
    q = q.clone()
    q[x] = 0.0
    total = q.sum()
    return q / total if total > 0 else q


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); falls back to p when the difference vanishes (then p == q numerically)."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return r / total if total > 0 else p


def sample_children(q: torch.Tensor, k: int, gen: torch.Generator) -> list[int]:
    """Up to k distinct tokens drawn one by one from q without replacement (fewer if q's support is small)."""
    k = min(k, int((q > 0).sum()))
    if k <= 0:
        return []
    # torch.multinomial without replacement draws sequentially from the renormalised remainder
    return [int(t) for t in torch.multinomial(q, k, replacement=False, generator=gen)]


def choose_child(p: torch.Tensor, q: torch.Tensor, children: list[int], gen: torch.Generator):
    """The multi-step rule at one node → (index of the accepted child or -1, final residual p)."""
    for i, x in enumerate(children):
        u = float(torch.rand(1, generator=gen))
        if q[x] > 0 and u * float(q[x]) < float(p[x]):  # u < p/q without dividing
            return i, p
        p, q = residual(p, q), without(q, x)
    return -1, p


def residual_rows(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise `residual`: (R, V) norm(max(0, p - q)), p where the difference vanishes."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def without_rows(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Row-wise `without`: (R, V) q with token x[r] removed from row r, renormalised."""
    q = q.scatter(1, x[:, None], 0.0)
    total = q.sum(-1, keepdim=True)
    return torch.where(total > 0, q / total.clamp(min=1e-30), q)


def residual_choices(p: torch.Tensor, q: torch.Tensor, kids: torch.Tensor, key: int, pos: torch.Tensor):
    """The multi-step rule at R nodes on the device → ((R,) accepted child token or -1, (R, V) final residual).

    p, q: (R, V) processed target and draft rows; kids: (R, K) child tokens in rank order (-1 = none);
    pos: (R,) the children's absolute position. Child x's uniform is the ACCEPT hash of (key, pos, x).
    """
    accepted = torch.full((kids.shape[0],), -1, dtype=torch.long, device=kids.device)
    for i in range(kids.shape[1]):
        x = kids[:, i].clamp(min=0)
        open_ = (kids[:, i] >= 0) & (accepted < 0)  # rows still deciding, with an i-th child
        px = p.gather(1, x[:, None])[:, 0].double()
        qx = q.gather(1, x[:, None])[:, 0].double()
        u = race_uniform(key, ACCEPT, pos, x)  # (R,) float64
        hit = open_ & (qx > 0) & (u * qx < px)  # u < p/q without dividing
        accepted = torch.where(hit, x, accepted)
        step = (open_ & ~hit)[:, None]  # rejected: p ← residual, q ← q without x
        p, q = torch.where(step, residual_rows(p, q), p), torch.where(step, without_rows(q, x), q)
    return accepted, p


def static_choices(
    logits: torch.Tensor,
    params: SamplingParams,
    noise: PositionNoise,
    first_pos: int,
    depth: torch.Tensor,
    max_depth: int,
    inner: torch.Tensor,
    kids: torch.Tensor,
    q: torch.Tensor,
) -> torch.Tensor:
    """(n, V) target logits → (n,) device tokens: a node's accepted child, else a draw (argmax(r / E),
    RESIDUAL noise) from its final residual r (p at a leaf). depth: (n,); inner: (R,) nodes with
    children; kids: (R, K) their child tokens (-1 = none); q: (R, V) their processed draft rows.
    """
    p = process_logits(logits, params)  # (n, V)
    accepted, final = residual_choices(
        p.index_select(0, inner), q.to(p.device), kids, noise.key, depth.index_select(0, inner) + first_pos
    )
    p = p.index_copy(0, inner, final)
    rows = noise.block(first_pos, max_depth + 1, p.shape[-1], p.device, RESIDUAL)  # (D + 1, V)
    draw = (p / rows.index_select(0, depth)).argmax(-1)  # (n,) residual draws
    return draw.index_copy(0, inner, torch.where(accepted >= 0, accepted, draw.index_select(0, inner)))


def accept_static(
    vt: VerifyTree,
    logits: torch.Tensor,
    params: SamplingParams,
    noise: PositionNoise,
    first_pos: int,
    staged: tuple,
    q: torch.Tensor,
    eos_ids: frozenset[int],
    limit: int,
) -> Acceptance:
    """Every node's token on the device (`static_choices`), ONE (n,) copy to the host, then the walk
    of verify.py. staged: (depth, inner, kids) on the device (see `static_choices`)."""
    depth, inner, kids = staged
    choice = static_choices(logits, params, noise, first_pos, depth, int(vt.depth.max()), inner, kids, q)
    return walk(vt, to_host(choice.to(torch.int32)).tolist(), eos_ids, limit)


def child_table(vt: VerifyTree) -> tuple[torch.Tensor, torch.Tensor]:
    """Host (R,) indices of the nodes with children and (R, K) their child tokens in rank order
    (creation order), padded with -1."""
    inner = torch.unique(vt.parents[1:]) if vt.size > 1 else torch.zeros(0, dtype=torch.long)
    kids = [vt.tokens[vt.parents == i].tolist() for i in inner.tolist()]
    width = max((len(k) for k in kids), default=0)
    return inner, torch.tensor([k + [-1] * (width - len(k)) for k in kids], dtype=torch.long).reshape(len(kids), width)
