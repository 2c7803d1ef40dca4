"""The layer-skip self-draft of a resident target (offload/selfdraft/build.build_skip_draft, selfplan.skip_plan).

What must hold: where every target layer is resident, `--draft self` drafts with the target itself,
some layers left out (pass-throughs), every other module the target's own object and no device byte
of its own, for an offloaded target (all resident) and an HF-resident one (`--offload none`);
decoding stays lossless (ids equal `--method ar`'s, greedy and sampled with a seed); the skipped
layers follow the rule (influence, middle, alternate: every other layer); the memory plan offers it
as a candidate beside plain decoding with its modelled figures, and `--draft auto` takes it exactly
when the model says it is faster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from typer.testing import CliRunner

from offload import OffloadedCausalLM
from offload.selfdraft.build import LAYER_SKIP, PassThrough, SelfDraftError, build_skip_draft
from offload.selfdraft.influence import rule_order
from specexec_cli.terminal.app import app
from tests.conftest import make_model

runner = CliRunner()
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("skipdraft") / "t", seed=23, layers=6, hidden=64)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))


def run(tmp_path, target, *extra, temperature="0"):
    prompt, stats = tmp_path / "p.txt", tmp_path / f"s{len(list(tmp_path.iterdir()))}.json"
    prompt.write_text(PROMPT)
    res = runner.invoke(
        app,
        [
            "run",
            str(prompt),
            "--target",
            str(target),
            "--device",
            "cpu",
            "--no-live",
            "--no-chat-template",
            "--temperature",
            temperature,
            "--seed",
            "7",
            "--max-new-tokens",
            "24",
            "--budget",
            "16",
            "--stats-json",
            str(stats),
            *extra,
        ],
    )
    assert res.exit_code == 0, res.output
    return json.loads(stats.read_text()), res


def test_the_draft_is_the_targets_own_layers_with_some_left_out(target):
    t = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="none")
    d = build_skip_draft(t, [2, 4])
    try:
        assert not t.plan.streamed and d.substitute_bits == LAYER_SKIP and d.skipped == [2, 4]
        for i in range(6):
            assert isinstance(d.layers[i], PassThrough) if i in (2, 4) else d.layers[i] is t.layers[i]
        assert d.embed_tokens is t.embed_tokens and d.lm_head is t.lm_head and d.norm is t.norm
        assert d.pool.allocated == 0
    finally:
        d.close()
        t.close()


@pytest.mark.parametrize("skip", [[], [0, 1, 2, 3, 4, 5], [6]])
def test_a_skip_that_leaves_nothing_out_or_everything_is_refused(target, skip):
    t = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="none")
    try:
        with pytest.raises(SelfDraftError, match=r"fix:|must be some of"):
            build_skip_draft(t, skip)
    finally:
        t.close()


def test_alternate_rule_leaves_out_every_other_layer_first():
    order = rule_order(30, "alternate")
    assert sorted(order[:14]) == list(range(1, 29, 2))  # 14 of 30: exactly the odd inner layers
    assert sorted(order) == list(range(1, 29)) and 0 not in order and 29 not in order
    assert rule_order(30, "middle")[:2] == [14, 15] or sorted(rule_order(30, "middle")[:2]) == [14, 15]
    with pytest.raises(ValueError, match="skip rule"):
        rule_order(30, "random")


@pytest.mark.parametrize("offload", ["auto", "none"])
def test_layer_skip_draft_is_lossless_on_a_resident_target(tmp_path, target, offload):
    ar, _ = run(tmp_path, target, "--method", "ar", "--offload", offload)
    sd, res = run(tmp_path, target, "--draft", "self", "--offload", offload)
    assert sd["method"] == "specexec" and sd["target_passes"] < sd["new_tokens"], "it really drafted"
    assert sd["token_ids"] == ar["token_ids"]
    assert "nothing to substitute" not in res.stderr


def test_sampled_ids_equal_ar_with_the_same_seed(tmp_path, target):
    ar, _ = run(tmp_path, target, "--method", "ar", temperature="0.8")
    sd, _ = run(tmp_path, target, "--draft", "self", temperature="0.8")
    assert sd["token_ids"] == ar["token_ids"]


def plan_for(target, temperature=0.0):
    from offload.planning.memplan import PlanRequest, plan_memory
    from tests.sparse_ckpt import read_checkpoint

    req = PlanRequest(
        device="cpu",
        dtype="fp32",
        draft_dtype="fp32",
        ram_free=8 << 30,
        ctx=512,
        budget=64,
        budget_auto=True,
        self_draft=True,
        temperature=temperature,
    )
    return plan_memory(read_checkpoint(target), None, req)


def test_plan_offers_the_layer_skip_draft_beside_plain_decoding(target):
    from offload.planning.selfplan import default_skip

    p = plan_for(target)
    assert p.fits and not p.ram_layers and not p.disk_layers
    assert p.substitute_bits == LAYER_SKIP and len(p.skipped_layers) == default_skip(6)
    kinds = {(c["draft"], c["bits"]) for c in p.candidates}
    assert kinds == {("self", LAYER_SKIP), ("none", None)}
    skip = next(c for c in p.candidates if c["draft"] == "self")
    assert skip["draft_seconds"] > 0 and skip["weight_bytes"] < sum(p.layer_bytes) + 10**9
    assert any("layers left out" in n for n in p.notes)


@dataclass(frozen=True)
class Opts:
    draft: str = "auto"


@pytest.mark.parametrize("tpp, step_floor, picked", [(50.0, 0.0005, "self"), (1.0, None, None)])
def test_draft_auto_takes_the_layer_skip_draft_only_when_modelled_faster(target, monkeypatch, tpp, step_floor, picked):
    """A draft that accepts 50 tokens a pass, on a device whose draft step costs little beside a target
    pass, wins; one that accepts a single token never does. (Each draft forward pays the step floor, and a
    tree of 50 accepted tokens takes 50+ forwards: with the CPU prior's 10 ms step floor on this tiny
    target a draft step costs a whole pass, so no acceptance rate would pay for it.)"""
    from offload.planning import acceptance, passcost
    from specexec_cli.session.planning import resolve_auto

    table = {"greedy": {16: tpp, 64: tpp}, "sampled": {16: tpp, 64: tpp}}
    monkeypatch.setitem(acceptance.TOKENS_PER_PASS, "skip", table)
    if step_floor is not None:
        monkeypatch.setitem(passcost.PRIORS, "cpu", {**passcost.PRIORS["cpu"], "step_floor_s": step_floor})
    p = plan_for(target)
    got, _ = resolve_auto(Opts(), p, lambda o: p)
    rates = {c["draft"]: c["tokens_per_second"] for c in p.candidates}
    assert (rates["self"] > rates["none"]) == (picked == "self")
    assert got.draft == picked
