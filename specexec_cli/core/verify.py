"""Acceptance rule of the race methods: turn the target's logits over a verified tree into emitted tokens.

Contract: `node_choices` computes the target's token at every tree node in one batch on its device
(argmax at T = 0, else sampling.py's coupled draw at the token's absolute position); `accept_tree`
copies that (n,) vector to the host once and walks from the root, descending while the chosen token
is a child in the tree; the first that is not is the bonus token. Every emitted token is an exact
sample of the target given its prefix, whatever the draft proposed. With a grammar, each node's
choice is drawn with the tokens its mask row forbids at -inf and the walk ends where the grammar is
complete: exactly the target's constrained decoding. methods/common.py reuses `walk`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specexec_cli.core import kvcache
from specexec_cli.core.sampling import RACE, PositionNoise, SamplingParams, race_choice
from specexec_cli.core.transfers import to_host, upload
from specexec_cli.core.tree import VerifyTree, ancestors, attention_mask


@dataclass
class Acceptance:
    """What one target pass produced."""

    tokens: list[int]  # emitted tokens, in order: accepted draft tokens, then the bonus (if drawn)
    path: list[int]  # VerifyTree indices of the accepted draft nodes (root excluded)
    bonus: bool  # True when the last emitted token came from the target, not from the tree


def target_pass(target, cache, vt: VerifyTree, n_past: int, root_pos: int, *extra: torch.Tensor) -> list[torch.Tensor]:
    """The target's pass over root + tree (n_past cached rows, the root at position root_pos) ->
    [(n, V) logits, (n,) positions, *extra] on its device; inputs in ONE upload (`verify_inputs`)."""
    ids, positions, mask, *extra = verify_inputs(target, vt, n_past, root_pos, *extra)
    return [kvcache.forward(target, cache, ids, positions, mask), positions, *extra]


def verify_inputs(target, vt: VerifyTree, n_past: int, root_pos: int, *extra: torch.Tensor) -> list[torch.Tensor]:
    """target_pass's staged inputs: [ids, (n,) positions, (1, 1, n, n_past + n) mask, *extra]."""
    idx = torch.arange(vt.size)
    anc = ancestors(vt.parents, idx)  # (n, D) tree indices; their mask columns are n_past + index
    ids, positions, anc, own, *extra = kvcache.stage(
        target, vt.tokens, root_pos + vt.depth, torch.where(anc >= 0, anc + n_past, anc), idx + n_past, *extra
    )
    mask = attention_mask(n_past, anc, own, n_past + vt.size, kvcache.model_dtype(target), target.device)
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
    """(n, V) target logits -> (n,) long tokens on their device; node i's lands at first_pos + depth[i]
    (depth on the device, max_depth its host maximum); bits: (n, W) int32 grammar rows or None."""
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
    """Choose every node's token on the device (`node_choices`; `depth`: vt.depth there, None =
    uploaded here), copy the (n,) vector once, walk; `ends`: nodes where the grammar is complete."""
    if depth is None and not params.greedy:
        (depth,) = upload(logits.device, vt.depth)
    choice = node_choices(logits, params, noise, first_pos, depth, int(vt.depth.max()), bits)
    return walk(vt, to_host(choice.to(torch.int32)).tolist(), eos_ids, limit, ends)
