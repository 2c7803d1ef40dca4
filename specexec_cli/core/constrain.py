"""One generate call's grammar state, following the speculative tree: token masks for batches of nodes.

Contract: `GrammarRun(compiled)` holds the matcher at the committed state (`root`: the grammar after
every token this call has emitted). Per draft tree (`begin(tree)`), each node that needs a mask gets
a matcher of its own, forked from its parent's (a deep copy, then the node's token), so branches
never share parser state and nothing is rolled back; a node whose token the grammar refuses keeps a
matcher in the error state (an all-zero mask: no children). `commit(tokens)` advances the root along
the accepted path (the bonus token included). `bitmask(nodes)` computes the (B, W) int32 packed
masks of many nodes in ONE call of llguidance's parallel executor (cached per node: the masks the
draft computed for expanded nodes serve the verification too). `allowed(bits, V)` and `apply` are
pure steps on logits: a (B, W) bitmask on the logits' device -> (B, V) bool, disallowed tokens and
columns beyond the tokenizer's vocabulary -> -inf. `stats` counts masks and their host seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specexec_cli.core.grammar import CompiledGrammar

_EXECUTOR = None  # llguidance.LLExecutor shared by all runs (its own thread pool)


def executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


@dataclass
class MaskStats:
    """Mask work of one generate call (bench/grammar.py reads it)."""

    masks: int = 0  # bitmask rows computed
    seconds: float = 0.0  # host seconds in mask computation, forks and commits


class GrammarRun:
    """The grammar state of one generate call (module docstring)."""

    def __init__(self, compiled: CompiledGrammar):
        self.g = compiled
        self.root = compiled.matcher()  # state after the committed tokens of this call
        self.tree = None  # the draft Tree the node ids refer to (None: no tree yet)
        self.nodes: dict[int, object] = {}  # tree node id -> its matcher (state after root -> node)
        self.rows: dict[int, torch.Tensor] = {}  # tree node id -> its (W,) int32 mask row
        self.stats = MaskStats()

    def begin(self, tree) -> None:
        """A new tree over the committed state: node 0 (the root) is `root`."""
        self.tree, self.nodes, self.rows = tree, {0: self.root}, {}

    def matcher(self, node: int):
        """The matcher after root -> node, forked from the nearest ancestor that has one."""
        chain = []
        while node not in self.nodes:
            chain.append(node)
            node = int(self.tree.parents[node])
        m = self.nodes[node]
        for n in reversed(chain):  # parent first
            m = m.deep_copy()
            m.consume_token(int(self.tree.tokens[n]))
            self.nodes[n] = m
        return m

    def bitmask(self, nodes: list[int]) -> torch.Tensor:
        """(B, W) int32 host bitmask rows of tree nodes `nodes` (node 0 = the committed state)."""
        t0 = time.perf_counter()
        todo = [n for n in dict.fromkeys(nodes) if n not in self.rows]
        if todo:
            bits = torch.zeros((len(todo), self.g.words), dtype=torch.int32)
            pairs = [(self.matcher(n) if self.tree is not None else self.root, i) for i, n in enumerate(todo)]
            executor().unsafe_compute_mask_ptr(pairs, bits.data_ptr(), self.g.words * 4, len(todo))
            self.rows.update(zip(todo, bits))
            self.stats.masks += len(todo)
        out = torch.stack([self.rows[n] for n in nodes]) if nodes else torch.zeros((0, self.g.words), dtype=torch.int32)
        self.stats.seconds += time.perf_counter() - t0
        return out

    def root_bitmask(self) -> torch.Tensor:
        """(1, W) mask of the committed state (no tree: the plain step and the prefill)."""
        self.tree, self.nodes, self.rows = None, {0: self.root}, {}
        return self.bitmask([0])

    def stopped(self, nodes: list[int]) -> list[bool]:
        """Per tree node: the grammar is complete there and nothing more can follow (the reply ends)."""
        return [bool(self.matcher(n).is_stopped()) for n in nodes]

    def valid_prefix(self, node: int, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row below tree node `node`."""
        return int(self.matcher(node).validate_tokens(tokens)) if tokens else 0

    def commit(self, tokens: list[int]) -> None:
        """Advance the committed state by the emitted tokens (the tree's matchers are dropped)."""
        t0 = time.perf_counter()
        self.tree, self.nodes, self.rows = None, {}, {}
        for t in tokens:
            if self.root.is_stopped():
                break
            self.root.consume_token(int(t))
        self.stats.seconds += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        """The grammar is complete at the committed state: nothing more can follow."""
        return bool(self.root.is_stopped())


def allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, W) int32 packed rows on any device -> (B, vocab) bool (bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    ok = ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(bits.shape[0], -1)  # (B, 32 W)
    if ok.shape[1] >= vocab:
        return ok[:, :vocab]
    return torch.cat([ok, ok.new_zeros(ok.shape[0], vocab - ok.shape[1])], dim=1)


def apply(logits: torch.Tensor, bits: torch.Tensor | None) -> torch.Tensor:
    """(B, V) logits with every token the (B, W) rows forbid at -inf (a new tensor; None: unchanged)."""
    if bits is None:
        return logits
    return logits.masked_fill(~allowed(bits, logits.shape[-1]), float("-inf"))
