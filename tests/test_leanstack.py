"""The one-call decoder stack (offload/cpu/leanstack.py, kernels/decode_stack.c) against HF's layers.

Tiny Q4_1 / Q4_0 / Q8_0 / K-quant GGUF Llamas with grouped-query attention (Q/K rows permuted as
llama.cpp stores them), every layer resident: the stack is built, serves decoding and small tree
passes, and each pass's logits and the K/V rows it writes equal those of the same model with the
stack turned off ($SPECX_DECODE_STACK=off: HF's LlamaDecoderLayer over the same kernel) up to fp32
rounding order; greedy decoding gives the same ids; the plan says the stack runs small passes; the
layer-skip self-draft runs its kept layers on it. Where it must not serve, the HF path runs: more
tokens than the kernel's rows, a cache without room, a mask of the wrong width, the switch off. On
the real model (SmolLM2, when installed) `--method ar`'s ids are the same either way. Streamed
layers and the server's several jobs a pass: tests/test_leanstack_streamed.py, which shares this
module's models (`tiny_gguf`) and helpers, as tests/test_gemma3_stack.py does.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from offload.cpu import ggml_kernel, leanstack
from offload.stream.model import OffloadedCausalLM
from specexec_cli.core import kvcache
from specexec_cli.core.tree import causal_mask
from tests.conftest import make_model
from tests.gguf_build import write_gguf
from tests.probes import count_stack_passes

pytestmark = pytest.mark.skipif(not ggml_kernel.enabled(), reason="no C compiler: the GGUF kernel is off")


# name -> (type, {weights of another type}): the K-quant mixes llama-quantize makes (Q4_K_M: v and down
# in Q6_K, so q/k/v are three calls of two types), and its fallbacks for rows not a multiple of 256
MIXES = {
    "Q4_1": ("Q4_1", None),
    "Q4_0": ("Q4_0", None),
    "Q8_0": ("Q8_0", None),
    "Q4_K_M": ("Q4_K", {"v_proj": "Q6_K", "down_proj": "Q6_K"}),
    "Q5_K": ("Q5_K", None),
    "Q5_0+Q8_0": ("Q5_0", {"v_proj": "Q8_0", "up_proj": "Q5_1"}),
}


def tiny_gguf(name: str, tmp_path_factory):
    """A 3-layer, hidden-256 GQA Llama (seed 7) written as a GGUF in MIXES[name]."""
    root = tmp_path_factory.mktemp("lean")
    hf = make_model(root / "hf", seed=7, layers=3, hidden=256)
    qtype, mix = MIXES[name]
    return write_gguf(hf, root / "m" / f"tiny-{name}.gguf", qtype, mix=mix)


@pytest.fixture(scope="module", params=list(MIXES))
def tiny(request, tmp_path_factory):
    return tiny_gguf(request.param, tmp_path_factory)


def _load(f, offload="none", **kw):
    return OffloadedCausalLM.from_pretrained(f, device="cpu", dtype=torch.float32, offload=offload, **kw)


def _stack(monkeypatch, on: bool) -> None:
    monkeypatch.setenv(leanstack.ENV, "auto" if on else "off")


def _tree_mask(past: int) -> torch.Tensor:
    """(1, 1, 5, past + 5) additive: a 5-node tree (0 -> 1 -> 2, 0 -> 3 -> 4) over `past` committed rows."""
    parents = [-1, 0, 1, 0, 3]
    m = torch.full((5, past + 5), float("-inf"))
    m[:, :past] = 0
    for i in range(5):
        j = i
        while j >= 0:
            m[i, past + j] = 0
            j = parents[j]
    return m[None, None]


def _passes(model, monkeypatch, on: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Logits of a 9-token prefill, a 1-token step (mask), a 5-node tree, a 3-token causal pass without
    a mask and a 1-token step without a mask; the K/V rows of layer 0 after them; stack passes run."""
    _stack(monkeypatch, on)
    passes = count_stack_passes(monkeypatch)
    cache = kvcache.new_cache()
    outs = [kvcache.forward(model, cache, torch.arange(1, 10), torch.arange(9), None)]
    outs.append(
        kvcache.forward(model, cache, torch.tensor([11]), torch.tensor([9]), causal_mask(9, 1, torch.float32, "cpu"))
    )
    outs.append(
        kvcache.forward(model, cache, torch.tensor([3, 4, 5, 6, 7]), torch.tensor([10, 11, 12, 11, 12]), _tree_mask(10))
    )
    kvcache.compact(cache, 10, torch.tensor([13, 14]))  # keep the second branch, as a verify pass would
    outs.append(kvcache.forward(model, cache, torch.tensor([8, 9, 10]), torch.arange(12, 15), None))
    outs.append(kvcache.forward(model, cache, torch.tensor([12]), torch.tensor([15]), None))
    layer = cache.layers[0]
    rows = [layer.keys[:, :, : layer.length].clone(), layer.values[:, :, : layer.length].clone()]
    return outs, rows, passes(model.lean)


def test_stack_built_and_equal_to_hf_layers(tiny, monkeypatch):
    model = _load(tiny)
    try:
        assert model.lean is not None, leanstack.why_not(model)
        assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA is exercised
        hf, hf_rows, hf_calls = _passes(model, monkeypatch, on=False)
        st, st_rows, st_calls = _passes(model, monkeypatch, on=True)
    finally:
        model.close()
    assert hf_calls == 0 and st_calls == 4  # every pass but the 9-token prefill (over the kernel's rows)
    for a, b in zip(hf, st):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(hf_rows, st_rows):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def _greedy(model, monkeypatch, on: bool, n: int = 24) -> list[int]:
    _stack(monkeypatch, on)
    cache = kvcache.new_cache()
    ids = [5, 17, 29, 41]
    logits = kvcache.forward(model, cache, torch.tensor(ids), torch.arange(len(ids)), None, last_only=True)
    for _ in range(n):
        ids.append(int(logits[-1].argmax()))
        logits = kvcache.forward(model, cache, torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]), None)
    return ids


def test_greedy_ids_equal(tiny, monkeypatch):
    model = _load(tiny)
    try:
        assert _greedy(model, monkeypatch, on=True) == _greedy(model, monkeypatch, on=False)
    finally:
        model.close()


def test_hf_path_where_the_stack_must_not_serve(tiny, monkeypatch):
    model = _load(tiny)
    try:
        cache = kvcache.new_cache()
        kvcache.forward(model, cache, torch.arange(1, 10), torch.arange(9), None)
        passes, calls = count_stack_passes(monkeypatch), 0
        over = ggml_kernel.MAX_ROWS + 1
        kvcache.forward(
            model, cache, torch.arange(over), torch.arange(9, 9 + over), causal_mask(9, over, torch.float32, "cpu")
        )
        kvcache.crop(cache, 9)
        assert not model.lean.serves(torch.zeros(1, 1, 256), torch.zeros(1, 1, 1, 9), cache)  # mask too narrow
        assert model.lean.serves(torch.zeros(1, 1, 256), torch.zeros(1, 1, 1, 10), cache)
        assert not model.lean.serves(torch.zeros(1, 1, 256), None, kvcache.new_cache())  # no slabs yet
        monkeypatch.setenv(leanstack.ENV, "off")
        kvcache.forward(model, cache, torch.tensor([3]), torch.tensor([9]), None)
        assert passes(model.lean) == calls
        monkeypatch.setenv(leanstack.ENV, "auto")
        full = cache.layers[0].keys.shape[2]
        kvcache.crop(cache, 0)
        kvcache.forward(model, cache, torch.arange(full - 2) % 20, torch.arange(full - 2), None)  # 2 rows left
        kvcache.forward(model, cache, torch.arange(4), torch.arange(full - 2, full + 2), None)  # grows: HF path
        assert passes(model.lean) == calls and cache.layers[0].keys.shape[2] > full
        kvcache.forward(model, cache, torch.tensor([3]), torch.tensor([full + 2]), None)
        assert passes(model.lean) == calls + 1
    finally:
        model.close()


def test_no_stack_when_switched_off(tiny, monkeypatch):
    monkeypatch.setenv(leanstack.ENV, "off")
    model = _load(tiny)
    try:
        assert model.lean is None and leanstack.why_not(model) == f"${leanstack.ENV}=off"
    finally:
        model.close()


def _plan(path, offload: str):
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.session.loading import LoadOptions
    from specexec_cli.session.planning import make_plan

    opts = LoadOptions(
        target=str(path), draft=None, device="cpu", offload=offload, ctx=256, max_ram=0 if offload == "disk" else None
    )
    return make_plan(opts, TreeShape(budget=16, max_depth=8, max_beams=4), budget_auto=False)


def test_plan_says_the_stack_runs_small_passes(tiny, monkeypatch):
    from offload.planning import passcost

    plan = _plan(tiny, "none")
    assert plan.kernel["stack"] and plan.kernel["rows"] == ggml_kernel.MAX_ROWS
    dev = passcost.device_for("cpu")
    assert passcost.forward_floor(plan, dev, 1) == dev.stack_floor_s < dev.forward_floor_s
    assert passcost.forward_floor(plan, dev, ggml_kernel.MAX_ROWS + 1) == dev.forward_floor_s
    disk = _plan(tiny, "disk").kernel  # streamed layers: a call per layer
    assert disk["stack"] and disk["stack_rows"] == leanstack.STACK_ROWS
    monkeypatch.setenv(leanstack.ENV, "off")
    assert not _plan(tiny, "none").kernel["stack"]


@pytest.mark.slow
def test_real_model_greedy_ids_equal(smollm2, monkeypatch):
    model = _load(smollm2)
    try:
        assert model.lean is not None, leanstack.why_not(model)
        passes = count_stack_passes(monkeypatch)
        on = _greedy(model, monkeypatch, on=True, n=32)
        assert passes(model.lean) >= 32
        assert on == _greedy(model, monkeypatch, on=False, n=32)
    finally:
        model.close()


def test_layer_skip_draft_runs_its_kept_layers_on_the_stack(tiny, monkeypatch):
    """The layer-skip self-draft shares the target's layers: its stack runs the kept ones, writes
    their K/V rows into the target's slabs through the shared cache, and equals HF's path."""
    from offload.selfdraft.build import build_skip_draft

    model = _load(tiny)
    try:
        draft = build_skip_draft(model, [1])
        assert draft.lean is not None and len(draft.lean.structs) == 2 and draft.lean.idx == [0, 2]
        outs = {}
        for on in (False, True):
            _stack(monkeypatch, on)
            target = kvcache.new_cache()
            kvcache.forward(model, target, torch.arange(1, 10), torch.arange(9), None)
            shared = kvcache.SharedCache(target)
            shared.follow(9)
            passes = count_stack_passes(monkeypatch)
            outs[on] = [kvcache.forward(draft, shared, torch.tensor([3]), torch.tensor([9]), None)]
            outs[on].append(
                kvcache.forward(
                    draft, shared, torch.tensor([4, 5]), torch.tensor([10, 10]), _tree_mask(10)[..., :2, :12]
                )
            )
            assert passes(draft.lean) == (1 if on else 0)  # the first pass makes the shared layers
            assert target.layers[0].length == 9 and shared.layers[2].length == 12
        for a, b in zip(outs[False], outs[True]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    finally:
        model.close()
