"""Grow a SpecExec token tree with the draft model.

Contract: `grow_tree` takes the draft's cache (holding `n_cached` committed tokens) and the committed
tokens the draft has not yet run (`pending`, last one = the tree root), and returns a `Tree` of
candidate continuations ranked by cumulative draft log-probability. Each draft forward computes
only new tokens: the pending run first, then at most `max_beams` nodes per step, with a tree mask
over the cached prefix and the already-run tree nodes (arXiv 2406.02532, "SpecExec").
After the call the draft cache holds: prefix + pending + every node with `slot >= 0`, in slot order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specexec_cli import kvcache
from specexec_cli.sampling import SamplingParams, draft_logprobs
from specexec_cli.tree import Tree, ancestors, attention_mask, causal_mask, top_budget


@dataclass(frozen=True)
class TreeShape:
    """Limits on tree growth."""

    budget: int  # draft nodes the target verifies (root excluded)
    max_depth: int  # deepest node, in tokens below the root
    max_beams: int = 32  # nodes expanded per draft forward
    max_branch: int = 32  # children kept per expanded node


@dataclass
class DraftContext:
    """Where the draft's cache stands when growth begins."""

    n_cached: int  # committed tokens already in the draft cache
    pending: list[int]  # committed tokens not in the cache yet; pending[-1] is the tree root
    root_pos: int  # absolute position of the root token


def run_pending(draft, cache, ctx: DraftContext) -> torch.Tensor:
    """Run the pending tokens causally; returns the draft's (V,) logits at the root."""
    tokens = torch.tensor(ctx.pending, dtype=torch.long)
    positions = torch.arange(ctx.root_pos - len(ctx.pending) + 1, ctx.root_pos + 1)
    mask = causal_mask(ctx.n_cached, len(ctx.pending), kvcache.model_dtype(draft))
    return kvcache.forward(draft, cache, tokens, positions, mask)[-1]


def expand(tree: Tree, nodes: torch.Tensor, logits: torch.Tensor, shape: TreeShape, params) -> None:
    """Add the top children of each of `nodes` (B,) given their draft logits (B, V).

    Children whose cumulative score cannot beat the current `budget`-th best node are dropped:
    the threshold only rises as the tree grows, so they could never be kept.
    """
    logp = draft_logprobs(logits, params).cpu()  # (B, V)
    k = min(shape.max_branch, shape.budget, logp.shape[-1])
    top = torch.topk(logp, k, dim=-1)
    cum = tree.logp[nodes].unsqueeze(1) + top.values  # (B, k) cumulative log-probs
    if tree.size - 1 >= shape.budget:
        threshold = torch.topk(tree.logp[1:], shape.budget).values[-1]
        keep = cum > threshold
    else:
        keep = torch.isfinite(cum)
    parents = nodes.unsqueeze(1).expand_as(cum)
    tree.add(parents[keep], top.indices[keep], cum[keep])


def step_batch(tree: Tree, shape: TreeShape) -> torch.Tensor:
    """The best not-yet-run nodes among the current top-`budget`, at most `max_beams` of them."""
    kept = top_budget(tree.logp, shape.budget)
    open_ = kept[(tree.slot[kept] < 0) & (tree.depth[kept] < shape.max_depth)]
    if open_.numel() > shape.max_beams:
        best = torch.topk(tree.logp[open_], shape.max_beams).indices
        open_ = torch.sort(open_[best]).values
    return open_


def grow_tree(draft, cache, ctx: DraftContext, shape: TreeShape, params: SamplingParams) -> Tree:
    """Grow the tree; see the module docstring for the cache layout it leaves behind."""
    tree = Tree.new(ctx.pending[-1])
    base = ctx.n_cached + len(ctx.pending) - 1  # cache index of the root = start of the tree slots
    # 1) the pending run gives the root's distribution; the root is tree slot 0
    root_logits = run_pending(draft, cache, ctx)
    tree.mark_run(torch.zeros(1, dtype=torch.long))
    if shape.max_depth < 1 or shape.budget < 1:
        return tree
    expand(tree, torch.zeros(1, dtype=torch.long), root_logits[None], shape, params)
    dtype = kvcache.model_dtype(draft)
    # 2) expand the best open nodes, one batched draft forward per step
    for _ in range(shape.max_depth + shape.budget):
        nodes = step_batch(tree, shape)
        if nodes.numel() == 0:
            break
        anc = ancestors(tree.parents, nodes)  # (B, D) node ids, all already run
        anc_cols = torch.where(anc >= 0, base + tree.slot[anc.clamp(min=0)], anc)
        self_cols = base + tree.n_slots + torch.arange(nodes.numel())
        n_cols = base + tree.n_slots + nodes.numel()
        mask = attention_mask(base, anc_cols, self_cols, n_cols, dtype)
        positions = ctx.root_pos + tree.depth[nodes]
        logits = kvcache.forward(draft, cache, tree.tokens[nodes], positions, mask)
        tree.mark_run(nodes)
        expand(tree, nodes, logits, shape, params)
    return tree
