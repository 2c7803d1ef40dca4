"""A table-driven fake causal LM that checks every mask and position it is given.

Contract: `TableLM(table)` behaves like an HF causal LM for the engine (input_ids, 4-D additive
attention_mask, position_ids, a DynamicCache, use_cache → `.logits`), but its "model" is a lookup
table: the logits after a context are `table[t_{-2}, t_{-1}]` (V, V, V) of the last two tokens the
query row can SEE. Its KV cache stores each token's (token id, position) as the key, so
`kvcache.compact` moves real rows. Before answering, every query row checks that the columns its
mask lets it see are exactly one token for each position 0..pos (its own row last): a tree mask
that shows a sibling (two tokens at one position), hides an ancestor (a gap), a shifted position,
or a compaction that kept the wrong row raises `MaskError` or changes the logits. It is fast (no
transformer), so distribution tests can afford tens of thousands of speculative steps.
`reference_probs(table, ids, params)` gives the exact processed next-token distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specexec_cli.core.engine import Models


class MaskError(AssertionError):
    """A query row's visible context is not one token per position 0..pos."""


@dataclass
class _Out:
    logits: torch.Tensor  # (1, T, V)


class FakeTokenizer:
    """Token i decodes to chr(ord('a') + i); enough for the engine's TextStream."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i)) for i in ids)

    def __call__(self, text):
        return {"input_ids": [ord(c) - 97 for c in text]}


class TableLM(torch.nn.Module):
    """Fake causal LM; see the module docstring. `calls` counts forwards, `tokens_run` query tokens."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table.float()  # (V, V, V): logits after (t_-2, t_-1); t_-2 = t_-1 at position 0
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.calls = 0
        self.tokens_run = 0

    def forward(
        self,
        input_ids,
        position_ids=None,
        attention_mask=None,
        past_key_values=None,
        use_cache=True,
        logits_to_keep=0,
        **_,
    ):
        toks, pos = input_ids[0].numpy(), position_ids[0].numpy()
        n_new = toks.size
        self.calls += 1
        self.tokens_run += n_new
        kv = torch.from_numpy(np.stack([toks, pos], axis=-1).astype(np.float32))[None, None]  # (1, 1, T, 2)
        keys, _ = past_key_values.update(kv, kv, 0)
        keys = keys[0, 0].numpy().astype(np.int64)  # (S, 2) every cached (token, position), new rows last
        n_cols = keys.shape[0]
        if attention_mask is None:  # the plain causal path (prefill): row i sees columns [0, past + i]
            visible = np.arange(n_cols)[None] <= (n_cols - n_new + np.arange(n_new))[:, None]
        else:
            mask = attention_mask[0, 0]
            if tuple(mask.shape) != (n_new, n_cols):
                raise MaskError(f"mask shape {tuple(mask.shape)} != ({n_new}, {n_cols})")
            visible = (mask > torch.finfo(mask.dtype).min / 2).numpy()  # (T, S) bool
        # onehot[s, p]: column s holds position p; counts[i, p]: visible columns of row i at position p
        onehot = np.zeros((n_cols, int(keys[:, 1].max()) + 2), dtype=np.int64)
        onehot[np.arange(n_cols), keys[:, 1]] = 1
        counts = visible.astype(np.int64) @ onehot
        want = (np.arange(onehot.shape[1])[None] <= pos[:, None]).astype(np.int64)  # once for 0..pos
        rows = np.arange(n_new)
        own = visible[rows, n_cols - n_new + rows]
        bad = (counts != want).any(1) | ~own
        if bad.any():
            i = int(bad.nonzero()[0][0])
            seen = sorted(keys[visible[i], 1].tolist())
            raise MaskError(f"row at position {int(pos[i])} sees positions {seen} (own row visible: {bool(own[i])})")
        tok_at = visible.astype(np.int64) @ (onehot * keys[:, :1])  # (T, P) token seen at each position
        last = tok_at[rows, pos]
        prev = np.where(pos > 0, tok_at[rows, np.maximum(pos - 1, 0)], last)
        out = self.table[torch.from_numpy(prev), torch.from_numpy(last)]  # (T, V)
        if logits_to_keep:
            out = out[-logits_to_keep:]
        return _Out(out[None])


def random_table(v: int, seed: int, scale: float = 2.5) -> torch.Tensor:
    """(v, v, v) logits; larger `scale` → peakier next-token distributions."""
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(v, v, v, generator=g)


def noisy(table: torch.Tensor, noise: float, seed: int) -> torch.Tensor:
    """The table plus Gaussian noise: a draft that mostly agrees with the target."""
    g = torch.Generator().manual_seed(seed)
    return table + noise * torch.randn(table.shape, generator=g)


def fake_models(target_table, draft_table, eos: int | None = None, ctx_limit: int = 4096) -> Models:
    return Models(
        target=TableLM(target_table),
        draft=TableLM(draft_table),
        tokenizer=FakeTokenizer(),
        eos_ids=frozenset() if eos is None else frozenset([eos]),
        ctx_limit=ctx_limit,
    )


def next_logits(table: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The fake target's raw logits after `ids` (what a plain causal pass would give)."""
    prev = ids[-2] if len(ids) > 1 else ids[-1]
    return table[prev, ids[-1]].float()


def greedy_reference(table: torch.Tensor, ids: list[int], n: int, eos: int | None = None) -> list[int]:
    """Plain greedy decoding of the fake target: n tokens, or up to and including the first EOS."""
    ids, out = list(ids), []
    for _ in range(n):
        tok = int(next_logits(table, ids).argmax())
        out.append(tok)
        ids.append(tok)
        if tok == eos:
            break
    return out
