"""Pieces shared by the sampled-tree methods: method settings, the multi-step residual rule, commits.

Contract:
- `MethodSettings.of(cfg)` reads the method options stored in `GenerationConfig.extra`
  (`with_settings` writes them); defaults apply when a key is absent.
- Multi-step speculative sampling (SpecInfer, arXiv 2305.09781; Sequoia, arXiv 2402.12374) at one
  node with target distribution p and draft distribution q, whose children x_1..x_k were drawn from
  q WITHOUT replacement (x_i ~ q_i, q_1 = q, q_{i+1} = norm(q_i with x_i zeroed)):
      for i = 1..k: accept x_i with prob min(1, p_i(x_i) / q_i(x_i)); else p_{i+1} = norm(max(0, p_i - q_i))
      if every child is rejected, emit a sample of the last residual p_{k+1}.
  Given x_1..x_{i-1} (all rejected), step i is one round of ordinary speculative sampling with
  target p_i and draft q_i, and a rejected x_i has p_{i+1}(x_i) = 0 (rejection needs p_i(x_i) < q_i(x_i)),
  so zeroing it in q loses nothing: the emitted token is an exact sample of p. `sample_children` and
  `choose_child` use the same `without` update, so the q_i of verification is the q_i of sampling.
- `commit` trims both caches to the accepted path exactly as `engine.speculative_step` does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specexec_cli.core.engine import commit_tree
from specexec_cli.core.sampling import SamplingParams, process_logits, sample
from specexec_cli.core.transfers import to_host
from specexec_cli.core.tree import Tree, VerifyTree
from specexec_cli.core.verify import Acceptance


@dataclass(frozen=True)
class MethodSettings:
    """Options of the extra methods, carried in GenerationConfig.extra."""

    gamma: int = 5  # chain: draft tokens proposed per target pass
    branching: tuple[int, ...] = ()  # specinfer: children per node at each level; () = derived from budget
    sequoia_profile: str | None = None  # JSON file caching Sequoia's acceptance vectors (used if it exists)

    @classmethod
    def of(cls, cfg) -> "MethodSettings":
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
    """CLI flags → the `extra` dict (γ, branching widths, the profile that caches Sequoia's vector)."""
    if gamma < 1:
        raise ValueError(f"--gamma must be >= 1 (got {gamma})")
    widths = parse_branching(branching) if branching else None
    options = dict(gamma=gamma, branching=widths, sequoia_profile=str(profile) if profile else None)
    return {k: v for k, v in options.items() if v is not None}


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


def children_of(vt: VerifyTree, node: int) -> list[int]:
    """VerifyTree indices of `node`'s children in creation order (= sampling rank)."""
    return [int(c) for c in (vt.parents == node).nonzero().flatten()]


def accept_sampled(
    vt: VerifyTree,
    logits: torch.Tensor,
    qrows: dict[int, torch.Tensor],
    params: SamplingParams,
    gen: torch.Generator,
    eos_ids: frozenset[int],
    limit: int,
) -> Acceptance:
    """Walk a tree of children sampled w/o replacement from q (T > 0); emit at most `limit` tokens.

    logits: (n, V) target logits over the VerifyTree; qrows: VerifyTree index → (V,) processed
    draft distribution at that node (present for every node that has children).
    """
    tokens: list[int] = []
    path: list[int] = []
    node = 0
    while len(tokens) < limit:
        p = to_host(process_logits(logits[node], params))
        kids = children_of(vt, node)
        pick, p = choose_child(p, qrows[node], [int(vt.tokens[c]) for c in kids], gen) if kids else (-1, p)
        if pick < 0:
            tokens.append(sample(p, gen))
            return Acceptance(tokens, path, bonus=True)
        node = kids[pick]
        tokens.append(int(vt.tokens[node]))
        path.append(node)
        if tokens[-1] in eos_ids:
            break
    return Acceptance(tokens, path, bonus=False)


def commit(st, tree: Tree, vt: VerifyTree, acc: Acceptance, n_pending: int) -> None:
    """Keep the accepted path in both caches; see engine.commit_tree (one implementation)."""
    commit_tree(st, tree, vt, acc, n_pending)
