"""Which decoder layers a partial self-draft leaves out: the least influential, measured once per model.

Contract:
- `layer_influence(model, ids)` runs ONE forward over `ids` (1, T) with a hook on every layer of
  `model.layers` and returns each layer's block influence (ShortGPT, Men et al. 2024): the mean over
  positions 1..T-1 (position 0 is an attention sink) of 1 - cos(h_in, h_out) of the residual stream.
- `skip_order(n_layers, influence)`: the order layers are given up, ascending influence, or without a
  measurement middle-out (every prefix of length k is `skip_block(n_layers, k)`); never the first or last.
- `rule_order(n_layers, rule, influence)` under a rule of RULES: "influence", "middle" (skip_order
  without it), "alternate" (odd layers middle-out, then the rest: Draft & Verify / SWIFT spread them).
- `pick_skipped(order, streamed, n)`: the first `n` of `order` that the target streams.
- `stored_influence(src)` / `store_influence(src, values)`: a JSON under $SPECX_CACHE keyed over `src`'s
  weight files and CALIBRATION (the fixed text measured); missing, stale or unreadable reads as None.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CALIBRATION = (
    "The river rose through the night, and by morning the lower fields were under water. The farmers "
    "moved the animals to the ridge, counted what they had lost, and began again, as their parents had.\n\n"
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    '    """Merge two ascending lists into one ascending list."""\n'
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n"
    "        else:\n"
    "            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n\n"
    "User: How many minutes are there in a week?\n"
    "Assistant: A week has 7 days of 24 hours, each of 60 minutes: 7 x 24 x 60 = 10,080 minutes.\n\n"
    "In 1905 Einstein published four papers: on the photoelectric effect, Brownian motion, special "
    "relativity and the equivalence of mass and energy, E = mc^2.\n"
)
MAX_TOKENS = 256  # one pass over at most this many calibration tokens
VERSION = 1  # bump when CALIBRATION or the measure changes: stored figures then no longer apply


def _hidden(x):
    return x[0] if isinstance(x, (tuple, list)) else x


@torch.no_grad()
def layer_influence(model, ids: torch.Tensor) -> list[float]:
    """Block influence of every decoder layer over `ids` (1, T), T >= 2 (see the contract)."""
    sums = [0.0] * len(model.layers)

    def hook(i):
        def record(module, args, kwargs, output):
            h_in = _hidden(args[0] if args else kwargs["hidden_states"])[0, 1:].float()  # (T-1, hidden)
            h_out = _hidden(output)[0, 1:].float()
            sums[i] = float((1 - torch.nn.functional.cosine_similarity(h_in, h_out, dim=-1)).mean())

        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(model.layers)]
    try:
        model(input_ids=ids[:, :MAX_TOKENS], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return sums


def skip_order(n_layers: int, influence: list[float] | None = None) -> list[int]:
    inner = list(range(1, n_layers - 1))
    if influence is not None:
        return sorted(inner, key=lambda i: (influence[i], i))
    from offload.selfdraft.build import skip_block

    order: list[int] = []
    for k in range(1, len(inner) + 1):  # skip_block's middle block grows by one layer at a time
        order += sorted(set(skip_block(n_layers, k)) - set(order))
    return order


RULES = ("influence", "middle", "alternate")


def rule_order(n_layers: int, rule: str, influence: list[float] | None = None) -> list[int]:
    if rule not in RULES:
        raise ValueError(f"skip rule must be one of {', '.join(RULES)} (got {rule!r})")
    if rule != "alternate":
        return skip_order(n_layers, influence if rule == "influence" else None)
    middle = skip_order(n_layers)  # middle-out
    return [i for i in middle if i % 2 == 1] + [i for i in middle if i % 2 == 0]


def pick_skipped(order: list[int], streamed, n: int) -> list[int]:
    streamed = set(streamed)
    return sorted([i for i in order if i in streamed][:n])


def _path(src: Path) -> Path:
    from offload.quant.quant_cache import keyed_path

    path = keyed_path(src, "influence", {"version": VERSION, "text": CALIBRATION})
    return path.with_name(f"{path.name}.json")


def stored_influence(src: str | Path, n_layers: int) -> list[float] | None:
    try:
        values = json.loads(_path(Path(src)).read_text())["influence"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ok = isinstance(values, list) and len(values) == n_layers and all(isinstance(v, (int, float)) for v in values)
    return [float(v) for v in values] if ok else None


def store_influence(src: str | Path, values: list[float]) -> None:
    """Best effort: an unwritable cache only means measuring again next time."""
    path = _path(Path(src))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"influence": values, "version": VERSION, "source": str(Path(src).resolve())}))
        tmp.replace(path)
    except OSError:
        pass
