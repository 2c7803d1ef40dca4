"""Static token trees (chain, SpecInfer, Sequoia): one shape, filled level by level by the draft.

Contract: a `Template` is a fixed tree shape, `parents[i]` < i (node 0 = root, parent -1), children
in rank order. `grow_static` fills it with one batched draft forward per level (`draft.run_nodes`; tree
mask over the cached prefix and the run ancestors); a node's children are
  - T = 0: the draft's top-k tokens, verified by the greedy walk `verify.accept_tree`;
  - T > 0: k tokens sampled WITHOUT replacement from the draft's processed q on the device (top k of
    q / E, E the CHILDREN stream at the children's position), verified by the multi-step residual
    rule (`common.accept_static`).
Template children q cannot fill (smaller support) are dropped with their subtrees. `static_step` is
the whole engine step and keeps the engine's cache invariants. Templates:
- `chain_step` (Leviathan et al. 2023; Chen et al. 2023): the chain ⟨1, ..., 1⟩ of γ = --gamma draft
  tokens (no budget); with one child the multi-step rule is the chain rule.
- `specinfer_step` (arXiv 2305.09781): every node at depth d gets k_{d+1} children (`--branching
  4,2,2,1` → 4 + 8 + 16 + 16 = 44 nodes); without it `branching_for_budget`: first level min(4, W),
  doubling to W = the largest power of two with W² <= budget, then width W while within the budget
  and max_depth.
Host transfers: per level one upload and one (B, 2k [+1]) top-k download; q rows stay on the device;
per step one upload for the verify pass (child table at T > 0) and one (n,) download of the choices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from specexec_cli.core.draft import DraftContext, run_nodes, top_children
from specexec_cli.core.engine import StepResult, ar_step, commit_tree, draft_context, new_noise
from specexec_cli.core.methods.common import MethodSettings, accept_static, child_table
from specexec_cli.core.sampling import CHILDREN, PositionNoise, SamplingParams, process_logits
from specexec_cli.core.transfers import to_host
from specexec_cli.core.tree import Tree, subtree
from specexec_cli.core.verify import accept_tree, target_pass


@dataclass(frozen=True)
class Template:
    """A static tree shape; children of each node appear in rank order (rank 1 first)."""

    parents: tuple[int, ...]  # parents[0] == -1 (the root); parents[i] < i

    @property
    def size(self) -> int:
        return len(self.parents) - 1  # draft nodes, root excluded

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, par in enumerate(self.parents[1:], start=1):
            kids[par].append(i)
        return kids

    def depth(self) -> int:
        d = [0] * len(self.parents)
        for i, par in enumerate(self.parents[1:], start=1):
            d[i] = d[par] + 1
        return max(d)


@lru_cache(maxsize=64)
def level_template(widths: tuple[int, ...]) -> Template:
    """Every node at depth d gets widths[d] children (SpecInfer's expansion ⟨k1, k2, ...⟩; chain: 1s)."""
    parents, level = [-1], [0]
    for w in widths:
        first = len(parents)  # the next level's nodes: w children of each node of this one
        parents += [node for node in level for _ in range(w)]
        level = list(range(first, len(parents)))
    return Template(tuple(parents))


def pick_level(logits: torch.Tensor, ks: list[int], params: SamplingParams, noise: PositionNoise | None, pos: int):
    """(B, V) device logits of one level, children wanted per row → per row (tokens, log-probs, device
    q row or None at T = 0), in one host copy; `pos`: the children's absolute position. At T > 0 a row
    gets at most its support size of children."""
    kmax = min(max(ks), logits.shape[-1])
    if params.greedy:
        vals, idx, _ = top_children(logits, kmax, params, None)
        return [(idx[r, :k].tolist(), vals[r, :k], None) for r, k in enumerate(ks)]
    q = process_logits(logits, params)  # (B, V) on the device
    e = noise.block(pos, 1, q.shape[-1], q.device, CHILDREN)  # (1, V)
    ids = torch.topk(q / e, kmax, dim=-1).indices  # (B, k) w/o replacement
    logq = q.gather(1, ids).clamp(min=1e-30).log()
    support = (q > 0).sum(-1, keepdim=True).to(logq.dtype)
    host = to_host(torch.cat([logq, ids.to(logq.dtype), support], 1))
    out = []
    for r, k in enumerate(ks):
        k = min(k, kmax, int(host[r, 2 * kmax]))
        out.append((host[r, kmax : kmax + k].long().tolist(), host[r, :k], q[r]))
    return out


def grow_static(draft, cache, ctx: DraftContext, tpl: Template, depth_cap: int, params, noise=None):
    """Fill `tpl` to depth_cap → (Tree, {node: device q row}, T > 0 only, where `noise` is needed).
    Draft cache afterwards: prefix + pending + every node with slot >= 0, in slot order (as grow_tree)."""
    tree = Tree.new(ctx.pending[-1])
    kids = tpl.children()
    qrows: dict[int, torch.Tensor] = {}
    frontier = [(0, 0)]  # (tree node, template node) pairs the draft runs next: the root, then non-leaves
    for depth in range(1, depth_cap + 1):
        # one draft step per level (draft.run_nodes): the root from the pending run, then the level's
        # (B,) tokens at root_pos + depth, each seeing the prefix and its run ancestors
        logits = run_nodes(draft, cache, ctx, tree, torch.tensor([n for n, _ in frontier]))[0]  # (B, V)
        if depth == 1 and not params.greedy:  # the children's noise of every level in one block (each level slices it)
            noise.block(ctx.root_pos + 1, depth_cap, logits.shape[-1], logits.device, CHILDREN)
        nxt: list[tuple[int, int]] = []
        picks = pick_level(logits, [len(kids[t]) for _, t in frontier], params, noise, ctx.root_pos + depth)
        for (node, t), (toks, lp, q) in zip(frontier, picks):
            if not toks:
                continue
            if q is not None:
                qrows[node] = q
            ids = tree.add(torch.full((len(toks),), node), torch.tensor(toks, dtype=torch.long), tree.logp[node] + lp)
            nxt += [(int(i), c) for i, c in zip(ids, kids[t]) if kids[c] and depth < depth_cap]
        if not nxt:
            break
        frontier = nxt
    return tree, qrows


def static_step(m, st, cfg, gen, limit: int, tpl: Template):
    """Grow `tpl` with the draft, verify in one target pass, accept, trim caches → engine.StepResult."""
    n = len(st.ids)
    depth_cap = min(tpl.depth(), limit - 1, m.ctx_limit - n - 1)  # the bonus token needs one slot
    if depth_cap < 1 or tpl.size < 1:
        return ar_step(m, st, cfg, gen, limit)
    t0 = time.perf_counter()
    ctx = draft_context(st)
    st.noise = st.noise or new_noise(gen)
    tree, qrows = grow_static(m.draft, st.draft_cache, ctx, tpl, depth_cap, cfg.sampling, st.noise)
    vt = subtree(tree, torch.arange(1, tree.size))
    t1 = time.perf_counter()
    # one target pass over root + tree; at T > 0 the child table (inner, kids) rides in its upload
    table = [] if cfg.sampling.greedy else list(child_table(vt))
    logits, positions, *table = target_pass(m.target, st.target_cache, vt, st.target_len, n - 1, *table)
    if cfg.sampling.greedy:
        acc = accept_tree(vt, logits, cfg.sampling, None, n, m.eos_ids, limit, depth=positions - (n - 1))
    else:  # VerifyTree index i holds draft node vt.draft_ids[i]; here they coincide (whole tree kept)
        inner, kids = table
        q = torch.stack([qrows[i] for i in inner.tolist()]) if len(qrows) else logits.new_zeros(0, logits.shape[-1])
        acc = accept_static(
            vt, logits, cfg.sampling, st.noise, n, (positions - (n - 1), inner, kids), q, m.eos_ids, limit
        )
    t2 = time.perf_counter()
    commit_tree(st, tree, vt, acc, len(ctx.pending))
    t3 = time.perf_counter()
    return StepResult(
        tokens=acc.tokens,
        accepted=len(acc.path),
        tree_size=vt.size - 1,
        tree_depth=int(vt.depth.max()),
        draft_seconds=t1 - t0 + (t3 - t2),
        target_seconds=t2 - t1,
    )


def chain_step(m, st, cfg, gen, limit: int):
    gamma = MethodSettings.of(cfg).gamma
    if gamma < 1:
        raise ValueError(f"--gamma must be >= 1 (got {gamma})")
    return static_step(m, st, cfg, gen, limit, level_template((1,) * min(gamma, cfg.shape.max_depth)))


def branching_for_budget(budget: int, max_depth: int) -> tuple[int, ...]:
    """Level widths with about sqrt(budget) leaves and depth, at most `budget` nodes (see module doc)."""
    w = 1
    while (2 * w) ** 2 <= budget:
        w *= 2
    widths: list[int] = []
    width, total = 1, 0
    while len(widths) < max_depth:
        k = min(4, w) if not widths else (2 if width < w else 1)
        k = min(k, max(1, w // width))
        if total + width * k > budget:
            break
        widths.append(k)
        width *= k
        total += width
    return tuple(widths) or (1,)


def specinfer_step(m, st, cfg, gen, limit: int):
    widths = MethodSettings.of(cfg).branching or branching_for_budget(cfg.shape.budget, cfg.shape.max_depth)
    return static_step(m, st, cfg, gen, limit, level_template(widths))
