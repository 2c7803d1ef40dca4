"""The `step` phase's acceptance trace: how many draft tokens the target accepted per pass, on CPU.

Contract:
- `record(path, budgets, prompts, new_tokens)`: a CPU run of the trained development pair
  (../shared/models: the 15.7M target, the 2.9M draft) with `--method specexec` at T = 0 and the
  product's default node scores (calibrated + n-gram), the default tree limits (max depth 64,
  32 beams, 32 children), each budget over the first `prompts` prompts of
  ../shared/bench/prompts.jsonl for `new_tokens` tokens each (a prompt ends early at EOS). Per
  speculative target pass (not the plain step the engine takes when a reply's last token leaves no
  room for a tree) it keeps three small integers: the draft tokens accepted, the verified tree's
  depth and the draft forwards the tree took. Written as JSON (FORMAT), a few KB: it travels in the
  GPU day's pack.
- `load(path)` -> the trace dict, checked against FORMAT; `accepted(trace, budget)` -> the list
  the `step` phase replays, pass after pass.
- `tools/gpu_day.py trace` records TRACE (the shipped file) with the defaults below.
The trace records what the dev pair accepts, not what a 70B with a 1B draft would: the 70B's own
acceptance is unknown until a real pair runs on the GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
TRACE = Path(__file__).resolve().parent / "step_trace.json"
FORMAT = "specx-step-trace/1"
BUDGETS = (256, 1024)
PROMPTS, NEW_TOKENS = 8, 96
SHAPE = dict(max_depth=64, max_beams=32, max_branch=32)


def _run(models, ids: list[int], budget: int, new_tokens: int) -> dict:
    """One generate call: per target pass (prefill excluded) the accepted count, tree depth, draft forwards."""
    import torch

    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import DecodeState, GenerationConfig
    from specexec_cli.core.methods import generate

    calls = [0]
    hook = models.draft.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    cfg = GenerationConfig(method="specexec", shape=TreeShape(budget=budget, **SHAPE), max_new_tokens=new_tokens)
    rows = dict(accepted=[], tree_depth=[], draft_forwards=[])
    try:
        with torch.inference_mode():
            seen = 0
            for ev in generate(models, DecodeState(), ids, cfg):
                if ev.pass_index > 0 and ev.tree_size > 0:  # a plain step (no room left for a tree) is no tree's
                    rows["accepted"].append(ev.accepted)
                    rows["tree_depth"].append(ev.tree_depth)
                    rows["draft_forwards"].append(calls[0] - seen)
                seen = calls[0]
    finally:
        hook.remove()
    return rows


def record(
    path: Path = TRACE, budgets=BUDGETS, prompts: int = PROMPTS, new_tokens: int = NEW_TOKENS, shared: Path = SHARED
) -> dict:
    from specexec_cli.session.loading import LoadOptions, close_models, load_models
    from specexec_cli.session.prompts import encode_prompt

    lines = (shared / "bench" / "prompts.jsonl").read_text().splitlines()[:prompts]
    texts = [json.loads(line)["prompt"] for line in lines]
    models = load_models(
        LoadOptions(
            str(shared / "models" / "target"),
            str(shared / "models" / "draft"),
            dtype="fp32",
            device="cpu",
            offload="none",
            ctx=4096,
        )
    )
    t0 = time.perf_counter()
    out = dict(
        format=FORMAT,
        pair="../shared/models (target 15.7M, draft 2.9M), fp32 on the CPU",
        method="specexec",
        scores="calibrated+ngram (the default)",
        temperature=0.0,
        **SHAPE,
        prompts=f"the first {prompts} of ../shared/bench/prompts.jsonl",
        new_tokens=new_tokens,
        budgets={},
    )
    try:
        for budget in budgets:
            rows = dict(accepted=[], tree_depth=[], draft_forwards=[])
            for text in texts:
                one = _run(models, encode_prompt(models.tokenizer, text, False), budget, new_tokens)
                for k in rows:
                    rows[k] += one[k]
            out["budgets"][str(budget)] = rows
    finally:
        close_models(models)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    return out


def load(path: Path = TRACE) -> dict:
    trace = json.loads(Path(path).read_text())
    if trace.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} trace (format {trace.get('format')!r})")
    return trace


def accepted(trace: dict, budget: int) -> list[int]:
    """Draft tokens accepted per pass at `budget` (KeyError: the trace has no such budget)."""
    return list(trace["budgets"][str(budget)]["accepted"])


def mean(xs: list[int]) -> float:
    return sum(xs) / max(1, len(xs))
