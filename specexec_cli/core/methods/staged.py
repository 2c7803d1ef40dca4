"""Staged speculative decoding (arXiv 2308.04623) on top of the SpecExec tree.

Three models in a cascade:
  stage 1  the TARGET verifies the draft's token tree in one pass (`verify.accept_tree`: lossless);
  stage 2  the DRAFT grows the tree as `draft.grow_tree` does (SpecExec's cumulative-probability rule);
  stage 3  an N-GRAM model (prompt lookup, `ngram.NgramIndex`) proposes up to `CHAIN_LEN` tokens below
           each node the draft is about to expand; they ride in the SAME draft forward (tree mask: a
           proposal sees the prefix, the node's ancestors, the node and the earlier proposals). A
           proposal the draft itself put in the tree under the previously accepted node is accepted:
           its logits are the ones a later forward would compute, so it is expanded at once and marked
           run. The walk stops at the first proposal the draft did not keep; rejected rows leave the
           draft cache (`kvcache.compact`).
A step's first forward runs the pending tokens and the root's chain causally together; pruning and
verification are `engine.speculative_step`'s, and the draft cache keeps the engine's layout.
"""

from __future__ import annotations

import torch

from specexec_cli.core import draftstep, kvcache
from specexec_cli.core.draft import DraftContext, Scoring, TreeShape, expand, run_pending, step_batch
from specexec_cli.core.engine import speculative_step
from specexec_cli.core.ngram import NgramIndex
from specexec_cli.core.tree import Tree

CHAIN_LEN = 8  # tokens proposed per node


def accept_chain(
    tree: Tree, parent: int, chain: list[int], logits: torch.Tensor, shape, params
) -> list[tuple[int, int]]:
    """Walk a proposed chain under `parent`; returns [(node, chain index)] the draft kept (expanded)."""
    kept = []
    for j, tok in enumerate(chain):
        hit = ((tree.parents == parent) & (tree.tokens == tok) & (tree.slot < 0)).nonzero()
        if hit.numel() == 0 or int(tree.depth[int(hit[0, 0])]) >= shape.max_depth:
            break
        parent = int(hit[0, 0])
        expand(tree, torch.tensor([parent]), logits[j][None], shape, params)
        kept.append((parent, j))
    return kept


def commit_chains(tree: Tree, cache, start: int, kept: list[tuple[int, int]]) -> None:
    """Keep only the accepted proposal rows (absolute, ascending) after `start`; give them slots."""
    rows = torch.tensor([r for _, r in kept], dtype=torch.long)
    kvcache.compact(cache, start, rows)
    if kept:
        tree.mark_run(torch.tensor([n for n, _ in kept]))


def first_forward(draft, cache, ctx: DraftContext, tree: Tree, shape, params, ngram: NgramIndex) -> None:
    """Pending tokens + the root's proposed chain, causally, in one forward; expand the root."""
    chain = ngram.propose(ngram.ids, min(CHAIN_LEN, shape.max_depth - 1))
    logits = run_pending(draft, cache, ctx, after=chain)[0]
    base = ctx.n_cached + len(ctx.pending) - 1  # row of the root
    tree.mark_run(torch.zeros(1, dtype=torch.long))
    expand(tree, torch.zeros(1, dtype=torch.long), logits[len(ctx.pending) - 1][None], shape, params)
    kept = accept_chain(tree, 0, chain, logits[len(ctx.pending) :], shape, params)
    commit_chains(tree, cache, base + 1, [(n, base + 1 + j) for n, j in kept])


def batch_rows(tree: Tree, nodes: torch.Tensor, chains: list[list[int]], base: int):
    """(R,) tokens, (R,) depths and the (R, D) columns each row sees beyond the prefix (-1 = none)
    for the B nodes then their chains, in one draft step: a node sees its ancestors, a chain token
    also the node and the chain's earlier tokens. Row r's own column is base + n_slots + r, where
    the step writes it (the draft cache's length)."""
    col0 = base + tree.n_slots  # first new column
    anc_cols = tree.ancestor_cols(nodes, base).tolist()
    toks, pos, rows_anc = tree.tokens[nodes].tolist(), tree.depth[nodes].tolist(), list(anc_cols)
    col = col0 + nodes.numel()
    for i, chain in enumerate(chains):
        seen = [c for c in anc_cols[i] if c >= 0] + [col0 + i]  # node's ancestors + the node itself
        for j, tok in enumerate(chain):
            toks.append(tok)
            pos.append(pos[i] + 1 + j)
            rows_anc.append(list(seen))
            seen.append(col + j)
        col += len(chain)
    width = max((len(r) for r in rows_anc), default=0)
    padded = torch.tensor([r + [-1] * (width - len(r)) for r in rows_anc], dtype=torch.long).reshape(len(toks), width)
    return torch.tensor(toks), torch.tensor(pos), padded


def grow_staged(
    draft, cache, ctx: DraftContext, shape: TreeShape, params, ngram: NgramIndex, committed: list[int]
) -> Tree:
    """SpecExec tree growth with n-gram proposals verified by the draft in batch (module docstring)."""
    tree = Tree.new(ctx.pending[-1])
    base = ctx.n_cached + len(ctx.pending) - 1
    first_forward(draft, cache, ctx, tree, shape, params, ngram)
    lookup = Scoring(committed=committed)  # its `tail`: the n-gram key of committed + a node's path
    for _ in range(shape.max_depth + shape.budget):
        nodes = step_batch(tree, shape)
        if nodes.numel() == 0:
            break
        room = shape.max_beams  # proposal tokens per forward, best nodes first
        chains = []
        for node in nodes.tolist():
            want = min(CHAIN_LEN, room, shape.max_depth - int(tree.depth[node]) - 1)
            chain = ngram.propose(lookup.tail(tree, node, ngram.n), want) if want > 0 else []
            chains.append(chain)
            room -= len(chain)
        toks, depth, anc_cols = batch_rows(tree, nodes, chains, base)
        logits = draftstep.run(draft, cache, toks, ctx.root_pos + depth, base, anc_cols)[0]  # (R, V)
        b = nodes.numel()
        tree.mark_run(nodes)
        expand(tree, nodes, logits[:b], shape, params)
        kept, offset = [], b
        for node, chain in zip(nodes.tolist(), chains):
            kept += [
                (n, base + tree.n_slots + offset - b + j)
                for n, j in accept_chain(tree, node, chain, logits[offset : offset + len(chain)], shape, params)
            ]
            offset += len(chain)
        commit_chains(tree, cache, base + tree.n_slots, kept)
    return tree


def staged_step(m, st, cfg, gen, limit: int):
    """engine.speculative_step with `grow_staged` in place of `grow_tree`."""

    def grow(m, st, ctx, shape, params, scoring=None):
        return grow_staged(m.draft, st.draft_cache, ctx, shape, params, NgramIndex(st.ids), st.ids)

    return speculative_step(m, st, cfg, gen, limit, grow=grow)
