"""Routed experts held apart from their disk layer (offload/stream/expertstore.py), exact against transformers.

The tiny seeded MoE checkpoints of tests/test_moe_families.py (Mixtral, Qwen2-MoE with a shared expert and a
dense MLP layer, Qwen3-MoE), every layer on disk, on the CPU. Checked: greedy ids equal HF `generate`'s and
whole-layer streaming's (`experts="layers"`); the bytes read per pass are the routed experts' covering spans and
nothing else of them (the reads recorded by a monkeypatched DirectReader.read_span, the routing by a monkeypatched
ExpertList.forward, the expert spans from the safetensors header); the memory plan says "on-demand", runs, and
sizes the staging slots and the expert cache as the loader allocates them (on a disk without per-read latency,
where it chooses them apart); `ar` and specexec with a draft,
through the engine, equal HF generate with the experts apart; a bf16 checkpoint (computed in bf16 or cast to fp32)
gives whole-layer streaming's logits bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from offload.arch.moe import ExpertList
from offload.formats.st_index import SafetensorsIndex
from offload.stream.hostmem import IO_ALIGN, align_up
from offload.stream.storage import DirectReader
from tests.conftest import make_tokenizer
from tests.test_moe_families import N_NEW, PROMPT, _decode, make_moe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def family(request, tmp_path_factory):
    """(name, target dir, draft dir, HF generate's greedy ids)."""
    root = tmp_path_factory.mktemp(request.param)
    target = make_moe(request.param, root / "target", seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = make_tokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
    return request.param, target, root, out[0, len(ids) :].tolist()


def _greedy(m, record=None) -> list[int]:
    from transformers import DynamicCache

    from offload.arch.hfcompat import cache_kwargs

    cache, got = DynamicCache(), []
    x = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
    for _ in range(N_NEW):
        if record is not None:
            record.append([])
        x = m(input_ids=x, **cache_kwargs(m, cache), use_cache=True).logits[:, -1:].argmax(-1)
        got.append(int(x))
    return got


def _expert_spans(target) -> dict[tuple[int, int], tuple[int, int]]:
    """(layer, expert) -> the IO_ALIGN-aligned file range covering its tensors, from the header."""
    spans = {}
    for name, e in SafetensorsIndex(target).entries.items():
        if ".experts." in name:
            key = (int(name.split(".")[2]), int(name.split(".experts.")[1].split(".")[0]))
            lo, hi = spans.get(key, (e.begin, e.end))
            spans[key] = (min(lo, e.begin), max(hi, e.end))
    return {k: (lo // IO_ALIGN * IO_ALIGN, align_up(hi, IO_ALIGN)) for k, (lo, hi) in spans.items()}


def check_allocations(m, plan, label) -> None:
    """The loader allocated what the plan sized: the expert cache (its experts and bytes), the staging slots."""
    got = m.pool.by_component
    assert m.experts.capacity == plan.experts["cache_experts"], label
    assert got["expert_cache"] == plan.device_bytes["expert_cache"], label
    assert got["staging_slots"] == plan.device_bytes["staging_slots"], label


def test_greedy_equals_hf_and_whole_layers(family):
    from offload import OffloadedCausalLM

    name, target, _, want = family
    got = {}
    for mode in ("auto", "layers"):
        m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", experts=mode)
        try:
            assert m.plan.tier == "disk" and (m.experts is not None) == (mode == "auto")
            got[mode] = _greedy(m)
        finally:
            m.close()
    assert got["auto"] == want and got["layers"] == want, name


def test_bytes_read_are_the_routed_experts(family, monkeypatch):
    """With a one-expert cache every routed expert is read once per pass: the expert reads of a pass are exactly
    the covering spans of the experts its tokens routed to, and the dense parts' reads never touch an expert."""
    from offload import OffloadedCausalLM

    name, target, _, _ = family
    reads, routed = [], []
    read_span = DirectReader.read_span

    def recording_read(self, span, buf):
        reads.append((self, span.offset, span.length))
        return read_span(self, span, buf)

    forward = ExpertList.forward

    def recording_forward(self, hidden, top_k_index, top_k_weights):
        routed[-1].append((id(self), sorted(set(top_k_index.flatten().tolist()))))
        return forward(self, hidden, top_k_index, top_k_weights)

    monkeypatch.setattr(DirectReader, "read_span", recording_read)
    monkeypatch.setattr(ExpertList, "forward", recording_forward)
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", expert_cache=1)
    try:
        layer_of = {id(layer.mlp.experts): i for i, layer in enumerate(m.layers) if hasattr(layer.mlp, "experts")}
        spans = _expert_spans(target)
        whole = sum(hi - lo for lo, hi in spans.values())  # every expert's bytes: what whole layers read a pass
        ids = make_tokenizer()(PROMPT)["input_ids"]
        for n in (6, 1, 2, 7):  # passes of several sizes, each checked on its own
            reads.clear()
            routed.append([])
            before = m.stats.streamed_bytes
            m(input_ids=torch.tensor([ids[:n]]))
            experts = sorted((off, size) for r, off, size in reads if r is m.experts.reader)
            dense = [(off, size) for r, off, size in reads if r is not m.experts.reader]
            want_spans = sorted(
                (spans[(layer_of[mod], e)][0], spans[(layer_of[mod], e)][1] - spans[(layer_of[mod], e)][0])
                for mod, es in routed[-1]
                for e in es
            )
            assert experts == want_spans, (name, n)
            for off, size in dense:  # a dense part's span never covers an expert's tensors
                assert not any(off <= lo and hi <= off + size for lo, hi in spans.values()), (name, off, size)
            # the pass's streamed bytes: every disk layer's dense part (read ahead by the prefetcher) + its experts
            dense_parts = sum(m.store.link_bytes(i) for i in m.plan.disk_layers)
            assert m.stats.streamed_bytes - before == dense_parts + sum(s for _, s in experts)
            if n == 1:  # one token reads its top-2 of 4 experts per layer, half of what whole layers read
                assert sum(s for _, s in experts) <= whole / 2, (name, experts, whole)  # top-2 of 4 experts
    finally:
        m.close()


def test_routed_experts_are_read_ahead(family, monkeypatch):
    """With room for two experts or more, a layer's routed experts are read by the store's worker thread,
    each next one while the one before computes (ExpertStore.stream through ExpertList.routed): 7 tokens
    route to at least 2 of 4 experts in every layer, so every expert read of the pass is the worker's."""
    import threading

    from offload import OffloadedCausalLM

    name, target, _, _ = family
    reads = []
    read_span = DirectReader.read_span

    def recording_read(self, span, buf):
        reads.append((self, threading.current_thread().name))
        return read_span(self, span, buf)

    monkeypatch.setattr(DirectReader, "read_span", recording_read)
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", expert_cache=8)
    try:
        m(input_ids=torch.tensor([make_tokenizer()(PROMPT)["input_ids"][:7]]))
        threads = [t for r, t in reads if r is m.experts.reader]
        assert threads and all(t.startswith("specx-experts") for t in threads), (name, threads)
    finally:
        m.close()


def fast_disk(monkeypatch) -> None:
    """A disk without per-read latency (the plan's prior Device): these tiny experts then model faster apart, so
    the plan holds them apart (with the 100 us prior, Qwen2/3-MoE's 24 KiB experts model faster in their layers:
    tests/test_moe_plan_choice.py)."""
    from offload.planning import PRIORS

    monkeypatch.setitem(PRIORS["cpu"], "disk_read_s", 0.0)


def test_plan_says_on_demand_and_sizes_what_the_loader_allocates(family, monkeypatch):
    from offload import OffloadedCausalLM
    from offload.planning.memplan import PlanRequest, plan_memory
    from tests.sparse_ckpt import read_checkpoint

    name, target, _, want = family
    fast_disk(monkeypatch)
    plan = plan_memory(
        read_checkpoint(target),
        None,
        PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34, offload="disk"),
    )
    ex = plan.experts
    assert ex["mode"] == "on-demand" and ex["runs"], ex
    assert ex["cache_experts"] == ex["experts"]  # --offload disk: one layer's experts, the minimum
    assert any(n.startswith("experts apart (run)") for n in plan.notes), plan.notes
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", memplan=plan)
    try:
        check_allocations(m, plan, name)
        assert _greedy(m) == want
        # the prompt's prefill read layers whole: the store's two buffers are what the plan counted
        assert m.experts.layers_read_whole > 0, name
        assert m.pool.by_component["expert_readahead"] == plan.device_bytes["expert_readahead"] > 0, name
    finally:
        m.close()
    resident = plan_memory(
        read_checkpoint(target), None, PlanRequest(device="cpu", dtype="fp32", draft_dtype=None, ram_free=1 << 34)
    )
    assert resident.experts["mode"] == "layers" and "expert_cache" not in resident.device_bytes
    cuda = plan_memory(
        read_checkpoint(target),
        None,
        PlanRequest(
            device="cuda", dtype="bf16", draft_dtype=None, ram_free=1 << 34, offload="disk", max_gpu_memory=1 << 30
        ),
    )
    assert cuda.experts["mode"] != "on-demand"  # a CUDA loader streams whole layers


def test_engine_ar_and_specexec_with_experts_apart(family, monkeypatch):
    """`ar` and specexec with a draft, through the engine (the plan's load), experts read on demand."""
    from specexec_cli.session.loading import LoadOptions, load_models

    name, target, root, want = family
    fast_disk(monkeypatch)
    draft = make_moe(name, root / "draft", seed=4, noise_from=target, noise=0.05)
    m = load_models(LoadOptions(str(target), str(draft), dtype="fp32", device="cpu", offload="disk", ctx=256))
    try:
        check_engine_decodes(m, want, name)
    finally:
        m.target.close()


def check_engine_decodes(m, want, label) -> None:
    """Loaded models whose target reads its experts on demand from disk: `ar` and specexec give `want`, the
    draft's trees verify 3 tokens a pass or more somewhere, and the store read experts."""
    assert m.target.experts is not None and m.target.plan.tier == "disk"
    m.eos_ids = frozenset()
    assert _decode(m, "ar")[0] == want, label
    got, per_pass = _decode(m, "specexec")
    assert got == want and max(per_pass) >= 3, (label, per_pass)
    assert m.target.experts.reads > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_checkpoint_apart_equals_whole_layers(tmp_path, dtype):
    """A bf16 checkpoint: computed in bf16 each expert is read in its file layout, in fp32 cast through the
    read buffer; either way the logits equal whole-layer streaming's bit for bit."""
    from offload import OffloadedCausalLM

    src = make_moe("qwen3_moe", tmp_path / "fp32", seed=3)
    transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    make_tokenizer().save_pretrained(tmp_path / "bf16")
    ids = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
    logits = {}
    for mode in ("auto", "layers"):
        m = OffloadedCausalLM.from_pretrained(tmp_path / "bf16", dtype=dtype, offload="disk", experts=mode)
        try:
            logits[mode] = m(input_ids=ids).logits
            if mode == "auto":
                assert m.experts.reads > 0
                assert all(d.convert == (dtype == torch.float32) for d in m.experts.experts.values())
        finally:
            m.close()
    assert torch.equal(logits["auto"], logits["layers"])


def test_whole_layer_read_lands_each_expert_as_its_own_read(family):
    """expertbulk.layer_spans: a layer's experts read whole, each expert's spans copied from where they land, give
    the bytes that reading that expert alone gives (every needed byte of every span)."""
    import ctypes

    from offload import OffloadedCausalLM
    from offload.stream.hostmem import aligned_empty

    name, target, _, _ = family
    m = OffloadedCausalLM.from_pretrained(target, dtype=torch.float32, offload="disk", experts="on-demand")
    try:
        st = m.experts
        for layer, read in st.layer_reads.items():
            whole = aligned_empty(read.nbytes)
            for span in read.spans:
                st.reader.read_span(span, whole)
            for (li, e), d in st.experts.items():
                if li != layer:
                    continue
                alone, copied = aligned_empty(d.raw.nbytes), aligned_empty(d.raw.nbytes)
                for span in d.spans:
                    st.reader.read_span(span, alone)
                for off, span in st._landing[(li, e)]:
                    ctypes.memmove(copied.data_ptr() + span.buf_offset, whole.data_ptr() + off, span.length)
                for span in d.spans:
                    lo, hi = span.buf_offset, span.buf_offset + span.needed
                    assert torch.equal(alone[lo:hi], copied[lo:hi]), (name, li, e)
    finally:
        m.close()


def test_large_passes_read_the_next_layer_whole(family, monkeypatch):
    """A pass routing to enough experts reads the next layer's experts whole, on the store's second thread, and
    computes what whole-layer streaming computes, bit for bit; a cache of one expert never does (each routed
    expert read once, as test_bytes_read_are_the_routed_experts checks)."""
    import threading

    from offload import OffloadedCausalLM

    name, target, _, _ = family
    threads = []
    read_span = DirectReader.read_span

    def recording_read(self, span, buf):
        threads.append(threading.current_thread().name)
        return read_span(self, span, buf)

    ids = torch.tensor([make_tokenizer()(PROMPT)["input_ids"]])
    logits, whole = {}, {}
    for mode, cache in (("on-demand", None), ("on-demand", 1), ("layers", None)):
        m = OffloadedCausalLM.from_pretrained(
            target, dtype=torch.float32, offload="disk", experts=mode, expert_cache=cache
        )
        try:
            if mode == "on-demand":
                monkeypatch.setattr(DirectReader, "read_span", recording_read)
            for _ in range(2):  # the second pass's first layer was read whole by the first pass's last
                logits[(mode, cache)] = m(input_ids=ids).logits
            monkeypatch.setattr(DirectReader, "read_span", read_span)
            if m.experts is not None:  # each pass reads every layer holding experts apart whole, ahead of it
                whole[cache] = (m.experts.layers_read_whole, 2 * len(m.experts.layer_reads))
        finally:
            m.close()
    assert whole[1][0] == 0 and whole[None][0] == whole[None][1], (name, whole)
    assert "specx-experts-whole_0" in threads, (name, set(threads))
    assert torch.equal(logits[("on-demand", None)], logits[("layers", None)]), name
    assert torch.equal(logits[("on-demand", 1)], logits[("layers", None)]), name
