"""The pass model knows the exact GGUF CPU kernel (offload/cpu/ggml_kernel.py).

A resident layer of a GGUF whose linears the kernel serves is dequantized once at load (an fp32
copy for trees) but a decode token multiplies the file's packed blocks: on SmolLM2 96 MB a token
instead of 538 MB. The plan says which layers and head the kernel serves (`plan.kernel`), and
passcost.target_pass reads their packed bytes at the kernel's measured rate up to its rows, the
fp32 copy above them; with the kernel off, nothing changes from the dense model.
"""

from __future__ import annotations

import pytest

from offload.planning.membytes import arch_of
from offload.planning.passcost import GGUF_KERNEL, device_for, linear_weights, target_pass
from specexec_cli.core.draft import TreeShape
from specexec_cli.session.loading import LoadOptions
from specexec_cli.session.planning import make_plan

RATE, MEM = 12e9, 20e9


def _plan(path, monkeypatch, kernel: bool):
    monkeypatch.setenv("SPECX_GGUF_KERNEL", "on" if kernel else "off")
    opts = LoadOptions(target=str(path), draft=None, device="cpu", offload="none", ctx=256)
    plan = make_plan(opts, TreeShape(budget=16, max_depth=8, max_beams=4), budget_auto=False)
    assert plan.fits, plan.reason
    return plan


def test_the_plan_names_what_the_kernel_serves(smollm2, monkeypatch):
    from offload.cpu import ggml_kernel
    from offload.formats import open_checkpoint

    plan = _plan(smollm2, monkeypatch, kernel=True)
    head = open_checkpoint(smollm2).tensors["model.embed_tokens.weight"].nbytes
    assert plan.dense_layers == list(range(30))
    assert plan.kernel == dict(
        layers=list(range(30)),
        rows=ggml_kernel.MAX_ROWS,
        head_bytes=head,
        stack=True,
        llama=True,
        stack_rows=ggml_kernel.MAX_ROWS,
        draft_head_cost=ggml_kernel.COST[ggml_kernel.Q8A],  # its Q8_0 head, as the self-draft reads it
    )
    assert _plan(smollm2, monkeypatch, kernel=False).kernel == dict(
        layers=[], rows=0, head_bytes=0, stack=False, llama=True, stack_rows=ggml_kernel.MAX_ROWS
    )


def test_a_decode_token_reads_packed_bytes_and_a_tree_the_fp32_copy(smollm2, monkeypatch):
    from offload.formats import open_checkpoint

    a = arch_of(open_checkpoint(smollm2).config)
    plan = _plan(smollm2, monkeypatch, kernel=True)
    dev = device_for("cpu", dequant_bps={GGUF_KERNEL: RATE}, memory_bps=MEM)
    one = target_pass(a, plan, dev, 1, 64, 4, "int4-unpack")
    assert one.gemm == pytest.approx(sum(plan.layer_bytes) / RATE)
    assert one.dequant == 0
    assert one.head == pytest.approx(plan.kernel["head_bytes"] / RATE)
    tree = target_pass(a, plan, dev, 64, 64, 4, "int4-unpack")  # above the kernel's rows: the fp32 copy
    per_layer = max(2 * linear_weights(a) * 64 / dev.flops32, linear_weights(a) * 4 / MEM)
    assert tree.gemm == pytest.approx(30 * per_layer)
    off = target_pass(a, _plan(smollm2, monkeypatch, kernel=False), dev, 1, 64, 4, "int4-unpack")
    assert off.gemm == pytest.approx(30 * linear_weights(a) * 4 / MEM)  # every layer still dense: its fp32 copy
    assert one.seconds < off.seconds


def test_a_k_quant_layer_costs_its_types_measured_factor(tmp_path, monkeypatch):
    """A Q4_K_M layer (Q4_K with Q6_K v/down): its packed bytes cost COST[type] times Q4_1's per byte."""
    pytest.importorskip("gguf")
    from offload.cpu import ggml_kernel
    from offload.formats import open_checkpoint
    from tests.conftest import make_model
    from tests.gguf_build import write_gguf

    hf = make_model(tmp_path / "hf", seed=3, layers=2, hidden=256)
    f = write_gguf(hf, tmp_path / "m" / "tiny-Q4_K_M.gguf", "Q4_K", mix={"v_proj": "Q6_K", "down_proj": "Q6_K"})
    plan = _plan(f, monkeypatch, kernel=True)
    ck = open_checkpoint(f)
    for i in range(2):
        names = [n for n, t in ck.tensors.items() if n.startswith(f"model.layers.{i}.") and t.qtype is not None]
        want = sum(ck.tensors[n].nbytes * ggml_kernel.COST[ck.tensors[n].meta["ggml_type"]] for n in names)
        assert plan.kernel["cost"][i] == pytest.approx(want / sum(ck.tensors[n].nbytes for n in names), abs=1e-4)
        assert ggml_kernel.COST[14] < plan.kernel["cost"][i] < ggml_kernel.COST[12]  # a mix of Q6_K and Q4_K bytes
    assert plan.kernel["head_cost"] == ggml_kernel.COST[12]  # the head is Q4_K here
    a = arch_of(ck.config)
    dev = device_for("cpu", dequant_bps={GGUF_KERNEL: RATE}, memory_bps=MEM)
    one = target_pass(a, plan, dev, 1, 64, 4, "int4-unpack")
    assert one.gemm == pytest.approx(sum(b * plan.kernel["cost"][i] for i, b in enumerate(plan.layer_bytes)) / RATE)
    assert one.head == pytest.approx(plan.kernel["head_bytes"] * ggml_kernel.COST[12] / RATE)


def test_the_layer_skip_draft_on_a_k_quant_stack_is_priced(tmp_path, monkeypatch):
    """--draft self on a resident K-quant stack (beams within the kernel's rows) plans its layer-skip
    draft through the kernel's per-type cost."""
    pytest.importorskip("gguf")
    from tests.conftest import make_model
    from tests.gguf_build import write_gguf

    hf = make_model(tmp_path / "hf", seed=3, layers=2, hidden=256)
    f = write_gguf(hf, tmp_path / "m" / "tiny-Q4_K_M.gguf", "Q4_K", mix={"v_proj": "Q6_K", "down_proj": "Q6_K"})
    monkeypatch.setenv("SPECX_GGUF_KERNEL", "on")
    opts = LoadOptions(target=str(f), draft="self", device="cpu", offload="none", ctx=256)
    plan = make_plan(opts, TreeShape(budget=16, max_depth=8, max_beams=4), budget_auto=False)
    assert plan.fits and plan.kernel["stack"] and plan.kernel["cost"]
    assert any(c["draft"] != "none" and c["tokens_per_second"] > 0 for c in plan.candidates)
