"""RunStats records stall seconds against draft seconds per pass (what bench/gpu.py reports), measured on
a real offloaded target streaming from disk with a draft, and as plain arithmetic on scripted events."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig, generate
from specexec_cli.core.stats import LinkMeter, RunStats
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.session.planning import make_plan


def test_scripted_steps_give_mean_stall_and_draft_per_pass(monkeypatch):
    import time as time_mod

    clock = {"t": 0.0}
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock["t"])
    pf = SimpleNamespace(order=[0, 1], stall_seconds=0.0)
    stats, meter = RunStats(), LinkMeter(SimpleNamespace(prefetcher=pf, link_busy_seconds=lambda now: 0.0))
    for idx, draft_s, stall in ((0, 0.0, 0.0), (1, 0.3, 0.2), (2, 0.1, 0.4), (3, 0.2, 0.0)):
        clock["t"] += 1.0
        pf.stall_seconds += stall
        ev = SimpleNamespace(
            tokens=[1],
            prefill_seconds=0.5,
            decode_seconds=1.0,
            finish=None,
            pass_index=idx,
            prompt_tokens=3,
            draft_seconds=draft_s,
            target_seconds=0.5,
            tree_size=4,
            tree_depth=2,
            accepted=0,
        )
        stats.add(ev)
        meter.step(stats, ev)
    rec = stats.to_json()
    assert rec["draft_seconds_per_pass"] == [0.3, 0.1, 0.2] and rec["stall_seconds_per_pass"] == [0.2, 0.4, 0.0]
    assert rec["overlap"] == {"passes": 3, "stall_seconds_per_pass": 0.2, "draft_seconds_per_pass": 0.2}


def test_offloaded_run_records_stall_against_draft_per_pass(tiny_pair):
    opts = LoadOptions(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), device="cpu", offload="disk", ctx=96)
    shape = TreeShape(budget=8, max_depth=4, max_beams=4)
    models = load_models(replace(opts, plan=make_plan(opts, shape, budget_auto=False)))
    try:
        stats, meter = RunStats(), LinkMeter(models.target)
        for ev in generate(
            models, DecodeState(), [3, 5, 7, 9], GenerationConfig(method="specexec", shape=shape, max_new_tokens=12)
        ):
            stats.add(ev)
            meter.step(stats, ev)
        rec = stats.to_json()
        n = rec["target_passes"]
        assert n >= 1 and len(rec["draft_seconds_per_pass"]) == n and len(rec["stall_seconds_per_pass"]) == n
        assert all(s > 0 for s in rec["draft_seconds_per_pass"]) and all(s >= 0 for s in stats.stall)
        ov = rec["overlap"]
        assert ov["passes"] == n
        assert abs(ov["draft_seconds_per_pass"] - sum(stats.draft_pass_seconds) / n) < 1e-5
        assert abs(ov["stall_seconds_per_pass"] - sum(stats.stall) / n) < 1e-5
    finally:
        models.target.close()
