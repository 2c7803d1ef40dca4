"""The self-draft's width choice models the kernel the run actually uses on its device (issue 41).

A plan for `--draft self` on the CPU (tiny models, every layer streamed from disk) lists a candidate per
width with the dequantizing path it modelled (`kernel`) and that path's traffic (`dequant_bytes`). The
models are then really loaded with that plan: the substitute linears' kernel must be the one the
candidate was costed with, and its dequantization traffic must be that kernel's per-weight count
(offload/planning/draftcost.DEQUANT_ELEMS) times the substituted weights -- so a cost model that
credits a compiled kernel the run does not use fails here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from offload.planning.membytes import arch_of
from offload.planning.passcost import linear_weights as linear_numel
from specexec_cli.core.draft import TreeShape
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.session.planning import make_plan

RUN_KERNEL = {"eager": "hqq-eager", "fused": "hqq-compiled"}  # LowbitLinear.kernel -> the cost model's name


def blocks_built() -> bool:
    import torch

    from offload.quant.fused import kernel_choice

    return kernel_choice("cpu", torch.float32) == "blocks"


def plan_for(target, bits):
    opts = LoadOptions(target=str(target), draft="self", device="cpu", offload="disk", ctx=96, draft_bits=bits)
    plan = make_plan(opts, TreeShape(budget=8, max_depth=4, max_beams=4), budget_auto=False)
    assert plan.fits, plan.reason
    return opts, plan


def run_kernels(opts, plan) -> set[str]:
    from offload.quant.lowbit import LowbitLinear
    from offload.quant.lowbit_pack import KernelLowbitLinear

    models = load_models(replace(opts, plan=plan))
    try:
        return {RUN_KERNEL[m.kernel] for m in models.draft.modules() if isinstance(m, LowbitLinear)} | {
            "sx-blocks" for m in models.draft.modules() if isinstance(m, KernelLowbitLinear)
        }
    finally:
        models.close() if hasattr(models, "close") else None


@pytest.mark.parametrize("env", ["auto", "fused"])
@pytest.mark.parametrize("bits", [3, 2])
def test_each_width_is_costed_with_the_kernel_its_run_uses(tiny_pair, monkeypatch, env, bits):
    pytest.importorskip("hqq")
    monkeypatch.setenv("SPECX_LOWBIT_KERNEL", env)
    opts, plan = plan_for(tiny_pair[0], bits)
    (cand,) = [c for c in plan.candidates if c["draft"] == "self"]
    used = run_kernels(opts, plan)
    assert used == {cand["kernel"]}, (used, cand["kernel"])
    a = arch_of(__import__("json").loads((tiny_pair[0] / "config.json").read_text()))
    if env == "auto" and blocks_built():  # the CPU default: the kernel's blocks, nothing dequantized
        assert cand["kernel"] == "sx-blocks" and cand["dequant_bytes"] == 0 and plan.dense_draft_layers == []
        return
    per_weight = {"hqq-eager": 6, "hqq-compiled": 3}[cand["kernel"]]  # CPU: eager reference / Inductor graph
    # substitutes dequantized once at load (the plan had room: all of them here) rebuild nothing per forward
    assert plan.dense_draft_layers == list(range(a.layers))
    per_forward = a.layers - len(plan.dense_draft_layers)
    assert cand["dequant_bytes"] == linear_numel(a) * 4 * per_forward * per_weight


def test_cpu_auto_width_is_the_eager_kernels_choice(tiny_pair, monkeypatch):
    """Without --draft-bits on the CPU (SPECX_LOWBIT_KERNEL=eager: eager HQQ), the 3/2-bit substitutes are
    dequantized once where the plan has room (all of them here), so their candidates carry no
    dequantization traffic and read their linears in the compute dtype, while the 4-bit (nf4) one
    dequantizes per forward (two compute-dtype elements a weight); the chosen width is the candidate
    with the most modelled tokens/s."""
    pytest.importorskip("hqq")
    monkeypatch.setenv("SPECX_LOWBIT_KERNEL", "eager")
    _, plan = plan_for(tiny_pair[0], None)
    by_bits = {c["bits"]: c for c in plan.candidates if c["draft"] == "self"}
    assert {by_bits[b]["kernel"] for b in (3, 2)} == {"hqq-eager"} and by_bits[4]["kernel"] == "nf4-dequant"
    a = arch_of(__import__("json").loads((tiny_pair[0] / "config.json").read_text()))
    assert by_bits[4]["dequant_bytes"] == linear_numel(a) * 4 * a.layers * 2
    assert all(by_bits[b]["dequant_bytes"] == 0 for b in (3, 2))
    assert all(by_bits[b]["weight_bytes"] >= linear_numel(a) * 4 * a.layers for b in (3, 2))
    top = max(by_bits.values(), key=lambda c: c["tokens_per_second"])
    assert plan.substitute_bits == top["bits"] == plan.choice["bits"]


def test_cpu_auto_width_with_the_kernels_blocks(tiny_pair, monkeypatch):
    """The CPU default (SPECX_LOWBIT_KERNEL=auto with the C kernel built): the 3/2-bit substitutes are
    the kernel's blocks, read packed (under a byte a weight) and never dequantized."""
    pytest.importorskip("hqq")
    if not blocks_built():
        pytest.skip("the C kernel is not built here")
    monkeypatch.setenv("SPECX_LOWBIT_KERNEL", "auto")
    _, plan = plan_for(tiny_pair[0], None)
    by_bits = {c["bits"]: c for c in plan.candidates if c["draft"] == "self"}
    a = arch_of(__import__("json").loads((tiny_pair[0] / "config.json").read_text()))
    for b in (3, 2):
        assert by_bits[b]["kernel"] == "sx-blocks" and by_bits[b]["dequant_bytes"] == 0
    top = max(by_bits.values(), key=lambda c: c["tokens_per_second"])
    assert plan.substitute_bits == top["bits"] == plan.choice["bits"] and plan.dense_draft_layers == []
    assert 0 < plan.device_bytes["draft"] < linear_numel(a) * a.layers  # packed: under a byte a weight
