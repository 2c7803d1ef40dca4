"""One generate call's grammar state, following the speculative tree: token masks for batches of nodes.

Contract: `GrammarRun(compiled, state, start)` follows the grammar after state.ids[start:]. `sync`
catches it up along what was committed (every method calls it first); a committed token the grammar
refuses is a `GrammarDesync` error (masks and parser disagree: a bug). Per draft tree (`begin(tree)`)
a `Walker` (a matcher at the committed state plus one path) reaches a node by rolling back to the
common ancestor and accepting down, O(depth) per node. A node whose token the grammar or `keep`
refuses is dead (an all-zero row: no children), as is every node below it or after EOS.

`bitmask(nodes)` gives (B, W) int32 packed rows (bit t % 32 of word t // 32 = token t allowed),
AND-ed with `keep`, cached per node so the draft's rows serve the verification too; from `BATCH_MIN`
rows on, `LANES` walkers fill them with xgrammar's batch matcher. A node is complete (`stopped`)
where EOS is the only token allowed. `allowed` and `apply` are pure steps on the logits' device;
`stats` counts rows and host seconds.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specexec_cli.core.grammar import CompiledGrammar, pack

# Fewer rows are filled in the calling thread: waking the batch's threads costs more than it saves
# there, and torch's own CPU threads, idle meanwhile, then wake slowly (measured: a (4, 8)
# log_softmax right after a threaded fill took ~12 ms instead of ~3 µs on a loaded 2-core host).
BATCH_MIN = 32
LANES = max(1, min(8, (os.cpu_count() or 2) // 2))  # walkers filling rows at once (xgrammar's "auto" threads)


class GrammarDesync(RuntimeError):
    """The grammar refused a token that was committed: the masks and the parser disagree (a bug)."""


@functools.cache
def batch():
    """The xgrammar.BatchGrammarMatcher shared by all runs (its own threads)."""
    import xgrammar

    return xgrammar.BatchGrammarMatcher()


@dataclass
class MaskStats:
    """Mask work of one generate call (bench/grammar.py reads it)."""

    masks: int = 0  # bitmask rows computed
    seconds: float = 0.0  # host seconds in mask computation, walks and commits


@dataclass
class Walker:
    """A matcher at the committed state plus the tokens of the tree nodes `path` (root excluded)."""

    m: object  # xgrammar.GrammarMatcher
    path: list[int] = field(default_factory=list)  # tree node ids, parent first, all accepted


class GrammarRun:
    """The grammar state of one generate call (module docstring)."""

    def __init__(self, compiled: CompiledGrammar, state, start: int):
        self.g = compiled
        self.state = state  # engine.DecodeState whose ids the walkers follow
        self.start = start  # state.ids[start:] are grammar text (the prompt is not)
        self.pos = start  # state.ids[start:pos] are in every walker's committed state
        self.walkers = [Walker(compiled.matcher())]  # more made on demand (`walker`)
        self.tree = None  # the draft Tree the node ids refer to (None: no tree yet)
        self.chains: dict[int, tuple[int, ...]] = {0: ()}  # tree node id -> its path below the root
        self.rows: dict[int, np.ndarray] = {}  # tree node id -> its (W,) int32 mask row
        self.dead: set[int] = set()  # tree nodes the grammar refused (or below one, or after EOS)
        self.stats = MaskStats()
        eos = torch.zeros(compiled.words * 32, dtype=torch.bool)
        eos[[t for t in compiled.eos_ids if t < eos.numel()]] = True
        self.eos_bits = pack(eos).numpy()  # (W,) int32: the EOS tokens' bits
        self.keep = compiled.keep.numpy()  # (W,) int32: the ids a reply may hold

    def begin(self, tree) -> None:
        """A new tree over the committed state: node 0 is the committed state."""
        self.sync()
        for w in self.walkers:
            self.home(w)
        self.tree, self.chains, self.dead = tree, {0: ()}, set()
        self.rows = {0: self.rows[0]} if 0 in self.rows else {}

    def walker(self, i: int) -> Walker:
        """Walker i, made at the committed state if it does not exist yet."""
        while len(self.walkers) <= i:
            w = Walker(self.g.matcher())
            self.accept_committed(w, self.state.ids[self.start : self.pos], self.start)
            self.walkers.append(w)
        return self.walkers[i]

    def accept_committed(self, w: Walker, tokens: list[int], at: int) -> None:
        """Walker `w` (at its committed state) accepts committed `tokens` (state.ids[at:...])."""
        for i, t in enumerate(tokens):
            if not (self.g.may_hold(int(t)) and w.m.accept_token(int(t))):
                raise GrammarDesync(
                    f"the grammar refused committed token {int(t)} at position {at + i}: "
                    "structured output fell out of step (a bug; please report it)"
                )

    def home(self, w: Walker) -> None:
        """Roll `w` back to the committed state."""
        if w.path:
            w.m.rollback(len(w.path))
            w.path.clear()

    def chain(self, node: int) -> tuple[int, ...]:
        """The tree nodes root -> `node` (root excluded, `node` last), memoised per node."""
        up = []
        while node not in self.chains:
            up.append(node)
            node = int(self.tree.parents[node])
        path = self.chains[node]
        for n in reversed(up):  # parent first
            path = self.chains[n] = path + (n,)
        return path

    def goto(self, w: Walker, node: int) -> bool:
        """Move `w` to the state after root -> `node` (rollback to the common ancestor, then accept
        down); False when the node is dead (`w` then stops at its deepest live ancestor)."""
        if node in self.dead:
            return False
        chain, path = self.chain(node), w.path
        k = 0
        while k < len(path) and k < len(chain) and path[k] == chain[k]:
            k += 1
        if len(path) > k:
            w.m.rollback(len(path) - k)
            del path[k:]
        for i in range(k, len(chain)):
            n = chain[i]
            t = int(self.tree.tokens[n])
            if n in self.dead or w.m.is_terminated() or not self.g.may_hold(t) or not w.m.accept_token(t):
                self.dead.update(chain[i:])
                return False
            path.append(n)
        return True

    def bitmask(self, nodes: list[int]) -> torch.Tensor:
        """(B, W) int32 host rows of tree nodes `nodes` (node 0 = the committed state), in numpy: torch's
        pool, woken for a (B, W) fill on a loaded host, can cost milliseconds per call."""
        t0 = time.perf_counter()
        todo = [n for n in dict.fromkeys(nodes) if n not in self.rows]
        if todo:
            bits = np.zeros((len(todo), self.g.words), dtype=np.int32)
            self.fill(todo, bits)  # dead nodes and nodes after EOS keep an all-zero row: no children
            bits &= self.keep
            self.rows.update(zip(todo, bits))
            self.stats.masks += len(todo)
        out = np.stack([self.rows[n] for n in nodes]) if nodes else np.zeros((0, self.g.words), dtype=np.int32)
        self.stats.seconds += time.perf_counter() - t0
        return torch.from_numpy(out)

    def fill(self, todo: list[int], bits: np.ndarray) -> None:
        """bits[i] = xgrammar's mask after root -> todo[i] (zero where dead or terminated), depth-first."""
        order = sorted(range(len(todo)), key=lambda i: self.chain(todo[i]))  # neighbours share ancestors
        lanes = min(LANES, len(todo)) if len(todo) >= BATCH_MIN else 1
        if lanes == 1:
            w = self.walkers[0]
            for i in order:
                if self.goto(w, todo[i]) and not w.m.is_terminated():
                    w.m.fill_next_token_bitmask(bits, i)
            return
        per = -(-len(order) // lanes)
        parts = [(self.walker(j), order[j * per : (j + 1) * per]) for j in range(lanes)]  # contiguous subtrees
        for r in range(per):
            ms, rows = [], []
            for w, part in parts:
                if r < len(part) and self.goto(w, todo[part[r]]) and not w.m.is_terminated():
                    ms.append(w.m)
                    rows.append(part[r])
            if ms:
                batch().batch_fill_next_token_bitmask(ms, bits, rows)

    def root_bitmask(self) -> torch.Tensor:
        """(1, W) mask of the committed state; GrammarDesync where it allows nothing."""
        self.sync()
        row = self.bitmask([0])
        if not row.any():
            raise GrammarDesync(
                f"the grammar allows no token of this vocabulary after {self.pos - self.start} "
                "reply tokens (text it requires is spelled only by special tokens)"
            )
        return row

    def stopped(self, nodes: list[int]) -> list[bool]:
        """Per tree node: EOS is the only token its mask allows (the reply ends there)."""
        rows = self.bitmask(nodes).numpy()
        return (((rows & ~self.eos_bits) == 0).all(1) & ((rows & self.eos_bits) != 0).any(1)).tolist()

    def valid_prefix(self, node: int, tokens: list[int]) -> int:
        """How many of `tokens` the grammar (and `keep`) accepts in a row below tree node `node`."""
        t0 = time.perf_counter()
        w, n = self.walkers[0], 0
        if tokens and self.goto(w, node) and not w.m.is_terminated():
            while n < len(tokens) and self.g.may_hold(int(tokens[n])) and w.m.accept_token(int(tokens[n])):
                n += 1
            if n:
                w.m.rollback(n)  # back to `node`: the walker's path holds tree nodes only
        self.stats.seconds += time.perf_counter() - t0
        return n

    def sync(self) -> None:
        """Advance every walker by the tokens committed since the last call; drops the tree's state."""
        ids = self.state.ids
        if self.pos == len(ids):
            return
        t0 = time.perf_counter()
        for w in self.walkers:
            self.home(w)
            self.accept_committed(w, ids[self.pos :], self.pos)
        self.pos = len(ids)
        self.tree, self.chains, self.rows, self.dead = None, {0: ()}, {}, set()
        self.stats.seconds += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        """The grammar is complete at the committed state: nothing more can follow."""
        self.sync()
        w = self.walkers[0]
        self.goto(w, 0)
        return bool(w.m.is_terminated() or self.stopped([0])[0])


def host_allowed(bits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, W) int32 host rows, (B, k) long ids (-1 = none) -> (B, k) bool allowed (outside 32 W: False)."""
    inside = (tokens >= 0) & (tokens < bits.shape[-1] * 32)
    t = torch.where(inside, tokens, 0)
    return (((bits.gather(1, t // 32).long() >> (t % 32)) & 1) == 1) & inside


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
