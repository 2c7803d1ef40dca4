"""The one-call decoder stack (offload/cpu/leanstack.py, kernels/decode_stack.c) on Gemma-3 layers.

A tiny seeded Gemma-3 (6 layers: 5 local + 1 global, global RoPE base 1M against the local 10k,
grouped-query attention 4:1, q/k norms, sandwich norms, GELU-tanh MLP, norms stored 1 + w) written as llama.cpp's converter writes it (tests/gguf_build.py) in the real
file's Q4_K_M mix, every layer resident and every layer streamed from disk: the stack is built,
serves decoding and small tree passes, and each pass's logits and the K/V rows it writes equal those
of the same model with the stack off ($SPECX_DECODE_STACK=off: HF's Gemma3DecoderLayer over the same
kernel) up to fp32 rounding order, with the same argmax and greedy ids. Sliding window: the stack
applies none, so it declines a pass whose context exceeds the window (HF's path serves it, exact).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from offload.cpu import ggml_kernel, leanstack
from specexec_cli.core import kvcache
from specexec_cli.core.tree import causal_mask
from tests.gguf_build import write_gguf
from tests.probes import count_stack_passes
from tests.test_gguf_gemma3 import MIX, _hf_gemma3
from tests.test_leanstack import _greedy, _load, _passes, _stack

pytestmark = pytest.mark.skipif(not ggml_kernel.enabled(), reason="no C compiler: the GGUF kernel is off")

WINDOW = 32  # the passes of _passes / _greedy stay inside it (28 rows at most)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gemma3stack")
    hf = _hf_gemma3(root / "hf", 3, window=WINDOW)
    return write_gguf(hf, root / "m" / "tiny-gemma3-q4_k_m.gguf", "Q5_0", arch="gemma3", mix=MIX)


def _close(hf, st, hf_rows, st_rows) -> None:
    for a, b in zip(hf, st):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(hf_rows, st_rows):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_the_family_is_one_the_stack_computes(tiny):
    model = _load(tiny)
    try:
        cfg = model.config
        assert cfg.model_type == "gemma3_text" and leanstack.family_reason(cfg) is None
        assert model.lean is not None, leanstack.why_not(model)
        assert model.lean.dims.act == 1 and model.lean.dims.scale == pytest.approx(model.layers[0].self_attn.scaling)
        assert model.lean.ropes == ["full_attention", "sliding_attention"] and model.lean.window == WINDOW
        # the local layers and the global one take different tables; every norm a folded fp32 copy
        assert [p["rope"] for p in model.lean.parts] == [1, 1, 1, 1, 1, 0]
        norm = model.layers[0].post_attention_layernorm
        assert torch.equal(model.lean.parts[0]["gemma"][2], 1.0 + (norm.weight - 1.0))
    finally:
        model.close()
    assert "soft-capping" in leanstack.family_reason(dict(cfg.to_dict(), attn_logit_softcapping=50.0))


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_stack_equals_hf_gemma3_layers(tiny, offload, monkeypatch):
    """Resident (one call a pass) and streamed from disk (one call a layer as it arrives): the stack's
    logits, argmax and layer-0 K/V rows against HF's layers, and the same greedy ids."""
    kw = {"max_host_memory": 0} if offload == "disk" else {}
    model = _load(tiny, offload=offload, **kw)
    try:
        assert model.lean is not None, leanstack.why_not(model)
        assert bool(model.lean.streamed) == (offload == "disk")
        hf, hf_rows, hf_calls = _passes(model, monkeypatch, on=False)
        st, st_rows, st_calls = _passes(model, monkeypatch, on=True)
        ids = [_greedy(model, monkeypatch, on=on) for on in (True, False)]
    finally:
        model.close()
    assert hf_calls == 0 and st_calls == 4  # every pass but the 9-token prefill
    _close(hf, st, hf_rows, st_rows)
    assert ids[0] == ids[1]


def _long(model, monkeypatch, on: bool):
    """A 30-token prefill, then 6 one-token steps to a context of 36 > WINDOW: logits, K/V rows, stack passes."""
    _stack(monkeypatch, on)
    passes = count_stack_passes(monkeypatch)
    cache = kvcache.new_cache()
    prompt = torch.arange(30) % 60 + 3
    outs = [kvcache.forward(model, cache, prompt, torch.arange(30), None, last_only=True)]
    for n in range(30, 36):
        tok = torch.tensor([int(outs[-1][-1].argmax())])
        outs.append(kvcache.forward(model, cache, tok, torch.tensor([n]), causal_mask(n, 1, torch.float32, "cpu")))
    layer = cache.layers[0]  # a sliding layer
    rows = [layer.keys[:, :, : layer.length].clone(), layer.values[:, :, : layer.length].clone()]
    return outs, rows, passes(model.lean)


def test_a_context_past_the_window_takes_hf_path(tiny, monkeypatch):
    """Steps at context 31 and 32 (<= WINDOW) run on the stack, those past it on HF's sliding masks;
    the logits are HF's all along (the window hides rows from the later steps' local layers)."""
    model = _load(tiny)
    try:
        hf, hf_rows, hf_calls = _long(model, monkeypatch, on=False)
        st, st_rows, st_calls = _long(model, monkeypatch, on=True)
    finally:
        model.close()
    assert hf_calls == 0 and st_calls == 2
    _close(hf, st, hf_rows, st_rows)
