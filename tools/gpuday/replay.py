"""The `step` phase's acceptance, replayed: the target accepts as many draft tokens as the CPU trace says.

Contract:
- `Replay(lengths)`: pass i accepts lengths[i % len(lengths)] draft tokens (trace.accepted: the
  development pair's counts, pass after pass, cycled).
- `plan(tree, vt)` -> `Plan` of the next pass: the accepted path runs from the root to the
  best-scored verified node at depth L (the deepest the tree holds when it holds none that deep:
  `capped` counts those passes), and the target's own token after it (the bonus) is the smallest
  id that is no child of the path's end. Decided from the tree alone, so it is known before the
  target's pass ends (the overlapped arrangement grows the next tree from it).
- `force(vt, choice)`: the target's per-node choices (verify.node_choices, copied to the host) with
  the path's nodes overwritten, so that verify.walk descends the path and stops at the bonus.
- `patched()`: a context in which `specexec_cli.core.verify.walk`, what accept_tree calls after its one
  copy, walks the forced choices: accept_tree and the engine's step run unchanged on the device and
  the host, only the target's decision is the trace's. The plan used is the one `plan` made for this
  vt, else one made on the spot from `tree` (set by whoever grew it).
Random weights would accept nothing: the replay gives the step the accepted lengths, and so the
cache compactions and tokens per pass, of a trained pair.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specexec_cli.core import verify


@dataclass
class Plan:
    vt: object  # the VerifyTree it was made for
    path: list[int]  # vt indices of the accepted nodes, root excluded, root -> leaf
    bonus: int  # the target's token after them

    def tokens(self) -> list[int]:
        """What the pass emits: the path's tokens, then the bonus."""
        return [int(self.vt.tokens[i]) for i in self.path] + [self.bonus]


class Replay:
    def __init__(self, lengths: list[int]):
        self.lengths = list(lengths) or [0]
        self.passes = self.capped = 0
        self.accepted: list[int] = []  # replayed accepted counts, pass by pass
        self.tree = None  # the draft Tree of the pass in flight (for `force` without a plan)
        self.current: Plan | None = None

    def plan(self, tree, vt) -> Plan:
        want = self.lengths[self.passes % len(self.lengths)]
        self.passes += 1
        depth = min(want, int(vt.depth.max()))
        self.capped += depth < want
        score = tree.logp[vt.draft_ids]  # cumulative draft scores of the verified nodes
        at = (vt.depth == depth).nonzero().flatten()
        node = int(at[torch.argmax(score[at])])
        path = []
        while node > 0:
            path.append(node)
            node = int(vt.parents[node])
        path.reverse()
        end = path[-1] if path else 0
        kids = set(vt.tokens[vt.parents == end].tolist())
        bonus = next(t for t in range(1, len(kids) + 2) if t not in kids)
        self.accepted.append(len(path))
        self.current = Plan(vt, path, bonus)
        return self.current

    def force(self, vt, choice: list[int]) -> list[int]:
        plan = self.current if self.current is not None and self.current.vt is vt else self.plan(self.tree, vt)
        out, node = list(choice), 0
        for nxt in plan.path:
            out[node] = int(vt.tokens[nxt])
            node = nxt
        out[node] = plan.bonus
        self.current = None
        return out

    @contextmanager
    def patched(self):
        original = verify.walk

        def walk(vt, choice, *args, **kwargs):
            return original(vt, self.force(vt, choice), *args, **kwargs)

        verify.walk = walk
        try:
            yield self
        finally:
            verify.walk = original
