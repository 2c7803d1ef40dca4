"""Budget chooser: analytically known optima, online statistics, and the live shape holder."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from offload.planning import interpolate
from specexec_cli.core.budget import (
    BudgetTuner,
    LiveConfig,
    ShapeHolder,
    TimingModel,
    candidate_budgets,
    choose_budget,
    make_tuner,
)
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import GenerationConfig


def test_candidates_are_power_of_two_trees():
    assert candidate_budgets(100) == [1, 3, 7, 15, 31, 63]
    assert candidate_budgets(1) == [1]


def test_saturating_acceptance_flat_target_picks_the_saturation_point():
    # E(B) = 1 + min(B, 8): nothing gained past 8 nodes; any draft cost makes bigger trees worse.
    b, rate = choose_budget(lambda b: 1 + min(b, 8), lambda b: 0.001 * b, lambda n: 1.0, range(1, 100))
    assert b == 8
    assert rate == pytest.approx(9 / 1.008)


def test_split_keeps_the_budget_on_a_stream_bound_pass_and_shrinks_it_once_compute_shows():
    """k requests per pass: on a flat (stream-bound) pass each keeps the budget it has alone and the
    aggregate rate grows about k-fold; on a pass whose time grows with its tokens each one's tree
    shrinks, to the grid's best aggregate rate."""
    e = lambda b: 1 + 0.6 * math.log2(1 + b)  # noqa: E731
    d = lambda b: 1e-4 * b  # noqa: E731
    flat = lambda n: 1.0  # noqa: E731
    cands = candidate_budgets(1023)
    one, _ = choose_budget(e, d, flat, cands)
    two, rate2 = choose_budget(e, d, flat, cands, 2)
    assert two == one and rate2 == pytest.approx(2 * e(one) / (2 * d(one) + 1.0))
    dear = lambda n: 0.2 + n / 200  # noqa: E731 - compute-bound: seconds grow with the pass's tokens
    b1, _ = choose_budget(e, d, dear, cands)
    b4, rate4 = choose_budget(e, d, dear, cands, 4)
    assert b4 < b1
    best = max(4 * e(b) / (4 * d(b) + dear(4 * (b + 1))) for b in cands)  # brute force over the same grid
    assert rate4 == pytest.approx(best)


def test_tuner_split_stays_inside_the_sized_budget_and_learns_from_forest_passes():
    tuner = BudgetTuner(TimingModel({1: 1.0, 1024: 1.0}, 1e-4), TreeShape(255, 16), max_budget=255)
    for k in (2, 3, 4):
        shape = tuner.split(k)
        assert k * (shape.budget + 1) <= 256 and shape.max_depth <= 16
    assert tuner.split(1) == tuner.shape
    ev = SimpleNamespace(
        pass_index=3, tree_size=31, tokens=[1, 2, 3, 4], accepted=3, target_seconds=2.0, draft_seconds=0.01
    )
    tuner.observe(ev, budget=31, pass_tokens=64)  # one of two requests of a 64-token forest pass
    assert tuner.by_budget[31] == [1, 4] and tuner.target_obs[64] == [1, 2.0] and tuner.draft_obs[31] == [1, 0.01]


def test_log_acceptance_with_a_knee_picks_the_knee():
    # t_target flat up to n = 128 then linear; E = 1 + log2(1 + B) grows slower than linear, so the
    # best tree fills the flat region exactly: B + 1 = 128.
    t = lambda n: max(1.0, n / 128)  # noqa: E731
    e = lambda b: 1 + math.log2(1 + b)  # noqa: E731
    b, _ = choose_budget(e, lambda b: 0.0, t, candidate_budgets(4095))
    assert b == 127
    dense = max(range(1, 4096), key=lambda b: e(b) / t(b + 1))
    assert dense == 127


def test_linear_target_cost_analytic_optimum():
    # E = 1 + a ln(1 + B), cost c + d B: the optimum solves a(c + dB)/(1+B) = d(1 + a ln(1+B)).
    a, c, d = 1.0, 1.0, 0.01
    e = lambda b: 1 + a * math.log(1 + b)  # noqa: E731
    b, _ = choose_budget(e, lambda b: 0.0, lambda n: c + d * (n - 1), range(1, 2000))
    f = lambda x: a * (c + d * x) / (1 + x) - d * (1 + a * math.log(1 + x))  # noqa: E731
    lo, hi = 1.0, 2000.0
    for _ in range(60):  # bisection on the first-order condition (f decreases through 0)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
    assert abs(b - lo) <= 1


def test_expensive_draft_prefers_small_trees():
    e = lambda b: 1 + 0.5 * math.log2(1 + b)  # noqa: E731
    cheap, _ = choose_budget(e, lambda b: 1e-4 * b, lambda n: 1.0 + n / 512, candidate_budgets(4095))
    dear, _ = choose_budget(e, lambda b: 0.05 * b, lambda n: 1.0 + n / 512, candidate_budgets(4095))
    assert dear < cheap


def test_interpolation_is_loglog_and_extrapolates_linearly():
    pts = {1: 1.0, 4: 4.0}
    assert interpolate(pts, 2) == pytest.approx(2.0)
    assert interpolate(pts, 8) == pytest.approx(8.0)
    assert interpolate(pts, 0.5) == 1.0


def event(tokens: int, tree: int, draft=0.01, target=0.1, accepted=None):
    return SimpleNamespace(
        pass_index=1,
        tree_size=tree,
        tokens=[0] * tokens,
        accepted=tokens - 1 if accepted is None else accepted,
        draft_seconds=draft,
        target_seconds=target,
    )


def test_tuner_learns_high_acceptance_and_grows_the_budget():
    # t(n) = 1 + n/64. Prior slope 0.5 → B = 15 is best; a learned slope of 3 moves the optimum to 31.
    pts = {n: 1 + n / 64 for n in (1 << k for k in range(13))}
    timing = TimingModel(pts, draft_step_seconds=1e-6, source="profile")
    tuner = BudgetTuner(timing, TreeShape(64, 64), max_budget=4095, retune_every=4)
    assert tuner.shape.budget == 15
    for _ in range(96):
        b = tuner.shape.budget
        tuner.observe(event(tokens=1 + int(3 * math.log2(1 + b)), tree=b, target=timing.t_target(b + 1), draft=1e-6))
    assert tuner.shape.budget == 31
    assert 16 <= tuner.shape.max_depth <= 64  # accepted lengths reach 15+: the depth follows


def test_tuner_shrinks_when_nothing_is_accepted():
    timing = TimingModel({1: 1.0, 64: 1.2, 4096: 60.0}, draft_step_seconds=0.01, source="profile")
    tuner = BudgetTuner(timing, TreeShape(64, 64), max_budget=4095, retune_every=4)
    for _ in range(64):
        tuner.observe(event(tokens=1, tree=tuner.shape.budget, accepted=0))
    assert tuner.shape.budget <= 3  # plain decoding (0) once PLAIN_AFTER passes measured trees accept nothing
    assert tuner.expected_tokens(1023) < 1.8  # the slope rests on those passes (the prior still weighs in)


def test_depth_follows_observed_acceptance_and_respects_the_user_cap():
    tuner = BudgetTuner(TimingModel.prior(), TreeShape(64, 16), retune_every=1000)
    for _ in range(50):
        tuner.observe(event(tokens=4, tree=tuner.shape.budget))
    assert tuner.choose_depth(255) <= 16
    assert tuner.choose_depth(255) >= 4


def test_live_config_reads_the_holder_each_access():
    holder = ShapeHolder(TreeShape(8, 4))
    cfg = LiveConfig.wrap(GenerationConfig(seed=3, max_new_tokens=9), holder)
    assert cfg.shape.budget == 8 and cfg.seed == 3 and cfg.max_new_tokens == 9
    holder.shape = TreeShape(31, 6)
    assert cfg.shape == TreeShape(31, 6)
    assert replace(cfg, seed=4).shape == TreeShape(31, 6)


def test_make_tuner_uses_profile_timings_when_present():
    prof = {"models": {"target_seconds": {"1": 1.0, "256": 1.0, "512": 2.0}, "draft_step_seconds": 1e-4}}
    tuner = make_tuner(prof, TreeShape(64, 64), on_cuda=False)
    assert tuner.timing.source == "profile" and tuner.max_budget == 511
    assert make_tuner(None, TreeShape(64, 64), on_cuda=False).timing.source == "prior"


def test_tuned_generation_is_lossless(tiny_pair):
    """Swapping budgets between passes must not change greedy output."""
    import torch

    from specexec_cli.core.engine import DecodeState, generate
    from specexec_cli.session.loading import LoadOptions, load_models

    m = load_models(LoadOptions(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32", device="cpu"))
    ids = m.tokenizer("def f(x):\n  return")["input_ids"]
    cfg = GenerationConfig(shape=TreeShape(16, 16), max_new_tokens=24)
    ref = [t for ev in generate(m, DecodeState(), ids, cfg) for t in ev.tokens]
    tuner = BudgetTuner(TimingModel.prior(), TreeShape(16, 16), max_budget=255, retune_every=1)
    seen, out = set(), []
    for i, ev in enumerate(tuner.drive(m, DecodeState(), ids, cfg, torch.Generator().manual_seed(0))):
        out.extend(ev.tokens)
        tuner.holder.shape = TreeShape([1, 7, 31][i % 3], 8)  # force a different shape every pass
        seen.add(tuner.shape.budget)
    assert out == ref and len(seen) == 3


def test_without_a_profile_the_tuner_starts_from_the_plans_model():
    """No profile: --budget auto's tuner takes the memory plan's modelled seconds (its chosen candidate's
    tokens/s by budget, offload/planning/draftcost.py), so it starts at the budget the dry run's model
    ranks first, and may grow up to the largest budget the plan sized; no plan: the fallback prior."""
    from specexec_cli.core.budget import make_tuner

    rows = [
        dict(
            budget=b,
            tokens_per_pass=tpp,
            pass_seconds=p,
            draft_seconds=d,
            hidden_seconds=0.0,
            tokens_per_second=tpp / (p + d),
        )
        for b, tpp, p, d in ((16, 4.0, 1.0, 0.02), (64, 6.0, 1.0, 0.06), (256, 8.0, 1.9, 0.25))
    ]
    plan = {"choice": {"by_budget": rows, "budget": 64}, "candidates": [{"draft": "none", "pass_seconds": 0.9}]}
    tuner = make_tuner(None, TreeShape(budget=64, max_depth=64), False, plan)
    assert tuner.timing.source == "plan" and tuner.max_budget == 256
    assert tuner.timing.t_target(65) == 1.0 and tuner.timing.t_target(1) == 0.9
    assert tuner.timing.t_draft(256) == 0.25
    assert make_tuner(None, TreeShape(64, 64), False).timing.source == "prior"


def test_the_tuner_models_the_draft_the_run_uses_not_the_one_ranked_first():
    """An explicit small --draft whose plan ranks the self-draft first: --budget auto's tuner starts
    from the small draft's own row (`used`, session/options.load_planned), not the self-draft's."""

    def row(budget, draft_seconds):
        return dict(
            budget=budget,
            tokens_per_pass=4.0,
            pass_seconds=1.0,
            draft_seconds=draft_seconds,
            hidden_seconds=0.0,
            tokens_per_second=1.0,
        )

    plan = {
        "choice": {"draft": "self", "by_budget": [row(16, 0.5), row(64, 0.7)]},
        "used": {"draft": "/m/draft", "by_budget": [row(16, 0.02), row(64, 0.03)]},
        "candidates": [],
    }
    assert TimingModel.from_plan(plan).t_draft(64) == 0.03
    assert TimingModel.from_plan({**plan, "used": None}).t_draft(64) == 0.7


def test_a_profile_prices_only_the_draft_it_timed():
    """The profile timed a small draft; a self-draft run (or another small draft) takes the profile's
    target passes but the plan's modelled drafting, never the small draft's 2.5 ms steps."""
    small = {"step_seconds": 0.0025, "grow_seconds": {"16": 0.01, "128": 0.05}}
    prof = {
        "models": {
            "target_seconds": {"1": 0.55, "128": 0.57},
            "draft": "/m/draft",
            "draft_timings": {"small": small},
            "draft_step_seconds": 0.0025,
            "draft_grow_seconds": small["grow_seconds"],
        }
    }
    planned = TimingModel({1: 0.7, 128: 0.8}, 0.2, {16: 0.5, 128: 2.0}, source="plan")
    own = TimingModel.from_profile(prof, "small:/m/draft", planned)
    assert own.t_draft(128) == 0.05 and own.t_target(128) == 0.57
    for other in ("self-4", "small:/elsewhere/draft"):
        got = TimingModel.from_profile(prof, other, planned)
        assert got.t_draft(128) == 2.0 and got.t_target(128) == 0.57 and got.source == "profile"
    assert TimingModel.from_profile(prof, "self-4") is None  # nothing to price its drafting with
    assert TimingModel.from_profile(prof).t_draft(128) == 0.05  # no draft named: the first one timed
    plan = {
        "draft_key": "self-4",
        "choice": {
            "by_budget": [
                dict(
                    budget=b,
                    tokens_per_pass=4.0,
                    pass_seconds=0.8,
                    draft_seconds=d,
                    hidden_seconds=0.0,
                    tokens_per_second=1.0,
                )
                for b, d in ((16, 0.5), (128, 2.0))
            ]
        },
    }
    assert make_tuner(prof, TreeShape(64, 64), False, plan).timing.t_draft(128) == 2.0


def test_a_loaded_run_names_its_draft_for_the_tuner(tiny_pair):
    """session/options.load_planned records which draft the run uses (`draft_key`) and, for a small draft,
    its own candidate row (`used`), whatever the speed model ranks first."""
    from pathlib import Path

    from specexec_cli.session.loading import close_models
    from specexec_cli.session.options import ModelFlags, generation_config, load_planned, plan_for_cli

    cfg = generation_config("specexec", "auto", 64, 32, 32, 16, 0.0, None, None, 0, "cpu")
    flags = ModelFlags(
        target=str(tiny_pair[0]),
        draft=str(tiny_pair[1]),
        dtype="fp32",
        device="cpu",
        offload="disk",
        ctx=256,
        temperature=0.0,
    )
    opts, plan, cfg = plan_for_cli(flags, cfg)
    models = load_planned(opts, plan, None)
    try:
        pj = models.plan_json
        assert pj["draft_key"] == f"small:{Path(tiny_pair[1]).resolve()}"
        assert pj["used"]["draft"] not in ("self", "none") and pj["used"]["by_budget"]
    finally:
        close_models(models)


def test_tuner_falls_back_to_plain_decoding_when_trees_measure_slower_and_probes_again():
    """The model has trees pay; measured, 2 tokens a pass cost 0.6 s (draft 0.5 + target 0.1) where a
    plain step's pass takes 0.1 s: after PLAIN_AFTER passes the tuner decodes plainly (budget PLAIN,
    no draft forward), and after PROBE_EVERY plain passes it measures its best tree again."""
    from specexec_cli.core.budget import PLAIN, PLAIN_AFTER, PROBE_EVERY

    timing = TimingModel({1: 0.1, 16: 0.1, 256: 0.15, 4096: 60.0}, draft_step_seconds=0.001, source="profile")
    tuner = BudgetTuner(timing, TreeShape(64, 64), max_budget=255, retune_every=4)
    assert tuner.shape.budget > PLAIN
    while tuner.passes < PLAIN_AFTER:
        tuner.observe(event(tokens=2, tree=tuner.shape.budget, draft=0.5, target=0.1))
    assert tuner.shape.budget == PLAIN
    for _ in range(PROBE_EVERY - 1):
        tuner.observe(event(tokens=1, tree=0, draft=0.0, target=0.1))
    assert tuner.shape.budget == PLAIN
    tuner.observe(event(tokens=1, tree=0, draft=0.0, target=0.1))
    assert tuner.shape.budget > PLAIN


def test_a_fallback_on_the_model_is_judged_again_once_plain_passes_are_measured():
    """From disk a tree's verify pass hides its weight reads under the draft and a plain pass cannot:
    rescaled by the trees' passes (0.03 s where the model says 0.1), plain steps model at 0.03 s and
    win, so the tuner tries them; measured at 0.065 s, PLAIN_TRIAL of them send it back to the tree
    (2.6 tokens per 0.075 s beat one per 0.065 s)."""
    from specexec_cli.core.budget import PLAIN, PLAIN_AFTER, PLAIN_TRIAL

    timing = TimingModel({1: 0.1, 16: 0.1, 256: 0.15, 4096: 60.0}, draft_step_seconds=0.01, source="profile")
    tuner = BudgetTuner(timing, TreeShape(4, 4), max_budget=4, retune_every=8)
    while tuner.passes < PLAIN_AFTER:
        tuner.observe(event(tokens=3, tree=tuner.shape.budget, draft=0.045, target=0.03))
    assert tuner.shape.budget == PLAIN  # the model's plain pass, rescaled: 0.03 s
    for _ in range(PLAIN_TRIAL - 1):
        tuner.observe(event(tokens=1, tree=0, draft=0.0, target=0.065))
    assert tuner.shape.budget == PLAIN
    tuner.observe(event(tokens=1, tree=0, draft=0.0, target=0.065))
    assert tuner.shape.budget > PLAIN  # measured: the tree is faster


def test_tuner_keeps_trees_that_measure_faster_than_plain_steps():
    timing = TimingModel({1: 0.1, 16: 0.1, 256: 0.15, 4096: 60.0}, draft_step_seconds=0.001, source="profile")
    tuner = BudgetTuner(timing, TreeShape(64, 64), max_budget=255, retune_every=4)
    for _ in range(48):
        tuner.observe(event(tokens=3, tree=tuner.shape.budget, draft=0.05, target=0.1))
    assert tuner.shape.budget > 0


def test_min_prob_is_a_draft_forward_over_a_token():
    """Each shape the tuner hands out stops expanding nodes whose cumulative probability is below a draft
    forward's seconds over a token's (its models at that budget): high where the draft costs a lot beside
    the target pass, near zero for a cheap draft beside a slow pass, capped, and 0 for plain decoding."""
    import math

    from specexec_cli.core.budget import MAX_MIN_PROB, PLAIN

    def tuner(step: float) -> BudgetTuner:
        return BudgetTuner(TimingModel({1: 0.05, 64: 0.06}, draft_step_seconds=step), TreeShape(15, 15), max_budget=63)

    for step in (1e-4, 0.005, 0.02):
        t = tuner(step)
        b = t.shape.budget
        steps = 1 + math.ceil(b / t.shape.max_beams) + math.log2(1 + b)
        token = (t.t_draft(b) + t.t_target(b + 1)) / t.expected_tokens(b)
        assert t.shape.min_prob == pytest.approx(min(MAX_MIN_PROB, t.t_draft(b) / steps / token))
    assert tuner(1e-4).shape.min_prob < 0.01 < tuner(0.02).shape.min_prob <= MAX_MIN_PROB
    assert tuner(0.005).min_prob(PLAIN) == 0.0
