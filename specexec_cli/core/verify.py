"""Acceptance rules: turn the target's logits over a verified tree into emitted tokens.

Contract: `accept_tree` walks the tree from the root. At each node it draws the target's token from
the target's processed distribution at that node (argmax when T=0; at T > 0 the coupled draw of
sampling.py with the noise of the token's absolute position). If the token is a child in the tree
it descends; otherwise the token is the bonus token and the walk ends.
Each emitted token is an exact sample from the target given the tokens before it: the tree only
caches the target's work, so the output distribution is the target's, whatever the draft proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specexec_cli.core.sampling import PositionNoise, SamplingParams, coupled_select
from specexec_cli.core.transfers import to_host
from specexec_cli.core.tree import VerifyTree


@dataclass
class Acceptance:
    """What one target pass produced."""

    tokens: list[int]  # emitted tokens, in order: accepted draft tokens, then the bonus (if drawn)
    path: list[int]  # VerifyTree indices of the accepted draft nodes (root excluded)
    bonus: bool  # True when the last emitted token came from the target, not from the tree


def child_with_token(vt: VerifyTree, node: int, token: int) -> int:
    """Index of `node`'s child carrying `token`, or -1."""
    hit = ((vt.parents == node) & (vt.tokens == token)).nonzero()
    return int(hit[0, 0]) if hit.numel() else -1


def accept_tree(
    vt: VerifyTree,
    logits: torch.Tensor,
    params: SamplingParams,
    noise: PositionNoise | None,
    first_pos: int,
    eos_ids: frozenset[int],
    limit: int,
) -> Acceptance:
    """Walk the tree; emit at most `limit` tokens and stop after an EOS.

    logits: (n, V) target logits, row i = the distribution after VerifyTree node i; the token
    drawn at node i lands at absolute position first_pos + depth(i) (the root's child: first_pos).
    """
    if params.greedy:
        choice = to_host(logits.argmax(-1))  # (n,) every node's greedy token: one small copy
    tokens: list[int] = []
    path: list[int] = []
    node = 0
    while len(tokens) < limit:
        if params.greedy:
            tok = int(choice[node])
        else:
            row = to_host(logits[node])
            tok = coupled_select(row, params, noise.at(first_pos + int(vt.depth[node]), row.shape[-1], row.device))
        tokens.append(tok)
        child = child_with_token(vt, node, tok)
        if child < 0:
            return Acceptance(tokens, path, bonus=True)
        path.append(child)
        node = child
        if tok in eos_ids:
            break
    return Acceptance(tokens, path, bonus=False)
