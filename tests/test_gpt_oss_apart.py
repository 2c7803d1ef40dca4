"""gpt-oss's fused experts held apart from their disk layer (offload/stream/expertstore.py), exact against transformers.

The tiny seeded gpt-oss of tests/test_gpt_oss.py, as its 32-bit checkpoint and as the MXFP4 copy of
tests/mxfp4_ckpt.py, every layer on disk, on the CPU. Its experts are four (MXFP4: six) tensors [E, ...] per layer;
expert e's part of each is row e, a contiguous slice. Checked: greedy ids equal transformers' `generate` (for
MXFP4 its `Mxfp4Config(dequantize=True)` load) and whole-layer streaming's (`experts="layers"`), and one pass's
logits equal whole-layer streaming's bit for bit; the expert reads of a pass are exactly the covering spans of the
routed experts' slices (reads recorded by a monkeypatched DirectReader.read_span, routing by a monkeypatched
RoutedExperts.forward, the slices from the safetensors header); the plan says "on-demand" (on a disk without
per-read latency) and sizes the expert cache and staging slots as the loader allocates them; `ar` and specexec
with a draft, through the engine, give transformers' ids; a bf16 checkpoint apart equals whole layers bit for bit, computed in bf16 or cast to fp32.
"""

from __future__ import annotations

import pytest
import torch

from offload.arch.gptoss_experts import RoutedExperts
from offload.formats.st_index import SafetensorsIndex
from offload.stream.hostmem import IO_ALIGN, align_up
from offload.stream.storage import DirectReader
from specexec_cli.session.loading import LoadOptions, load_models
from tests.conftest import make_tokenizer
from tests.mxfp4_ckpt import hf_dequantized, write_mxfp4
from tests.test_gpt_oss import CONFIG, N_NEW, PROMPT, hf_greedy, make_gpt_oss
from tests.test_moe_experts_apart import _greedy, check_allocations, check_engine_decodes, fast_disk

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
E = CONFIG["num_local_experts"]


@pytest.fixture(scope="module", params=["fp32", "mxfp4"])
def gpt_oss(request, tmp_path_factory):
    """(kind, target dir, draft dir, transformers' greedy ids)."""
    root = tmp_path_factory.mktemp(f"gpt_oss_{request.param}")
    source = make_gpt_oss(root / "source", seed=0)
    draft = make_gpt_oss(root / "draft", seed=1, noise_from=source, noise=0.05)
    if request.param == "fp32":
        return request.param, source, draft, hf_greedy(source)
    target = write_mxfp4(source, root / "target")
    ids = make_tokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf_dequantized(target).generate(
            torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return request.param, target, draft, out[0, len(ids) :].tolist()


def _expert_rows(target) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(layer, expert) -> the file range (begin, end) of its row of each fused tensor, from the header."""
    rows: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for name, t in SafetensorsIndex(target).entries.items():
        if ".mlp.experts." in name:
            step = t.nbytes // E
            for e in range(E):
                rows.setdefault((int(name.split(".")[2]), e), []).append((t.begin + e * step, t.begin + (e + 1) * step))
    return rows


def _expert_spans(target) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(layer, expert) -> the IO_ALIGN-aligned (offset, length) spans covering its rows, rows that touch merged."""
    out = {}
    for key, ranges in _expert_rows(target).items():
        merged: list[list[int]] = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        out[key] = [
            (lo // IO_ALIGN * IO_ALIGN, align_up(hi - lo // IO_ALIGN * IO_ALIGN, IO_ALIGN)) for lo, hi in merged
        ]
    return out


def test_greedy_equals_hf_and_whole_layers(gpt_oss):
    from offload import OffloadedCausalLM

    kind, target, _, want = gpt_oss
    got, logits = {}, {}
    ids = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
    for mode in ("auto", "layers"):
        m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", experts=mode)
        try:
            assert m.plan.tier == "disk" and (m.experts is not None) == (mode == "auto")
            logits[mode] = m(input_ids=ids).logits
            got[mode] = _greedy(m)
        finally:
            m.close()
    assert got["auto"] == want and got["layers"] == want, kind
    assert torch.equal(logits["auto"], logits["layers"]), kind


def test_bytes_read_are_the_routed_experts(gpt_oss, monkeypatch):
    """With a one-expert cache every routed expert is read once per pass: the expert reads of a pass are exactly
    the covering spans of its routed experts' slices, and the dense parts' reads never touch an expert."""
    from offload import OffloadedCausalLM

    kind, target, _, _ = gpt_oss
    reads, routed = [], []
    read_span, forward = DirectReader.read_span, RoutedExperts.forward

    def recording_read(self, span, buf):
        reads.append((self, span.offset, span.length))
        return read_span(self, span, buf)

    def recording_forward(self, hidden, router_indices, routing_weights):
        routed.append((id(self), sorted(set(router_indices.flatten().tolist()))))
        return forward(self, hidden, router_indices, routing_weights)

    monkeypatch.setattr(DirectReader, "read_span", recording_read)
    monkeypatch.setattr(RoutedExperts, "forward", recording_forward)
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", expert_cache=1)
    try:
        layer_of = {id(layer.mlp.experts): i for i, layer in enumerate(m.layers)}
        spans = _expert_spans(target)
        rows = [r for rs in _expert_rows(target).values() for r in rs]
        whole = sum(s for ss in spans.values() for _, s in ss)
        ids = make_tokenizer()(PROMPT)["input_ids"]
        for n in (6, 1, 2, 7):  # passes of several sizes, each checked on its own
            reads.clear()
            routed.clear()
            before = m.stats.streamed_bytes
            m(input_ids=torch.tensor([ids[:n]]))
            experts = sorted((off, size) for r, off, size in reads if r is m.experts.reader)
            want = sorted(s for mod, es in routed for e in es for s in spans[(layer_of[mod], e)])
            assert experts == want, (kind, n)
            for r, off, size in reads:  # a dense part's span never covers an expert's row (beyond a shared page)
                if r is not m.experts.reader:
                    assert not any(off <= lo and hi <= off + size for lo, hi in rows if hi - lo > IO_ALIGN), (off, size)
            dense_parts = sum(m.store.link_bytes(i) for i in m.plan.disk_layers)
            assert m.stats.streamed_bytes - before == dense_parts + sum(s for _, s in experts)
            if n == 1:  # one token reads its top-2 of 4 experts per layer
                assert sum(s for _, s in experts) <= whole * 0.6, (kind, experts, whole)
    finally:
        m.close()


def test_plan_says_on_demand_and_sizes_what_the_loader_allocates(gpt_oss, monkeypatch):
    from offload import OffloadedCausalLM
    from offload.planning.memplan import PlanRequest, plan_memory
    from tests.sparse_ckpt import read_checkpoint

    kind, target, _, want = gpt_oss
    fast_disk(monkeypatch)  # these tiny experts model faster apart only without per-read latency
    req = PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34, offload="disk")
    plan = plan_memory(read_checkpoint(target), None, req)
    ex = plan.experts
    assert ex["mode"] == "on-demand" and ex["runs"] and ex["cache_experts"] == E, ex
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", memplan=plan)
    try:
        check_allocations(m, plan, kind)
        assert _greedy(m) == want
    finally:
        m.close()


def test_engine_ar_and_specexec_with_experts_apart(gpt_oss):
    kind, target, draft, want = gpt_oss
    m = load_models(LoadOptions(str(target), str(draft), "fp32", device="cpu", offload="disk", max_ram=0, ctx=256))
    try:
        check_engine_decodes(m, want, kind)
    finally:
        m.target.close()
        getattr(m.draft, "close", lambda: None)()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_checkpoint_apart_equals_whole_layers(tmp_path, dtype):
    """bf16 stored: computed in bf16 each expert's slices are read in their file layout, in fp32 cast through the
    read buffer; either way the logits equal whole-layer streaming's bit for bit."""
    from offload import OffloadedCausalLM

    path = make_gpt_oss(tmp_path / "bf16", seed=0, dtype=torch.bfloat16)
    ids = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
    logits = {}
    for mode in ("auto", "layers"):
        m = OffloadedCausalLM.from_pretrained(path, dtype=dtype, offload="disk", experts=mode)
        try:
            logits[mode] = m(input_ids=ids).logits
            if mode == "auto":
                assert m.experts.reads > 0
                assert all(d.convert == (dtype == torch.float32) for d in m.experts.experts.values())
        finally:
            m.close()
    assert torch.equal(logits["auto"], logits["layers"])
