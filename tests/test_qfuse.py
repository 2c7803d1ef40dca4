"""Sibling GGUF linears (q/k/v, gate/up) computed as one kernel call (offload/formats/qfuse.py).

A tiny Q4_1 GGUF (the real model's type, Q/K rows permuted as llama.cpp stores them): the loader
attaches the groups, a decode pass runs 4 kernel calls per layer instead of 7, and its logits are
bitwise those of the same model with every linear computing alone, at 1 and 4 tokens (the kernel)
and 16 (over its row limit with the dequantized copy: the per-module path); streamed layers
(re-bound per pass, no copy: the kernel at any batch) likewise where their bytes lie back to back.
A group returns nothing where it must not serve: another input object, an input written in place
between the sibling calls, bytes that do not lie back to back.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from offload.cpu import ggml_kernel
from offload.formats import qfuse
from offload.formats.qlinear import PackedLinear
from offload.stream.model import OffloadedCausalLM
from tests.conftest import make_model
from tests.gguf_build import write_gguf
from tests.probes import unfuse

pytestmark = pytest.mark.skipif(not ggml_kernel.enabled(), reason="no C compiler: the GGUF kernel is off")


@pytest.fixture(autouse=True)
def layer_by_layer(monkeypatch):
    """The groups serve HF's layers one by one: the one-call stack (cpu/leanstack.py, which reads
    the same stacked bytes in C, tests/test_leanstack.py) is off here."""
    monkeypatch.setenv("SPECX_DECODE_STACK", "off")


@pytest.fixture(scope="module")
def q41(tmp_path_factory):
    root = tmp_path_factory.mktemp("qfuse")
    hf = make_model(root / "hf", seed=5, layers=3, hidden=256)
    return write_gguf(hf, root / "m" / "tiny-q4_1.gguf", "Q4_1")


def _load(f, offload="none", **kw):
    return OffloadedCausalLM.from_pretrained(f, device="cpu", dtype=torch.float32, offload=offload, **kw)


def _pass(model, tokens: int, kernel_calls: list) -> tuple[torch.Tensor, int]:
    """Logits of a `tokens`-token pass after a 9-token prefix, and the kernel calls it made."""
    from specexec_cli.core import kvcache
    from specexec_cli.core.tree import causal_mask

    cache = kvcache.new_cache()
    kvcache.forward(model, cache, torch.arange(1, 10), torch.arange(9), None)
    mask = causal_mask(9, tokens, torch.float32, model.device)
    calls = len(kernel_calls)
    out = kvcache.forward(model, cache, torch.arange(3, 3 + tokens), torch.arange(9, 9 + tokens), mask)
    return out, len(kernel_calls) - calls


def _unfused(model):
    for layer in model.layers:
        unfuse(layer)


def test_groups_attached_and_one_call_per_group(q41, kernel_calls):
    model = _load(q41)
    try:
        for layer in model.layers:
            qkv = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
            assert qkv[0].group is not None and all(m.group is qkv[0].group for m in qkv)
            assert layer.mlp.gate_proj.group is layer.mlp.up_proj.group is not None
            assert layer.self_attn.o_proj.group is None and layer.mlp.down_proj.group is None
        over = ggml_kernel.MAX_ROWS + 1
        fused = {t: _pass(model, t, kernel_calls) for t in (1, 4, over)}
        _unfused(model)
        alone = {t: _pass(model, t, kernel_calls) for t in (1, 4, over)}
    finally:
        model.close()
    layers = len(model.layers)
    for t in (1, 4, over):
        assert torch.equal(fused[t][0], alone[t][0]), t
    assert alone[1][1] - fused[1][1] == 3 * layers  # 7 -> 4 calls per layer
    assert alone[4][1] - fused[4][1] == 3 * layers
    assert fused[over][1] == alone[over][1]  # over MAX_ROWS with `dense`: no kernel, no group


def test_streamed_layers(q41, kernel_calls):
    """Layers streamed from disk, re-bound to a slot every pass: the group follows the bound bytes. A disk
    slot holds a layer in file order (llama.cpp's: ... k, o, q, v), so there only gate/up lie back to
    back and fuse; q, k and v compute alone, with the same numbers."""
    model = _load(q41, offload="disk")
    try:
        assert model.plan.streamed == [0, 1, 2]
        fused = [_pass(model, t, kernel_calls) for t in (1, 4, 16)]
        _unfused(model)
        alone = [_pass(model, t, kernel_calls) for t in (1, 4, 16)]
    finally:
        model.close()
    for (f, fc), (a, ac) in zip(fused, alone):
        assert torch.equal(f, a) and ac - fc == len(model.layers)  # no `dense`: the kernel at any T


def _group(q41):
    model = _load(q41)
    attn = model.layers[1].self_attn
    return model, [attn.q_proj, attn.k_proj, attn.v_proj]


def test_group_serves_only_the_same_unmodified_input(q41):
    model, (q, k, v) = _group(q41)
    try:
        with torch.no_grad():
            x = torch.randn(1, 2, q.in_features)
            _unfused(model)
            alone = [m(x) for m in (q, k, v)]
            qfuse.fuse_siblings(model.layers[1])
            g = q.group
            assert torch.equal(q(x), alone[0])
            waiting = g._outs[id(k)]
            assert k(x) is waiting and torch.equal(waiting, alone[1])  # the slice of q's call
            assert torch.equal(v(x), alone[2]) and g._x is None  # all served: x dropped
            other = x.clone()
            q(x)
            stale = g._outs[id(k)]
            got = k(other)  # another object: computed for it, not q's slice
            assert got is not stale and torch.equal(got, alone[1])
            q(x)
            x.add_(1.0)  # written in place between q and k: no stale slice
            got = k(x)
            _unfused(model)
            assert torch.equal(got, k(x)) and not torch.equal(got, alone[1])
    finally:
        model.close()


def test_bytes_not_adjacent_fall_back(q41, kernel_calls):
    model, (q, k, v) = _group(q41)
    try:
        with torch.no_grad():
            x = torch.randn(1, 1, q.in_features)
            want = [m(x) for m in (q, k, v)]
            g = q.group
            k.weight = torch.nn.Parameter(k.weight.clone(), requires_grad=False)  # its own buffer now
            assert g.take(q, x) is None
            calls = len(kernel_calls)
            got = [m(x) for m in (q, k, v)]
            assert len(kernel_calls) - calls == 3
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert isinstance(k, PackedLinear)
    finally:
        model.close()
