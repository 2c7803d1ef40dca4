"""One generate call's grammar state, following the speculative tree: token masks for batches of nodes.

Contract: `GrammarRun(compiled, state, start)` holds the matcher at the committed state (`root`: the
grammar after state.ids[start:], the tokens this call has emitted). `sync` catches the root up
along what was committed (the accepted path and the bonus token); every method calls it first, so
callers never report what they committed. Per draft tree (`begin(tree)`), each node that needs a
mask gets a matcher of its own, forked from its parent's (a copy, then the node's token), so
branches never share parser state and nothing is rolled back; a node whose token the grammar
refuses is dead (an all-zero mask: no children), and so is a node after EOS.

`bitmask(nodes)` gives the (B, W) int32 packed mask rows of many nodes (bit t % 32 of word t // 32
set = token t allowed): `BATCH_MIN` rows or more in ONE call of xgrammar's batch matcher on its
threads, fewer in the calling thread; rows are cached per node, so the masks the draft computed for
the nodes it expanded serve the verification too. A node is complete (`stopped`) where its mask
allows EOS and nothing else: the reply ends there. `allowed(bits, V)` and `apply` are pure steps
on logits: (B, W) rows on the logits' device -> (B, V) bool; forbidden tokens and columns beyond the
tokenizer's vocabulary -> -inf. `stats` counts mask rows and the host seconds spent here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specexec_cli.core.grammar import CompiledGrammar

_BATCH = None  # xgrammar.BatchGrammarMatcher shared by all runs (its own threads)
# Fewer rows are filled in the calling thread: waking the batch's threads costs more than it saves
# there, and torch's own CPU threads, idle meanwhile, then wake slowly (measured: a (4, 8)
# log_softmax right after a threaded fill took ~12 ms instead of ~3 µs on a loaded 2-core host).
BATCH_MIN = 32


def batch():
    global _BATCH
    if _BATCH is None:
        import xgrammar

        _BATCH = xgrammar.BatchGrammarMatcher()
    return _BATCH


@dataclass
class MaskStats:
    """Mask work of one generate call (bench/grammar.py reads it)."""

    masks: int = 0  # bitmask rows computed
    seconds: float = 0.0  # host seconds in mask computation, forks and commits


class GrammarRun:
    """The grammar state of one generate call (module docstring)."""

    def __init__(self, compiled: CompiledGrammar, state, start: int):
        self.g = compiled
        self.root = compiled.matcher()  # state after state.ids[start:self.pos]
        self.state = state  # engine.DecodeState whose ids the root follows
        self.pos = start  # state.ids[:pos] are in the root (the prompt is not grammar text)
        self.tree = None  # the draft Tree the node ids refer to (None: no tree yet)
        self.nodes: dict[int, object] = {}  # tree node id -> its matcher (state after root -> node)
        self.rows: dict[int, torch.Tensor] = {}  # tree node id -> its (W,) int32 mask row
        self.dead: set[int] = set()  # tree nodes whose token the grammar refused (or below one)
        self.stats = MaskStats()
        eos = torch.zeros(compiled.words * 32, dtype=torch.bool)
        eos[[t for t in compiled.eos_ids if t < eos.numel()]] = True
        self.eos_bits = pack(eos)  # (W,) int32: the EOS tokens' bits

    def begin(self, tree) -> None:
        """A new tree over the committed state: node 0 (the root) is `root`."""
        self.sync()
        self.tree, self.nodes, self.dead = tree, {0: self.root}, set()
        self.rows = {0: self.rows[0]} if 0 in self.rows else {}

    def matcher(self, node: int):
        """The matcher after root -> node, forked from the nearest ancestor that has one."""
        chain = []
        while node not in self.nodes:
            chain.append(node)
            node = int(self.tree.parents[node])
        m = self.nodes[node]
        for n in reversed(chain):  # parent first
            if node in self.dead or m.is_terminated() or not (m := m.fork()).accept_token(int(self.tree.tokens[n])):
                self.dead.add(n)
            self.nodes[n] = m
            node = n
        return m

    def bitmask(self, nodes: list[int]) -> torch.Tensor:
        """(B, W) int32 host bitmask rows of tree nodes `nodes` (node 0 = the committed state)."""
        t0 = time.perf_counter()
        todo = [n for n in dict.fromkeys(nodes) if n not in self.rows]
        if todo:
            bits = torch.zeros((len(todo), self.g.words), dtype=torch.int32)
            ms = [self.matcher(n) if self.tree is not None else self.root for n in todo]
            live = [i for i, (n, m) in enumerate(zip(todo, ms)) if n not in self.dead and not m.is_terminated()]
            if len(live) >= BATCH_MIN:   # dead nodes and nodes after EOS keep an all-zero row: no children
                batch().batch_fill_next_token_bitmask([ms[i] for i in live], bits, live)
            for i in live if len(live) < BATCH_MIN else ():
                ms[i].fill_next_token_bitmask(bits, i)
            self.rows.update(zip(todo, bits))
            self.stats.masks += len(todo)
        out = torch.stack([self.rows[n] for n in nodes]) if nodes else torch.zeros((0, self.g.words), dtype=torch.int32)
        self.stats.seconds += time.perf_counter() - t0
        return out

    def root_bitmask(self) -> torch.Tensor:
        """(1, W) mask of the committed state (no tree: the plain step and the prefill)."""
        self.sync()
        return self.bitmask([0])

    def stopped(self, nodes: list[int]) -> list[bool]:
        """Per tree node: the grammar is complete there and nothing more can follow (EOS is the only
        token its mask allows; the reply ends)."""
        rows = self.bitmask(nodes)
        return (((rows & ~self.eos_bits) == 0).all(1) & ((rows & self.eos_bits) != 0).any(1)).tolist()

    def valid_prefix(self, node: int, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row below tree node `node`."""
        m = self.matcher(node)
        if not tokens or node in self.dead or m.is_terminated():
            return 0
        m = m.fork()
        for i, t in enumerate(tokens):
            if not m.accept_token(int(t)):
                return i
        return len(tokens)

    def sync(self) -> None:
        """Advance the root by the tokens committed since the last call; the tree's matchers and
        mask rows are dropped when it moves (they were relative to the old root)."""
        ids = self.state.ids
        if self.pos == len(ids) and self.nodes.get(0) is self.root:
            return
        t0 = time.perf_counter()
        for t in ids[self.pos:]:
            if self.root.is_terminated():
                break
            self.root.accept_token(int(t))
        self.pos = len(ids)
        self.tree, self.nodes, self.rows, self.dead = None, {0: self.root}, {}, set()
        self.stats.seconds += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        """The grammar is complete at the committed state: nothing more can follow."""
        self.sync()
        if self.tree is None:
            self.nodes = {0: self.root}
        return bool(self.root.is_terminated() or self.stopped([0])[0])


def pack(ok: torch.Tensor) -> torch.Tensor:
    """(..., 32 W) bool -> (..., W) int32 packed rows (the inverse of `allowed`)."""
    v = (ok.reshape(*ok.shape[:-1], -1, 32).long() << torch.arange(32)).sum(-1)  # (..., W) in [0, 2^32)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def host_allowed(bits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, W) int32 host rows, (B, k) long token ids (-1 = none) -> (B, k) bool: the row allows the token."""
    t = tokens.clamp(min=0)
    return (((bits.gather(1, t // 32).long() >> (t % 32)) & 1) == 1) & (tokens >= 0)


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
