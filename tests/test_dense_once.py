"""Resident packed layers are dequantized once at load (offload/quant/dense.py), planned and counted.

A tiny Q4_1 GGUF (the real model's type): the memory plan names the resident layers it dequantizes
once and counts their bytes; the loader does exactly that (DevicePool "dequantized_layers" == the
plan), the forward then never dequantizes those layers again, and the logits are bitwise those of
the per-forward path (and of transformers' fp32 GGUF load). A cap with room for only part of them
dequantizes a prefix of the resident layers and leaves the rest per forward.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("gguf")

from offload.formats import open_checkpoint
from offload.formats.qlinear import PackedLinear
from offload.planning.memplan import PlanRequest, plan_memory
from offload.quant.dense import dense_bytes, dense_linears
from offload.stream.model import OffloadedCausalLM
from tests.conftest import make_model
from tests.gguf_build import write_gguf
from tests.probes import undensify

IDS = torch.tensor([[1, 5, 9, 3, 22, 7, 7, 30]])


@pytest.fixture(autouse=True)
def _dequantizing_path(monkeypatch):
    """`dense` against per-forward dequantization: the CPU kernel, which serves batches this small
    (offload/cpu/ggml_kernel.py, tests/test_ggml_kernel.py), stays out of the comparison."""
    monkeypatch.setenv("SPECX_GGUF_KERNEL", "off")


@pytest.fixture(scope="module")
def q41(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    hf = make_model(root / "hf", seed=3, layers=3, hidden=256)
    return write_gguf(hf, root / "m" / "tiny-q4_1.gguf", "Q4_1")


def _req(**kw) -> PlanRequest:
    return PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=8 << 30, ctx=64, budget=8, **kw)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_plan_counts_and_loader_dequantizes_once(q41, monkeypatch):
    ck = open_checkpoint(q41)
    plan = plan_memory(ck, None, _req())
    assert plan.fits and plan.resident == [0, 1, 2]
    assert plan.dense_layers == [0, 1, 2]
    want = sum(dense_bytes(ck, i, 4) for i in range(3))
    assert want > 0 and plan.device_bytes["dequantized_layers"] == want
    assert any("dequantized once" in n for n in plan.notes)
    model = OffloadedCausalLM.from_pretrained(ck, device="cpu", dtype=torch.float32, memplan=plan)
    try:
        assert model.pool.by_component["dequantized_layers"] == want
        mods = [m for layer in model.layers for _, m in dense_linears(layer)]
        assert mods and all(m.dense is not None and m.dense.dtype == torch.float32 for m in mods)
        calls = []
        real = PackedLinear.dequantized
        monkeypatch.setattr(PackedLinear, "dequantized", lambda self, d: calls.append(1) or real(self, d))
        once = _logits(model)
        assert calls == []  # no dequantization during the forward
        for layer in model.layers:
            undensify(layer, model.pool)
        assert model.pool.by_component["dequantized_layers"] == 0
        per_pass = _logits(model)
        assert calls  # the per-forward path really ran
        assert torch.equal(once, per_pass)
    finally:
        model.close()


def test_cap_leaves_room_for_some(q41):
    ck = open_checkpoint(q41)
    full = plan_memory(ck, None, _req())
    one = dense_bytes(ck, 0, 4)
    # room for every resident layer packed, but for only one of them dequantized
    cap = full.device_total - full.device_bytes["dequantized_layers"] + one + one // 2
    plan = plan_memory(ck, None, _req(max_gpu_memory=cap))
    assert plan.fits and plan.resident == [0, 1, 2]
    assert plan.dense_layers == [0] and plan.device_bytes["dequantized_layers"] == one
    assert plan.device_total <= cap
    model = OffloadedCausalLM.from_pretrained(ck, device="cpu", dtype=torch.float32, memplan=plan)
    try:
        dense = [[m.dense is not None for _, m in dense_linears(layer)] for layer in model.layers]
        assert all(dense[0]) and not any(dense[1]) and not any(dense[2])
        ref = OffloadedCausalLM.from_pretrained(
            ck, device="cpu", dtype=torch.float32, memplan=replace(plan, dense_layers=[])
        )
        try:
            assert torch.equal(_logits(model), _logits(ref))
        finally:
            ref.close()
    finally:
        model.close()


def test_library_load_dequantizes_resident_layers(q41):
    """Without a memory plan (library use) resident layers are dequantized once when RAM allows."""
    model = OffloadedCausalLM.from_pretrained(q41, device="cpu", dtype=torch.float32, offload="none")
    try:
        assert model.plan.dense == [0, 1, 2]
    finally:
        model.close()
    streamed = OffloadedCausalLM.from_pretrained(q41, device="cpu", dtype=torch.float32, offload="ram")
    try:
        assert streamed.plan.dense == []  # streamed layers dequantize per pass
    finally:
        streamed.close()


def test_pass_model_knows_dense_layers(q41):
    """The speed model: a layer dequantized once reads its weights in the compute dtype and pays no
    dequantization; one dequantized per forward pays it."""
    from offload.planning.membytes import arch_of
    from offload.planning.passcost import device_for, linear_weights, target_pass

    ck = open_checkpoint(q41)
    plan = plan_memory(ck, None, _req())
    a, dev = arch_of(ck.config), device_for("cpu")
    once = target_pass(a, plan, dev, 1, 64, 4, "int4-unpack")
    per = target_pass(a, replace(plan, dense_layers=[]), dev, 1, 64, 4, "int4-unpack")
    assert once.dequant == 0 and per.dequant > 0
    assert once.gemm == pytest.approx(3 * linear_weights(a) * 4 / dev.memory_bps)
    assert once.seconds < per.seconds
