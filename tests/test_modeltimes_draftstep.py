"""`specx profile` times the draft step the way runs take it: through core/draftstep.run, over a draft
cache reserved as a run's (so on CUDA the timed passes are the captured graphs' replays)."""

from __future__ import annotations

from dataclasses import replace

from specexec_cli.core import draft as draft_mod
from specexec_cli.core import draftstep, kvcache
from specexec_cli.core.draft import TreeShape
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.session.planning import make_plan
from specexec_cli.tools import modeltimes


def test_draft_step_timing_goes_through_draftstep(tiny_pair, monkeypatch):
    opts = LoadOptions(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), dtype="fp32", device="cpu", ctx=256)
    plan = make_plan(opts, TreeShape(budget=8, max_depth=4, max_beams=4), budget_auto=False)
    models = load_models(replace(opts, plan=plan))
    calls: list[tuple[int, int | None, int]] = []
    real_run = draftstep.run

    def spy(d, cache, tokens, positions, n_past, anc, *extra, causal=False):
        calls.append((int(tokens.numel()), kvcache.slab_rows(cache), kvcache.cache_len(cache)))
        return real_run(d, cache, tokens, positions, n_past, anc, *extra, causal=causal)

    monkeypatch.setattr(draftstep, "run", spy)
    monkeypatch.setattr(draft_mod, "grow_tree", lambda *a, **k: None)  # only the step's passes remain
    out = modeltimes.time_draft(models, [16], beams=4)
    assert out["step_seconds"] > 0 and out["max_beams"] == 4
    assert len(calls) >= modeltimes.WARMUP + 3  # warm-up and timed steps: every one a draftstep pass
    ctx = modeltimes.CONTEXT_TOKENS - 1
    rows = max(plan.kv_rows[1], ctx + 2 * 16 + 4 + 1)
    assert set(calls) == {(4, rows, ctx)}  # `beams` nodes after the context, on the reserved slabs
