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

    def ancestor_cols(self, nodes: torch.Tensor, base: int) -> torch.Tensor:
        """(B,) nodes -> (B, D) draft-cache columns of their proper ancestors (all run), -1 padded: a run
        node's K/V sits at row base + slot, base = the root's row (slot 0)."""
        anc = ancestors(self.parents, nodes)
        return torch.where(anc >= 0, base + self.slot[anc.clamp(min=0)], anc)


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
    device = torch.device("cpu") if device is None else torch.device(device)
    anc_cols, self_cols = upload(device, anc_cols, self_cols)  # (B, D), (B,): one small copy
    mask = padded_mask(self_cols.numel(), n_cols, dtype, device)
    build_mask(mask, self_cols, self_cols.numel(), n_past, n_past, anc_cols, causal=False)
    return mask[None, None]


def causal_mask(n_past: int, n_new: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive (1, 1, n_new, n_past + n_new) mask for a plain chain of new tokens."""
    mask = padded_mask(n_new, n_past + n_new, dtype, device)
    build_mask(mask, torch.arange(n_past, n_past + n_new, device=device), n_new, n_past, n_past, None, causal=True)
    return mask[None, None]


def padded_mask(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised (rows, cols) slice of a store whose width is rounded up to 8: SDPA's
    memory-efficient kernel copies a mask whose row stride is not a multiple of 8 (offload/arch/attention.py)."""
    return torch.empty(rows, -(-cols // 8) * 8, dtype=dtype, device=device)[:, :cols]


def build_mask(m: torch.Tensor, rows: torch.Tensor, b: int, n_past: int, start: int, anc, causal: bool) -> None:
    """Fill the (P, K) additive mask `m` in place: row i < B sees columns [0, n_past), its ancestors'
    (row i of the (B, D) device table `anc` of columns, -1 = none; None = none), its own column rows[i]
    and, with `causal`, columns start .. start + i; padded rows i >= B see their own column only.
    Scatters and slice fills only: no host sync on CUDA."""
    m.fill_(torch.finfo(m.dtype).min)
    m[:b, :n_past] = 0
    if causal:  # the (B, P) block of new columns is all dtype-min: triu_(1) zeroes j <= i (row i sees start + j)
        m[:b, start : start + m.shape[0]].triu_(1)
    if anc is not None and anc.shape[1]:  # padding (-1) points at the row's own column, seen anyway
        m[:b].scatter_(1, torch.where(anc >= 0, anc, rows[:b, None]), 0.0)
    m.scatter_(1, rows[:, None], 0.0)


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
