"""Acceptance rule of the race methods: turn the target's logits over a verified tree into emitted tokens.

Contract: `node_choices` computes, on the target's device and in one batch, the target's token at
every node of the tree: argmax at T = 0, and at T > 0 the coupled draw of sampling.py (the race
argmax p / E with the hash noise of the token's absolute position). `accept_tree` brings that ONE
(n,) vector to the host (one counted copy per pass, `transfers.to_host`, in both modes) and walks
the tree from the root: if the node's token is a child in the tree it descends; otherwise the token
is the bonus token and the walk ends. Every emitted token is an exact sample from the target given
the tokens before it: the tree only caches the target's work, so the output distribution is the
target's, whatever the draft proposed. With a grammar (constrain.py), every node's choice is drawn
from its logits with the tokens the grammar forbids after root -> node at -inf (the node's mask
row, uploaded with the pass's inputs), and the walk ends at a node where the grammar is complete:
the output is exactly the target's constrained decoding. The static-tree methods reuse the walk with their own
per-node choices (methods/common.py: the residual rule, also one batch on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specexec_cli.core import kvcache
from specexec_cli.core.sampling import RACE, PositionNoise, SamplingParams, race_choice
from specexec_cli.core.transfers import to_host, upload
from specexec_cli.core.tree import VerifyTree, attention_mask, verify_columns


@dataclass
class Acceptance:
    """What one target pass produced."""

    tokens: list[int]  # emitted tokens, in order: accepted draft tokens, then the bonus (if drawn)
    path: list[int]  # VerifyTree indices of the accepted draft nodes (root excluded)
    bonus: bool  # True when the last emitted token came from the target, not from the tree


def target_pass(target, cache, vt: VerifyTree, n_past: int, root_pos: int, *extra: torch.Tensor) -> list[torch.Tensor]:
    """The target's one pass over root + tree (cache holding n_past rows, the root at absolute
    position root_pos) → [(n, V) logits, (n,) positions, *extra] on its device. Ids, positions, the
    mask's ancestor columns and the `extra` host tensors go up in ONE counted upload (kvcache.stage)."""
    ids, positions, mask, *extra = verify_inputs(target, vt, n_past, root_pos, *extra)
    return [kvcache.forward(target, cache, ids, positions, mask), positions, *extra]


def verify_inputs(target, vt: VerifyTree, n_past: int, root_pos: int, *extra: torch.Tensor) -> list[torch.Tensor]:
    """target_pass's staged inputs: [ids, (n,) positions, (1, 1, n, n_past + n) mask, *extra]."""
    anc_cols, self_cols, n_cols = verify_columns(vt, n_past)
    ids, positions, anc, own, *extra = kvcache.stage(
        target, vt.tokens, root_pos + vt.depth, anc_cols, self_cols, *extra
    )
    mask = attention_mask(n_past, anc, own, n_cols, kvcache.model_dtype(target), target.device)
    return [ids, positions, mask, *extra]


def node_choices(
    logits: torch.Tensor,
    params: SamplingParams,
    noise: PositionNoise | None,
    first_pos: int,
    depth: torch.Tensor,
    max_depth: int,
    bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """(n, V) target logits → (n,) long target tokens on the logits' device (module docstring).

    depth: (n,) long node depths ON the logits' device (root = 0; node i's token lands at absolute
    position first_pos + depth[i]); max_depth: their maximum, known on the host. bits: (n, W) int32
    grammar masks on the device, row i = the grammar after root -> node i (None = unconstrained).
    """
    if params.greedy:
        return race_choice(logits, params, None, None, bits)
    rows = noise.block(first_pos, max_depth + 1, logits.shape[-1], logits.device, RACE)  # (D + 1, V)
    return race_choice(logits, params, rows, depth, bits)


def walk(vt: VerifyTree, choice: list[int], eos_ids: frozenset[int], limit: int, ends=frozenset()) -> Acceptance:
    """Walk down the tree reading each node's chosen token; emit at most `limit`, stop after an EOS
    or on reaching a node of `ends` (VerifyTree indices where a grammar is complete)."""
    tokens: list[int] = []
    path: list[int] = []
    node = 0
    while len(tokens) < limit:
        tok = int(choice[node])
        tokens.append(tok)
        hit = ((vt.parents == node) & (vt.tokens == tok)).nonzero()  # the node's child carrying tok
        if hit.numel() == 0:
            return Acceptance(tokens, path, bonus=True)
        child = int(hit[0, 0])
        path.append(child)
        node = child
        if tok in eos_ids or child in ends:
            break
    return Acceptance(tokens, path, bonus=False)


def accept_tree(
    vt: VerifyTree,
    logits: torch.Tensor,
    params: SamplingParams,
    noise: PositionNoise | None,
    first_pos: int,
    eos_ids: frozenset[int],
    limit: int,
    depth: torch.Tensor | None = None,
    bits: torch.Tensor | None = None,
    ends=frozenset(),
) -> Acceptance:
    """Choose every node's token on the device, copy the (n,) vector once, walk (module docstring).

    logits: (n, V) target logits, row i = the distribution after VerifyTree node i; the token
    drawn at node i lands at absolute position first_pos + depth(i) (the root's child: first_pos).
    depth: vt.depth already on the logits' device (staged with the pass's inputs); None = uploaded here.
    bits: (n, W) int32 grammar masks on the logits' device (constrain.py), ends: VerifyTree indices
    where the grammar is complete (the walk stops there); None / empty = unconstrained.
    """
    if depth is None and not params.greedy:
        (depth,) = upload(logits.device, vt.depth)
    choice = node_choices(logits, params, noise, first_pos, depth, int(vt.depth.max()), bits)
    return walk(vt, to_host(choice.to(torch.int32)).tolist(), eos_ids, limit, ends)
