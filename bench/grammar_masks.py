"""`bench/grammar.py --masks`: the host time of one pass's grammar masks as the reply grows, walk against fork.

Per tokenizer (e.g. the 128k one of `--engines` and a 152,064-token one: `--build-tokenizer DIR
--vocab 152064` with a larger `--corpus-mb`), the reply is `MASK_DOCUMENT` (a long valid
`MASK_SCHEMA` document), committed up to 100, 1,000 and 4,000 tokens (`--replies`); then
`--passes` passes, each a draft-like tree grown over the next tokens (`mask_tree`: the document's
own continuation as the spine, `--branch` children per spine node and a chain of grammar-valid
tokens below each, `--depth` deep, masks asked depth by depth as the draft does, then every node's
mask and completion for the verification, as the step does), then 3 tokens committed. Two
algorithms on the same trees: "walk" (core/constrain.py: one matcher per lane, rollback and accept
along each path) and "fork" (`ForkRun`: each node forks its parent's matcher, which copies the
whole parse history). Host seconds per pass: median over the passes, fastest of `--repeat` runs per
pass (the machine may be shared).

Contract: `masks(args)` (args: bench/grammar.py's parsed command line) prints one table row per
(tokenizer, reply length, algorithm), the rows of the table `HEADER` heads, and returns the JSON
bench/grammar.py writes; `ForkRun` has the interface of core/constrain.py's GrammarRun (`begin`,
`bitmask`, `stopped`, `stats`), so `mask_tree` drives either; `table(data)` is the returned JSON's
summary, walk beside fork per (vocabulary, reply length), ms per pass (median) to 0.1 ms
(docs/performance.md's `bench:grammar-masks`). specx's modules are imported lazily, after
bench/grammar.py has put the repository first on sys.path.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time

from docblock import md_table  # bench/docblock.py (bench/ is on sys.path: grammar.py, manifest.py)

HEADER = (
    "| vocabulary | reply tokens | masks by | ms per pass (median) | ms per pass (max) | rows per pass |\n"
    "|---|---|---|---|---|---|"
)

MASK_SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"title": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["title", "n"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["notes"],
    "additionalProperties": False,
}
MASK_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "parsing",
    "tokens",
    "of",
    "grammar",
    "masks",
    "under",
    "speculative",
    "trees",
    "with",
    "rollback",
]
MASK_DOCUMENT = (
    '{"notes": ['
    + ", ".join(
        '{{"title": "{}", "n": {:d}}}'.format(
            " ".join(MASK_WORDS[(7 * i + 3 * j) % len(MASK_WORDS)] for j in range(8)), i
        )
        for i in range(600)
    )
    + "]}"
)


class ForkRun:
    """The previous mask algorithm, for comparison: each node's matcher forked from its parent's (a
    deep copy of the parse history), rows cached per node; the committed root advances by accepting."""

    def __init__(self, compiled, state, start: int):
        import torch

        from specexec_cli.core.constrain import MaskStats, pack

        self.g, self.state, self.pos, self.stats = compiled, state, start, MaskStats()
        self.root, self.tree, self.nodes, self.rows, self.dead = compiled.matcher(), None, {}, {}, set()
        eos = torch.zeros(compiled.words * 32, dtype=torch.bool)
        eos[list(compiled.eos_ids)] = True
        self.eos_bits = pack(eos)

    def begin(self, tree) -> None:
        t0, ids = time.perf_counter(), self.state.ids
        for t in ids[self.pos :]:
            assert self.root.accept_token(int(t))
        self.pos, self.tree, self.nodes, self.rows, self.dead = len(ids), tree, {0: self.root}, {}, set()
        self.stats.seconds += time.perf_counter() - t0

    def matcher(self, node: int):
        chain = []
        while node not in self.nodes:
            chain.append(node)
            node = int(self.tree.parents[node])
        m = self.nodes[node]
        for n in reversed(chain):
            if node in self.dead or m.is_terminated() or not (m := m.fork()).accept_token(int(self.tree.tokens[n])):
                self.dead.add(n)
            self.nodes[n], node = m, n
        return m

    def bitmask(self, nodes: list[int]):
        """As GrammarRun.bitmask (numpy rows, one thread), with forked matchers."""
        import numpy as np
        import torch

        t0 = time.perf_counter()
        todo = [n for n in dict.fromkeys(nodes) if n not in self.rows]
        bits = np.zeros((len(todo), self.g.words), dtype=np.int32)
        for i, n in enumerate(todo):
            m = self.matcher(n)
            if n not in self.dead and not m.is_terminated():
                m.fill_next_token_bitmask(bits, i)
        self.rows.update(zip(todo, bits & self.g.keep.numpy()))
        self.stats.masks += len(todo)
        out = np.stack([self.rows[n] for n in nodes])
        self.stats.seconds += time.perf_counter() - t0
        return torch.from_numpy(out)

    def stopped(self, nodes: list[int]) -> list[bool]:
        rows = self.bitmask(nodes).numpy()
        eos_bits = self.eos_bits.numpy()
        return (((rows & ~eos_bits) == 0).all(1) & ((rows & eos_bits) != 0).any(1)).tolist()


def mask_tree(run, spine: list[int], branch: int, budget: int) -> None:
    """One pass's masks over a draft-like tree (module docstring): grown depth by depth, each depth's
    nodes' masks asked before their children are chosen, then every node's (the verification)."""
    import numpy as np
    import torch

    from specexec_cli.core.tree import Tree

    tree = Tree.new(spine[0])
    run.begin(tree)
    frontier, on_spine = [0], {0: 0}  # node -> its index in `spine` (spine nodes only)
    while frontier and tree.size < budget:
        rows = run.bitmask(frontier).numpy()  # (B, W) int32: bit t % 32 of word t // 32 (little-endian bytes)
        nxt = []
        for node, row in zip(frontier, rows):
            ids = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[: run.g.vocab]).tolist()
            if not ids:
                continue
            if node in on_spine and on_spine[node] + 1 < len(spine):  # the text's token and branch - 1 others
                d = on_spine[node] + 1
                picks = [spine[d]] + [ids[(j * 7919) % len(ids)] for j in range(1, branch)]
            else:  # below a branch: one grammar-valid token
                picks = [ids[len(ids) // 2]]
            for tok in dict.fromkeys(picks):
                if tree.size >= budget:
                    break
                (child,) = tree.add(torch.tensor([node]), torch.tensor([tok]), torch.zeros(1)).tolist()
                nxt.append(child)
                if node in on_spine and tok == spine[on_spine[node] + 1]:
                    on_spine[child] = on_spine[node] + 1
        frontier = nxt
    every = list(range(tree.size))
    run.bitmask(every)
    run.stopped(every)


def masks(args) -> dict:
    """Mask seconds per pass by reply length, walk against fork (module docstring)."""
    import torch
    from transformers import AutoTokenizer

    from specexec_cli.core import constrain
    from specexec_cli.core.engine import DecodeState
    from specexec_cli.core.grammar import GrammarSpec, compile_grammar

    torch.set_num_threads(1)  # the bench's own tree building (untimed); the timed mask code uses numpy
    spec, out = GrammarSpec("json_schema", json.dumps(MASK_SCHEMA)), []
    for path in args.tokenizer:
        tok = AutoTokenizer.from_pretrained(path)
        g = compile_grammar(tok, spec)
        doc = tok.encode(MASK_DOCUMENT, add_special_tokens=False)
        assert len(doc) > max(args.replies) + 3 * args.passes + args.depth, "MASK_DOCUMENT too short"
        for reply, (name, cls) in itertools.product(args.replies, (("walk", constrain.GrammarRun), ("fork", ForkRun))):
            best, rows = [float("inf")] * args.passes, 0
            for _ in range(args.repeat):
                st = DecodeState(ids=doc[:reply])
                run = cls(g, st, 0)
                run.begin(None)  # catch up on the reply: untimed
                for p in range(args.passes):
                    run.stats.seconds, run.stats.masks = 0.0, 0
                    mask_tree(run, doc[len(st.ids) - 1 : len(st.ids) + args.depth], args.branch, args.budget)
                    best[p], rows = min(best[p], run.stats.seconds), run.stats.masks
                    st.ids.extend(doc[len(st.ids) : len(st.ids) + 3])
            out.append(
                {
                    "vocab": len(tok),
                    "tokenizer": path,
                    "reply_tokens": reply,
                    "algorithm": name,
                    "mask_s_per_pass": statistics.median(best),
                    "mask_s_max": max(best),
                    "rows_per_pass": rows,
                }
            )
            print(
                f"| {len(tok)} | {reply} | {name} | {out[-1]['mask_s_per_pass'] * 1e3:.2f} | "
                f"{out[-1]['mask_s_max'] * 1e3:.2f} | {rows} |",
                flush=True,
            )
    return {
        "what": "masks",
        "schema": MASK_SCHEMA,
        "passes": args.passes,
        "repeat": args.repeat,
        "tree": {"budget": args.budget, "depth": args.depth, "branch": args.branch},
        "lanes": constrain.LANES,
        "cpus": os.cpu_count(),
        "rows": out,
    }


def table(data: dict) -> str:
    """Walk beside fork: ms per pass (median over the passes) per vocabulary and reply length."""
    cells = {(r["vocab"], r["reply_tokens"], r["algorithm"]): r["mask_s_per_pass"] * 1e3 for r in data["rows"]}
    keys = sorted({(v, n) for v, n, _ in cells})
    rows = [[f"{v:,}", f"{n:,}", f"{cells[v, n, 'walk']:.1f}", f"{cells[v, n, 'fork']:.1f}"] for v, n in keys]
    return md_table(["vocabulary", "reply tokens", "walk ms per pass", "fork ms per pass"], rows)
