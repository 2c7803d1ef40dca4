"""Grow a SpecExec token tree with the draft model, on the draft's device.

Contract: `grow_tree` takes the draft's cache (holding `n_cached` committed tokens) and the committed
tokens it has not run (`pending`, the last one = the root) and returns a `Tree` of candidates ranked by
score (arXiv 2406.02532, "SpecExec"): the pending run, then at most `max_beams` nodes per forward
(`draftstep.run`). Afterwards the draft cache holds prefix + pending + every node with `slot >= 0`, in
slot order. Per forward: one upload and one (B, 2k [+1]) download of scores and ids, whatever the vocabulary.

Scores: without a `Scoring`, a node's cumulative draft log-probability (plain SpecExec); with one,
the cumulative log of its calibrated acceptance probability (`calibrate.Calibration`), and
prompt-lookup proposals (`ngram.NgramIndex`) enter as extra children and chains beyond them. At T > 0
the children are the draft's top-k under the target's coupled-draw noise (computed on the draft's
device), featured by their perturbed score's gap to the best other child (calibrate.coupled_feature).
With a grammar (constrain.GrammarRun) the draft's logits are masked by the expanded nodes' rows, which
ride in the forward's upload: every node of the tree is a grammar-valid continuation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specexec_cli.core import constrain, draftstep
from specexec_cli.core.calibrate import CHAIN_LEN, Calibration, chain_feature, coupled_feature, draft_feature
from specexec_cli.core.ngram import NgramIndex
from specexec_cli.core.sampling import RACE, PositionNoise, SamplingParams, one_thread
from specexec_cli.core.transfers import to_host
from specexec_cli.core.tree import Tree, top_budget


@dataclass(frozen=True)
class TreeShape:
    """Limits on tree growth."""

    budget: int  # draft nodes the target verifies (root excluded)
    max_depth: int  # deepest node, in tokens below the root
    max_beams: int = 32  # nodes expanded per draft forward
    max_branch: int = 32  # children kept per expanded node
    min_prob: float = 0.0  # a node whose score (cumulative draft probability) is below it is not expanded


@dataclass
class DraftContext:
    """Where the draft's cache stands when growth begins."""

    n_cached: int  # committed tokens already in the draft cache
    pending: list[int]  # committed tokens not in the cache yet; pending[-1] is the tree root
    root_pos: int  # absolute position of the root token


@dataclass
class Scoring:
    """Calibrated scores and n-gram branches for one tree (None fields = off)."""

    cal: Calibration | None = None  # acceptance estimates per feature; None = raw draft log-probs
    ngram: NgramIndex | None = None  # prompt lookup over the committed tokens; None = no n-gram branches
    committed: list[int] = field(default_factory=list)  # committed ids (the root is the last one)
    chain_kids: dict = field(default_factory=dict)  # parent node → {token: node} for n-gram chain nodes
    noise: PositionNoise | None = None  # T > 0: the target's coupled-draw noise; None = greedy or uncoupled
    grammar: object = None  # constrain.GrammarRun: n-gram chains are cut where the grammar refuses; None = free

    def tail(self, tree: Tree, node: int, n: int) -> list[int]:
        """The last `n` tokens of committed + the path root → node (the n-gram lookup key)."""
        out = []
        while node > 0 and len(out) < n:
            out.append(int(tree.tokens[node]))
            node = int(tree.parents[node])
        return self.committed[max(0, len(self.committed) - (n - len(out))) :] + out[::-1] if len(out) < n else out[::-1]


@dataclass
class Staged:
    """What one expansion needs beside the logits, prepared before its draft forward."""

    props: list  # per expanded node: (n-gram continuation, match length); [] when n-gram is off
    first: torch.Tensor | None  # (B,) long first proposed token per node (-1 = none), host; None = off
    first_dev: torch.Tensor | None  # the same on the draft's device (staged with the forward's inputs)
    child_pos: torch.Tensor | None  # (B,) long absolute position of each node's children, on the device
    bits: torch.Tensor | None = None  # (B, W) int32 grammar masks of the nodes, on the device; None = free
    bits_host: torch.Tensor | None = None  # the same rows on the host (children checked there)


def run_pending(draft, cache, ctx: DraftContext, *extra: torch.Tensor, after=()):
    """The pending tokens, then `after` (tokens beyond the root), causally -> ((P, V) logits, (P,)
    positions, `extra` staged), on the device."""
    tokens = torch.tensor(ctx.pending + list(after), dtype=torch.long)
    start = ctx.root_pos - len(ctx.pending) + 1
    positions = torch.arange(start, start + tokens.numel())
    return draftstep.run(draft, cache, tokens, positions, ctx.n_cached, None, *extra, causal=True)


def proposals(tree: Tree, nodes: torch.Tensor, shape: TreeShape, scoring) -> tuple[list, torch.Tensor | None]:
    """Per node: its prompt-lookup continuation (capped by the depth left) and match length, and the (B,)
    first proposed tokens (-1 = none); ([], None) when off."""
    if scoring is None or scoring.ngram is None:
        return [], None
    props = []
    for node in nodes.tolist():
        room = min(CHAIN_LEN, shape.max_depth - int(tree.depth[node]))
        props.append(scoring.ngram.match(scoring.tail(tree, node, scoring.ngram.n), room) if room >= 1 else ([], 0))
    return props, torch.tensor([p[0][0] if p[0] else -1 for p in props], dtype=torch.long)


def top_children(
    logits: torch.Tensor, k: int, params: SamplingParams, extra: torch.Tensor | None, noise=None, gaps: bool = False
):
    """(B, V) device logits -> host (B, k) draft log-probs and ids, and (B,) log-probs of `extra` ids.

    With `noise` ((B, V) coupled-draw rows) the ranking is by s = log q - log E. With `gaps` (or
    `noise`) the values are gaps: the top child's s minus the runner-up's (>= 0), every other child's
    (and `extra`'s) s minus the top's (<= 0). One copy: ids ride as float32 (exact below 2^24).
    """
    with one_thread(logits.device):
        t = 1.0 if params.greedy else params.temperature  # log-softmax at the run's temperature (greedy: 1)
        logp = torch.log_softmax(logits.float() / t, dim=-1)  # (B, V), stays on the device
        if noise is not None:  # the draft's race: log q - log E, the target's noise on its (untruncated) log-probs
            logp = logp - noise[:, : logp.shape[-1]].log()
        gaps = gaps or noise is not None
        top = torch.topk(logp, min(k + 1, logp.shape[-1]) if gaps else k, dim=-1)
        values, ids = top.values[:, :k], top.indices[:, :k]
        if gaps:
            runner_up = top.values[:, 1:2] if top.values.shape[1] > 1 else torch.full_like(values[:, :1], float("-inf"))
            values = torch.cat([values[:, :1] - runner_up, values[:, 1:] - values[:, :1]], dim=1)
        cols = [values, ids.to(values.dtype)]
        if extra is not None:  # (B,) long on logp's device
            ex = logp.gather(1, extra.clamp(min=0)[:, None])
            cols.append(ex - top.values[:, :1] if gaps else ex)
        host = to_host(torch.cat(cols, dim=1))
    return host[:, :k], host[:, k : 2 * k].long(), (host[:, 2 * k] if extra is not None else None)


def noise_rows(child_pos: torch.Tensor | None, scoring, shape: TreeShape, vocab: int, device):
    """(B, V) coupled-draw noise of children at the (B,) device positions `child_pos` (calibrated, T > 0), else None."""
    if scoring is None or scoring.cal is None or scoring.noise is None or child_pos is None:
        return None
    first = len(scoring.committed)  # absolute position of the root's children
    rows = scoring.noise.block(first, shape.max_depth + 1, vocab, device, RACE)  # (D + 1, V), as the verify step
    return rows.index_select(0, child_pos - first)


def threshold(tree: Tree, budget: int) -> float:
    """Score a new node must beat to ever be kept: the current budget-th best (it only rises)."""
    if tree.size - 1 < budget:
        return float("-inf")
    return float(torch.topk(tree.logp[1:], budget).values[-1])


def expand(
    tree: Tree,
    nodes: torch.Tensor,
    logits: torch.Tensor,
    shape: TreeShape,
    params,
    scoring=None,
    staged: Staged | None = None,
) -> None:
    """Add the top children of each of `nodes` (B,) given their draft logits (B, V); `staged` None: an
    expansion without proposals or noise (no `scoring`). A child that cannot beat the budget-th best
    score (it only rises) is dropped."""
    k = min(shape.max_branch, shape.budget, logits.shape[-1])
    use_ngram = scoring is not None and scoring.ngram is not None
    staged = staged or Staged([], None, None, None)
    props, first = staged.props, staged.first
    logits = constrain.apply(logits, staged.bits)  # grammar: only valid children (forbidden -> -inf, dropped)
    noise = noise_rows(staged.child_pos, scoring, shape, logits.shape[-1], logits.device)
    gaps = scoring is not None and scoring.cal is not None and (noise is not None or params.greedy)
    vals, idx, extra_lp = top_children(logits, k, params, staged.first_dev, noise, gaps)
    parents = nodes.unsqueeze(1).expand_as(idx)
    if scoring is None or scoring.cal is None:
        cum = valid_only(tree.logp[nodes].unsqueeze(1) + vals, idx, staged)
        add_children(tree, parents, idx, cum, None, shape, scoring)
        return
    flags = torch.zeros_like(idx)
    if use_ngram:
        g = torch.tensor([p[1] for p in props], dtype=torch.long)
        hit = (idx == first[:, None]) & (first[:, None] >= 0)
        flags = torch.where(hit, g[:, None], flags)
        missing = (first >= 0) & ~hit.any(1)  # proposal outside the draft's top-k: one extra child
        idx = torch.cat([idx, torch.where(missing, first, -1)[:, None]], 1)
        vals = torch.cat([vals, extra_lp[:, None]], 1)
        flags = torch.cat([flags, torch.where(missing, g, 0)[:, None]], 1)
        parents = nodes.unsqueeze(1).expand_as(idx)
    feats = coupled_feature(vals, flags) if gaps else draft_feature(vals, flags)
    cum = tree.logp[nodes].unsqueeze(1) + scoring.cal.log_accept()[feats]
    cum = valid_only(torch.where(idx >= 0, cum, float("-inf")), idx, staged)
    add_children(tree, parents, idx, cum, feats, shape, scoring)
    if use_ngram:
        for node, (chain, g) in zip(nodes.tolist(), props):
            if scoring.grammar is not None:  # only the grammar-valid head of the proposal
                chain = chain[: scoring.grammar.valid_prefix(node, chain)]
            add_chain(tree, node, chain, g, shape, scoring)


def valid_only(cum: torch.Tensor, idx: torch.Tensor, staged: Staged) -> torch.Tensor:
    """(B, k) child scores, grammar-forbidden children at -inf (a calibrated score ignores the mask)."""
    if staged.bits_host is None:
        return cum
    return cum.masked_fill(~constrain.host_allowed(staged.bits_host, idx), float("-inf"))


def add_children(tree: Tree, parents, tokens, cum, feats, shape: TreeShape, scoring) -> None:
    """Add (B, k) candidate children above the threshold; n-gram chain nodes already there are re-scored."""
    keep = cum > threshold(tree, shape.budget)
    if scoring is not None and scoring.chain_kids:
        for b in range(parents.shape[0]):
            kids = scoring.chain_kids.get(int(parents[b, 0]))
            if not kids:
                continue
            for j in range(tokens.shape[1]):
                node = kids.get(int(tokens[b, j]))
                if node is not None:  # already in the tree as an n-gram chain node: keep the better score
                    keep[b, j] = False
                    if cum[b, j] > tree.logp[node]:
                        tree.logp[node] = cum[b, j]
                        tree.feat[node] = feats[b, j] if feats is not None else -1
    tree.add(parents[keep], tokens[keep], cum[keep], feats[keep] if feats is not None else None)


def child_of(tree: Tree, parent: int, token: int, scoring: Scoring) -> int:
    """Id of `parent`'s child carrying `token`, or -1 (children of run nodes and chain nodes only)."""
    node = scoring.chain_kids.get(parent, {}).get(token)
    if node is not None:
        return node
    hit = ((tree.parents == parent) & (tree.tokens == token)).nonzero()
    return int(hit[0, 0]) if hit.numel() else -1


def add_chain(tree: Tree, node: int, chain: list[int], g: int, shape: TreeShape, scoring: Scoring) -> None:
    """Grow the n-gram continuation chain[1:] below `node`'s child chain[0] (if that child was kept)."""
    if len(chain) < 2:
        return
    log_acc = scoring.cal.log_accept()
    parent = child_of(tree, node, chain[0], scoring)
    for j, tok in enumerate(chain[1:], start=2):
        if parent < 0:
            return
        existing = child_of(tree, parent, tok, scoring)
        score = tree.logp[parent] + log_acc[chain_feature(g, j)]
        if existing >= 0:
            if score > tree.logp[existing] and int(tree.slot[parent]) < 0:
                tree.logp[existing], tree.feat[existing] = score, chain_feature(g, j)
            parent = existing
            continue
        if score <= threshold(tree, shape.budget):
            return
        new = int(
            tree.add(torch.tensor([parent]), torch.tensor([tok]), score[None], torch.tensor([chain_feature(g, j)]))[0]
        )
        scoring.chain_kids.setdefault(parent, {})[tok] = new
        parent = new


def step_batch(tree: Tree, shape: TreeShape, gain: float = 0.0) -> torch.Tensor:
    """The best not-yet-run nodes among the top-`budget`, at most `max_beams`. Not run: a node whose
    score + `gain` (the most a child can add) cannot beat the budget-th best (no child could be
    kept), and with `min_prob` > 0 one scoring below log(min_prob) (dynamic trees, as EAGLE-2's)."""
    kept = top_budget(tree.logp, shape.budget)
    parent_run = tree.slot[tree.parents[kept].clamp(min=0)] >= 0  # n-gram chain nodes wait for their parent
    useful = tree.logp[kept] + gain > threshold(tree, shape.budget)
    open_ = kept[(tree.slot[kept] < 0) & (tree.depth[kept] < shape.max_depth) & parent_run & useful]
    if shape.min_prob > 0:  # its children could add fewer expected tokens than a draft forward costs
        open_ = open_[tree.logp[open_] > math.log(shape.min_prob)]
    if open_.numel() > shape.max_beams:
        best = torch.topk(tree.logp[open_], shape.max_beams).indices
        open_ = torch.sort(open_[best]).values
    return open_


def grow_tree(
    draft, cache, ctx: DraftContext, shape: TreeShape, params: SamplingParams, scoring=None, grammar=None
) -> Tree:
    """Grow the tree (module docstring); `grammar`: a constrain.GrammarRun at the committed state."""
    tree = Tree.new(ctx.pending[-1])
    if grammar is not None:
        grammar.begin(tree)
        if scoring is not None:
            scoring.grammar = grammar
    gain = float(scoring.cal.log_accept().max()) if scoring is not None and scoring.cal is not None else 0.0
    nodes = torch.zeros(1, dtype=torch.long)  # the root first, then the best open nodes
    for _ in range(shape.max_depth + shape.budget + 1):  # one batched draft forward per step
        logits, staged = run_nodes(draft, cache, ctx, tree, nodes, shape, scoring, grammar)
        if shape.max_depth < 1 or shape.budget < 1:
            break
        expand(tree, nodes, logits, shape, params, scoring, staged)
        nodes = step_batch(tree, shape, gain)
        if nodes.numel() == 0:
            break
    return tree


def run_nodes(draft, cache, ctx: DraftContext, tree: Tree, nodes: torch.Tensor, shape=None, scoring=None, grammar=None):
    """The draft's forward over (B,) not-yet-run `nodes`, marked run -> ((B, V) logits, the `Staged` of
    their expansion). The root (tree slot 0) comes from the pending run; later nodes' K/V go to cache rows
    base + n_slots + i (their own mask columns), base = the root's row. One upload: (B,) ids, (B,)
    positions, (B, D) ancestor columns [, (B,) first proposals][, (B, W) grammar masks]."""
    props, first = proposals(tree, nodes, shape, scoring)
    bits = grammar.bitmask(nodes.tolist()) if grammar is not None else None  # (B, W) host
    staged = [t for t in (first, bits) if t is not None]
    if tree.n_slots == 0:
        logits, positions, extra = run_pending(draft, cache, ctx, *staged)
        logits, positions = logits[-1:], positions[-1:]  # the root's
    else:
        base = ctx.n_cached + len(ctx.pending) - 1
        tokens, positions = tree.tokens[nodes], ctx.root_pos + tree.depth[nodes]
        anc_cols = tree.ancestor_cols(nodes, base)
        logits, positions, extra = draftstep.run(draft, cache, tokens, positions, base, anc_cols, *staged)
    tree.mark_run(nodes)
    moved = iter(extra)
    first_dev = next(moved) if first is not None else None
    return logits, Staged(props, first, first_dev, positions + 1, next(moved, None), bits)
