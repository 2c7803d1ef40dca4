"""The self-draft's HQQ substitutes are dequantized once at load where the plan has room.

`--draft self` with 3- or 2-bit substitutes rebuilt their 16-bit weights on every draft forward; on a
CPU that was most of a pass (SmolLM2 from disk, budget 16: 1.7 s of drafting per pass). The memory
plan now lists the substitutes it has room to keep dequantized (`dense_draft_layers`, component
"dequantized_draft"), the loader does exactly that (the pool counts the plan's bytes), and, the
values being those the per-forward path rebuilds, decoding is the same token for token and pass for
pass. Where the room is short, a prefix of them is kept and the rest rebuild per forward.
On a CPU in fp32 with the kernel built, the substitutes load as its blocks instead and none is
dequantized (tests/test_lowbit_blocks.py); the tests of the dense path here ask for the fused
kernel ($SPECX_LOWBIT_KERNEL=fused), as a GPU or a build without the kernel has it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from offload.planning.membytes import arch_of
from offload.planning.memlayers import LayerSizes, dense_substitutes
from offload.planning.passcost import linear_weights as linear_numel
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import generate
from specexec_cli.session.loading import LoadOptions, load_models
from specexec_cli.session.planning import make_plan

SHAPE = TreeShape(budget=8, max_depth=4, max_beams=4)


def _plan(target, bits: int):
    opts = LoadOptions(target=str(target), draft="self", device="cpu", offload="disk", ctx=96, draft_bits=bits)
    plan = make_plan(opts, SHAPE, budget_auto=False)
    assert plan.fits, plan.reason
    return opts, plan


def _decode(opts, plan) -> tuple[list[int], int, dict, object]:
    from offload.quant.lowbit import LowbitLinear

    models = load_models(replace(opts, plan=plan))
    try:
        cfg = GenerationConfig(method="specexec", shape=SHAPE, max_new_tokens=24)
        events = list(generate(models, DecodeState(), [3, 5, 7, 9, 11], cfg))
        dense = [m.dense is not None for m in models.draft.modules() if isinstance(m, LowbitLinear)]
        return (
            [t for ev in events for t in ev.tokens],
            sum(1 for ev in events if ev.tokens),
            dict(models.pool.by_component),
            dense,
        )
    finally:
        models.close() if hasattr(models, "close") else None


@pytest.fixture(autouse=True)
def _fused(monkeypatch):
    monkeypatch.setenv("SPECX_LOWBIT_KERNEL", "fused")


@pytest.mark.parametrize("bits", [3, 2])
def test_planned_counted_and_the_same_decoding(tiny_pair, bits):
    pytest.importorskip("hqq")
    opts, plan = _plan(tiny_pair[0], bits)
    a = arch_of(__import__("json").loads((tiny_pair[0] / "config.json").read_text()))
    assert plan.dense_draft_layers == list(range(a.layers))  # every layer streams, each has a substitute
    assert plan.device_bytes["dequantized_draft"] == a.layers * linear_numel(a) * 4
    ids, passes, counted, dense = _decode(opts, plan)
    assert counted["dequantized_draft"] == plan.device_bytes["dequantized_draft"]
    assert dense and all(dense)
    per_forward = replace(plan, dense_draft_layers=[])
    ids0, passes0, counted0, dense0 = _decode(opts, per_forward)
    assert "dequantized_draft" not in counted0 and not any(dense0)
    assert (ids, passes) == (ids0, passes0)


def test_short_room_keeps_a_prefix_and_nf4_or_no_self_draft_keeps_none():
    class Req:
        self_draft, draft_bits = True, 3
        dtype, draft_dtype, device = "fp32", None, "cpu"

    a = arch_of(
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=45,
            model_type="llama",
        )
    )
    per = linear_numel(a) * 4
    lay = LayerSizes([], [], [], [], [], 0, substitute=[10, 10, 0, 10])  # layer 2: left out (no substitute)
    assert dense_substitutes(lay, [], Req, a, 10 * per) == ([0, 1, 3], 3 * per)
    with pytest.MonkeyPatch.context() as mp:  # the kernel's blocks (the CPU default): nothing dequantized
        mp.delenv("SPECX_LOWBIT_KERNEL")
        from offload.quant.fused import kernel_choice

        if kernel_choice("cpu", __import__("torch").float32) == "blocks":
            assert dense_substitutes(lay, [], Req, a, 10 * per) == ([], 0)
    assert dense_substitutes(lay, [1], Req, a, 10 * per) == ([0, 3], 2 * per)  # resident: the target's own
    assert dense_substitutes(lay, [], Req, a, 2 * per + per // 2) == ([0, 1], 2 * per)
    Req.draft_bits = 4  # NF4 substitutes: bitsandbytes' kernels, never densified
    assert dense_substitutes(lay, [], Req, a, 10 * per) == ([], 0)
    Req.self_draft, Req.draft_bits = False, 3
    assert dense_substitutes(lay, [], Req, a, 10 * per) == ([], 0)
