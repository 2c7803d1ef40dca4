"""Token-tree tensors: node storage, ancestor sets, tree attention masks and positions.

Contract: a tree is flat CPU tensors indexed by node id in creation order (a parent's id is smaller
than its children's; node 0 is the root, parent -1). Python loops run over depth, never node pairs.
Masks are built on the model's device; only the (B, depth) ancestor table crosses (none when staged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specexec_cli.core.transfers import upload


@dataclass
class Tree:
    """A growing draft tree. All tensors are 1-D over node ids, on the CPU."""

    tokens: torch.Tensor  # (N,) long, token id of each node; node 0 is the root (last committed token)
    parents: torch.Tensor  # (N,) long, parent node id; -1 for the root
    depth: torch.Tensor  # (N,) long, root = 0
    logp: torch.Tensor  # (N,) float, cumulative log score of the path root → node (draft or calibrated)
    slot: torch.Tensor  # (N,) long, position of the node's K/V in the draft's tree cache; -1 = not run yet
    feat: torch.Tensor  # (N,) long, calibration feature the node was scored with (calibrate.py); -1 = none
    n_slots: int = 0  # how many nodes the draft has run (its cached tree tokens)

    @classmethod
    def new(cls, root_token: int) -> Tree:
        long: dict[str, Any] = dict(dtype=torch.long)
        return cls(
            tokens=torch.tensor([root_token], **long),
            parents=torch.tensor([-1], **long),
            depth=torch.zeros(1, **long),
            logp=torch.zeros(1),
            slot=torch.full((1,), -1, **long),
            feat=torch.full((1,), -1, **long),
        )

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    def add(self, parents: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor, feat=None) -> torch.Tensor:
        """Append nodes (vectorised); returns their new ids. `logp` is cumulative."""
        start = self.size
        feat = torch.full_like(tokens, -1, dtype=torch.long) if feat is None else feat.long()
        self.feat = torch.cat([self.feat, feat])
        self.tokens = torch.cat([self.tokens, tokens.long()])
        self.parents = torch.cat([self.parents, parents.long()])
        self.depth = torch.cat([self.depth, self.depth[parents] + 1])
        self.logp = torch.cat([self.logp, logp.float()])
        self.slot = torch.cat([self.slot, torch.full_like(tokens, -1, dtype=torch.long)])
        return torch.arange(start, self.size)

    def mark_run(self, nodes: torch.Tensor) -> None:
        """Record that the draft has just run `nodes` (appended to its cache in this order)."""
        self.slot[nodes] = torch.arange(self.n_slots, self.n_slots + nodes.numel())
        self.n_slots += int(nodes.numel())


def ancestors(parents: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """(B,) node ids -> (B, D) their proper ancestors (parent first), padded with -1; D iterations."""
    cols = []
    cur = parents[nodes]
    while bool((cur >= 0).any()):
        cols.append(cur)
        cur = torch.where(cur >= 0, parents[cur.clamp(min=0)], cur)
    if not cols:
        return torch.full((nodes.numel(), 0), -1, dtype=torch.long)
    return torch.stack(cols, dim=1)


def attention_mask(
    n_past: int, anc_cols: torch.Tensor, self_cols: torch.Tensor, n_cols: int, dtype: torch.dtype, device=None
) -> torch.Tensor:
    """Additive (1, 1, B, n_cols) mask: row i sees columns [0, n_past), anc_cols[i] (B, D; -1 = none)
    and self_cols[i]; everything else is dtype-min."""
    b = self_cols.numel()
    device = torch.device("cpu") if device is None else torch.device(device)
    anc_cols, self_cols = upload(device, anc_cols, self_cols)  # (B, D), (B,): one small copy
    allowed = torch.zeros(b, n_cols, dtype=torch.bool, device=device)
    allowed[:, :n_past] = True
    # scatter each row's ancestor columns; padding (-1) goes to a spare column that is cut off
    allowed = torch.cat([allowed, torch.zeros(b, 1, dtype=torch.bool, device=device)], dim=1)
    allowed.scatter_(1, torch.where(anc_cols >= 0, anc_cols, n_cols), True)
    allowed = allowed[:, :n_cols]
    allowed.scatter_(1, self_cols[:, None], True)  # a scatter, not an index_put: no host sync on CUDA
    # allocated at a width rounded up to 8 and passed as a slice: SDPA's memory-efficient kernel
    # copies a mask whose row stride is not a multiple of 8 (offload/arch/attention.py)
    mask = torch.zeros(b, -(-n_cols // 8) * 8, dtype=dtype, device=device)[:, :n_cols]
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def causal_mask(n_past: int, n_new: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive (1, 1, n_new, n_past + n_new) mask for a plain chain of new tokens."""
    rows = torch.arange(n_new, device=device).unsqueeze(1)
    cols = torch.arange(n_past + n_new, device=device).unsqueeze(0)
    mask = torch.zeros(n_new, -(-(n_past + n_new) // 8) * 8, dtype=dtype, device=device)[:, : n_past + n_new]
    mask.masked_fill_(cols > rows + n_past, torch.finfo(dtype).min)
    return mask[None, None]


def top_budget(logp: torch.Tensor, budget: int) -> torch.Tensor:
    """Ids of the `budget` best non-root nodes, in creation order; ancestor-closed (a child never outscores
    its parent, and the stable sort puts parents first on ties)."""
    order = torch.sort(-logp[1:], stable=True).indices[:budget] + 1
    return torch.sort(order).values


@dataclass
class VerifyTree:
    """The token tree the target verifies: the root plus the kept draft nodes, as one batch."""

    tokens: torch.Tensor  # (n,) long; index 0 = root, then kept nodes in creation order
    parents: torch.Tensor  # (n,) long local parent index; -1 for the root
    depth: torch.Tensor  # (n,) long, root = 0
    draft_ids: torch.Tensor  # (n,) long, node id in the draft Tree (for draft-cache compaction)

    @property
    def size(self) -> int:
        return int(self.tokens.numel())


def subtree(tree: Tree, keep: torch.Tensor) -> VerifyTree:
    """Restrict `tree` to root + `keep` (an ancestor-closed id set in creation order)."""
    ids = torch.cat([torch.zeros(1, dtype=torch.long), keep])
    local = torch.full((tree.size,), -1, dtype=torch.long)
    local[ids] = torch.arange(ids.numel())
    par = tree.parents[ids]
    return VerifyTree(
        tokens=tree.tokens[ids],
        parents=torch.where(par >= 0, local[par.clamp(min=0)], par),
        depth=tree.depth[ids],
        draft_ids=ids,
    )


def verify_columns(vt: VerifyTree, n_past: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`attention_mask`'s host inputs for the target's pass: (n, D) ancestor columns, (n,) own columns, width."""
    idx = torch.arange(vt.size)
    anc = ancestors(vt.parents, idx)
    return torch.where(anc >= 0, anc + n_past, anc), idx + n_past, n_past + vt.size
