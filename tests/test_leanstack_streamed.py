"""The one-call decoder stack on streamed layers and on the server's several jobs a pass.

The tiny GGUF Llamas of tests/test_leanstack.py (its `tiny_gguf`, every MIXES type). Streamed from
disk, each layer runs on the stack one C call per layer as its bytes are bound, through a staging
ring as large as the stack or smaller (a layer in another buffer each pass), with the logits and K/V
rows of HF's layers over the same bytes and the same greedy ids. The server's pass
(offload/stream/multi.forward_many): jobs of a few tokens take the stack, longer ones the layers;
one-token jobs share ONE decode_stack call; each job's logits and K/V rows equal, bit for bit, what
it gets alone, and on streamed layers a job alone takes exactly model(...)'s pass.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from offload.cpu import ggml_kernel, leanstack
from specexec_cli.core import kvcache
from specexec_cli.core.tree import causal_mask
from tests.probes import count_stack_passes
from tests.test_leanstack import MIXES, _greedy, _load, _passes, _tree_mask, tiny_gguf

pytestmark = pytest.mark.skipif(not ggml_kernel.enabled(), reason="no C compiler: the GGUF kernel is off")


@pytest.fixture(scope="module", params=list(MIXES))
def tiny(request, tmp_path_factory):
    return tiny_gguf(request.param, tmp_path_factory)


def test_streamed_layers_run_on_the_stack_equal_to_hf_layers(tiny, monkeypatch):
    """Every layer streamed from disk: each pass runs layer by layer on the stack as each layer's bytes
    are bound (one C call per layer), every pass after the first (which allocates the slabs: HF's path),
    with the logits and K/V rows of HF's layers over the same bytes, and the same greedy ids."""
    model = _load(tiny, offload="disk", max_host_memory=0)
    try:
        assert model.lean is not None, leanstack.why_not(model)
        assert model.lean.streamed == frozenset(model.plan.streamed) and len(model.plan.streamed) == 3
        hf, hf_rows, hf_calls = _passes(model, monkeypatch, on=False)
        st, st_rows, st_calls = _passes(model, monkeypatch, on=True)
        ids = [_greedy(model, monkeypatch, on=on) for on in (True, False)]
        with pytest.raises(RuntimeError, match="one pass at a time"):
            model.lean.run([])
    finally:
        model.close()
    assert hf_calls == 0 and st_calls == 4
    for a, b in zip(hf, st):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(hf_rows, st_rows):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert ids[0] == ids[1]


def test_streamed_layers_through_a_ring_smaller_than_the_stack(tiny, monkeypatch):
    """Two staging buffers for three streamed layers: a layer arrives in a different buffer from one pass
    to the next, and the weight pointers the stack keeps per (layer, buffer) (LeanStack._bound) and the
    parameter views the model keeps (OffloadedCausalLM._bind) are the right ones every pass: the logits
    and K/V rows of HF's layers over the same bytes."""
    model = _load(tiny, offload="disk", max_host_memory=0, host_slots=2)
    try:
        assert model.store.host_slots == 2 and len(model.plan.streamed) == 3
        hf, hf_rows, _ = _passes(model, monkeypatch, on=False)
        st, st_rows, st_calls = _passes(model, monkeypatch, on=True)
        buffers = set(model.lean._filled)  # (layer, buffer address) pairs the stack has seen
    finally:
        model.close()
    assert st_calls == 4 and len(buffers) == 6  # each of the 3 layers through both buffers
    for a, b in zip(hf + hf_rows, st + st_rows):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_forward_many_runs_served_jobs_on_the_stack(tiny, monkeypatch):
    """The server's pass (offload/stream/multi.forward_many): a job of a few tokens takes the stack, a
    longer one the layers; each equals the model run on it alone."""
    from offload.stream.multi import ForwardJob, forward_many

    model = _load(tiny)
    try:
        caches = [kvcache.new_cache(), kvcache.new_cache()]
        for c in caches:
            kvcache.forward(model, c, torch.arange(1, 10), torch.arange(9), None)
        alone = [kvcache.crop(c, 9) or c for c in caches]
        n = ggml_kernel.MAX_ROWS + 4  # more rows than the stack serves (the model holds fp32 copies)
        jobs = [
            ForwardJob(torch.tensor([3]), torch.tensor([9]), None, caches[0]),
            ForwardJob(
                torch.arange(n) % 20, torch.arange(9, 9 + n), causal_mask(9, n, torch.float32, "cpu"), caches[1]
            ),
        ]
        passes = count_stack_passes(monkeypatch)
        many = forward_many(model, jobs)
        assert passes(model.lean) == 1
        for c in alone:
            kvcache.crop(c, 9)
        one = [
            kvcache.forward(model, caches[0], torch.tensor([3]), torch.tensor([9]), None),
            kvcache.forward(
                model, caches[1], torch.arange(n) % 20, torch.arange(9, 9 + n), causal_mask(9, n, torch.float32, "cpu")
            ),
        ]
        for a, b in zip(many, one):
            assert torch.equal(a, b)
    finally:
        model.close()


def test_forward_many_runs_one_token_stack_jobs_in_one_call(tiny, monkeypatch):
    """Several requests decoding together (`specx serve --parallel`): the one-token jobs the stack serves
    run in ONE decode_stack call (the weights read once for all) and one head call, a longer job in a
    call of its own; each job's logits and the K/V rows written into its own cache equal, bit for bit,
    what that job gets alone."""
    from offload.stream.multi import ForwardJob, forward_many

    model = _load(tiny)
    try:
        prompts = [torch.arange(1, 10), torch.arange(4, 17) % 20, torch.arange(2, 8), torch.arange(3, 6)]
        caches = [kvcache.new_cache() for _ in prompts]
        for c, p in zip(caches, prompts):
            kvcache.forward(model, c, p, torch.arange(len(p)), None)
        past = [len(p) for p in prompts]

        def jobs():  # 1-token steps with and without a mask, a 5-node tree, a 2-token pass (last row only)
            return [
                ForwardJob(
                    torch.tensor([3]), torch.tensor([past[0]]), causal_mask(past[0], 1, torch.float32, "cpu"), caches[0]
                ),
                ForwardJob(
                    torch.tensor([5, 6, 7, 8, 9]),
                    past[1] + torch.tensor([0, 1, 2, 1, 2]),
                    _tree_mask(past[1]),
                    caches[1],
                ),
                ForwardJob(torch.tensor([11, 12]), past[2] + torch.arange(2), None, caches[2], last_only=True),
                ForwardJob(torch.tensor([7]), torch.tensor([past[3]]), None, caches[3]),
            ]

        passes = count_stack_passes(monkeypatch)
        many = forward_many(model, jobs())
        assert passes(model.lean) == 3  # the two one-token jobs together, the others alone
        rows = [
            (
                c.layers[1].keys[:, :, : c.layers[1].length].clone(),
                c.layers[1].values[:, :, : c.layers[1].length].clone(),
            )
            for c in caches
        ]
        for c, n in zip(caches, past):
            kvcache.crop(c, n)
        for i, job in enumerate(jobs()):
            alone = forward_many(model, [job])[0]
            assert torch.equal(many[i], alone), f"job {i}"
            layer = caches[i].layers[1]
            assert torch.equal(rows[i][0], layer.keys[:, :, : layer.length])
            assert torch.equal(rows[i][1], layer.values[:, :, : layer.length])
        assert many[2].shape[0] == 1 and many[1].shape[0] == 5
    finally:
        model.close()


def test_streamed_stack_forward_many_equals_forward(tiny, monkeypatch):
    """Every layer streamed from disk, the stack on: a job alone through forward_many takes the same pass
    as model(...) (the streamed stack, one C call per layer), the same logits and K/V rows bit for bit,
    one pass each; several jobs take HF's layers in one pass, equal to each alone up to rounding order."""
    from offload.stream.multi import ForwardJob, forward_many

    model = _load(tiny, offload="disk", max_host_memory=0)
    try:
        assert model.lean is not None and model.lean.streamed
        caches = [kvcache.new_cache(), kvcache.new_cache()]
        for c in caches:
            kvcache.forward(model, c, torch.arange(1, 10), torch.arange(9), None)  # allocates the slabs
        jobs = [
            ForwardJob(torch.tensor([3]), torch.tensor([9]), causal_mask(9, 1, torch.float32, "cpu"), caches[0]),
            ForwardJob(torch.tensor([3, 4, 5, 6, 7]), torch.tensor([9, 10, 11, 10, 11]), _tree_mask(9), caches[1]),
        ]
        passes, got = count_stack_passes(monkeypatch), {}
        for way in ("alone", "many", "forward"):
            for c in caches:
                kvcache.crop(c, 9)
            before = model.stats.passes
            if way == "forward":
                got[way] = [kvcache.forward(model, j.cache, j.ids, j.positions, j.mask) for j in jobs]
            else:
                got[way] = [forward_many(model, [j])[0] for j in jobs] if way == "alone" else forward_many(model, jobs)
            layer = caches[1].layers[2]
            got[way].append(layer.keys[:, :, : layer.length].clone())
            assert model.stats.passes - before == (1 if way == "many" else 2)
            assert passes(model.lean) == {"alone": 2, "many": 2, "forward": 4}[way]  # "many": none on the stack
        for a, b in zip(got["alone"], got["forward"]):
            assert torch.equal(a, b)
        for a, b in zip(got["many"], got["forward"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        model.close()
