"""A mixture-of-experts GGUF's routed experts held apart on the CPU (offload/stream/expertstore.py), exact.

Tiny seeded Qwen3-MoE, Qwen2-MoE (its shared expert stays in the dense part) and Mixtral (llama.cpp's `llama`
with `expert_count`) checkpoints, 256 wide so that one expert's rows span whole pages, written to GGUF by
llama.cpp's converter as Q8_0, and the Qwen3-MoE also requantized by llama-quantize as Q4_K_M (experts Q4_K and
Q6_K; tests/test_gguf_moe.py builds them; without llama.cpp these tests skip). Expert e of a layer is row e of
each fused `ffn_{gate,up,down}_exps` tensor, a contiguous 1/E of its quantized bytes. Checked, every layer on
disk: greedy ids with the experts apart equal whole-layer streaming's (`experts="layers"`) and transformers'
(on the file's weights), and so do the resident and RAM tiers'; the bytes read per pass are exactly the covering
spans of the experts its tokens routed to (computed here from the file's header) plus the dense parts, which
never cover an expert's bytes, and a 1-token pass reads about half of what whole layers read (top-2 of 4);
the routed experts compute from their quantized bytes in the cache slot with the GGUF CPU kernel
(cpu/ggml_kernel.linear), never dequantized to a float copy.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from offload.arch.moe import ExpertList
from offload.formats.qlinear import PackedLinear
from offload.stream.hostmem import IO_ALIGN, align_up
from offload.stream.storage import DirectReader
from tests.test_gguf_moe import (
    CONVERT,
    N_NEW,
    PROMPT,
    QUANTIZE,
    SEED,
    byte_level_tokenizer,
    convert,
    gguf_weights,
    hf_greedy,
    make_moe,
)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]
WIDE = {"qwen3_moe": dict(moe_intermediate_size=256), "qwen2_moe": dict(moe_intermediate_size=256)}
WIDE["mixtral"] = dict(intermediate_size=256)
CASES = [("qwen3_moe", "q8_0"), ("qwen2_moe", "q8_0"), ("mixtral", "q8_0"), ("qwen3_moe", "q4_k_m")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def case(request, tmp_path_factory):
    """(name, kind, GGUF file, transformers' greedy ids on the file's weights)."""
    name, kind = request.param
    if kind == "q4_k_m" and not QUANTIZE.is_file():
        pytest.skip("llama-quantize not built (tools/llamacpp.sh)")
    pytest.importorskip("gguf")
    if not CONVERT.is_file():
        pytest.skip("llama.cpp's converter not built (tools/llamacpp.sh)")
    root = tmp_path_factory.mktemp(f"{name}-{kind}")
    src = make_moe(name, root / "target", seed=SEED[name], hidden_size=256, **WIDE[name])
    f = convert(src, root / f"target-{kind}.gguf", kind)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model.load_state_dict(gguf_weights(model, f))
    want = hf_greedy(model)
    assert len(set(want)) >= 8, want  # varied
    return name, kind, f, want


def greedy(m) -> list[int]:
    from transformers import DynamicCache

    from offload.arch.hfcompat import cache_kwargs

    cache, x, got = DynamicCache(), torch.tensor([byte_level_tokenizer()(PROMPT)["input_ids"]]), []
    for _ in range(N_NEW):
        x = m(input_ids=x, **cache_kwargs(m, cache), use_cache=True).logits[:, -1:].argmax(-1)
        got.append(int(x))
    return got


def expert_spans(f, parts=("weight",)) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(layer, expert) -> its (offset, length) reads, from the GGUF header: row e of each fused `ffn_*_exps`
    tensor (`parts`: weight, also bias for gpt-oss), byte ranges that touch merged, each rounded out to IO_ALIGN."""
    import gguf

    rows: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for t in gguf.GGUFReader(f).tensors:
        blk, _, rest = t.name.partition(".")[2].partition(".")
        if not any(rest.endswith(f"_exps.{p}") for p in parts):
            continue
        n = int(t.shape[-1])  # ggml order: (cols, rows, experts)
        step = int(t.n_bytes) // n
        for e in range(n):
            rows.setdefault((int(blk), e), []).append(
                (int(t.data_offset) + e * step, int(t.data_offset) + (e + 1) * step)
            )
    out = {}
    for key, ranges in rows.items():
        merged: list[list[int]] = []
        for lo, hi in sorted(ranges):
            if merged and lo == merged[-1][1]:
                merged[-1][1] = hi
            else:
                merged.append([lo, hi])
        out[key] = [
            (lo // IO_ALIGN * IO_ALIGN, align_up(hi - lo // IO_ALIGN * IO_ALIGN, IO_ALIGN)) for lo, hi in merged
        ]
    return out


def test_apart_equals_whole_layers_and_transformers(case):
    """Greedy ids: experts apart (disk), whole layers (disk), RAM tier, resident: all transformers'."""
    from offload import OffloadedCausalLM

    name, kind, f, want = case
    for offload, mode in (("disk", "auto"), ("disk", "layers"), ("ram", "auto"), ("none", "auto")):
        m = OffloadedCausalLM.from_pretrained(f, dtype=torch.float32, offload=offload, experts=mode)
        try:
            assert (m.experts is not None) == (offload == "disk" and mode == "auto"), (name, kind, offload, mode)
            assert greedy(m) == want, (name, kind, offload, mode)
        finally:
            m.close()


def check_bytes_read(f, monkeypatch, experts_cls=ExpertList, parts=("weight",), wide=True) -> None:
    """With a one-expert cache every routed expert is read once per pass: each pass's expert reads are exactly the
    header's spans of the experts it routed to (recorded at `experts_cls.forward`), the dense parts' reads never
    cover an expert's bytes (`wide`: experts of whole pages, not sharing one with a dense tensor), the streamed
    bytes are those two; `wide`: 1 token reads less than whole layers, at most 0.6 of every expert's (top-2 of 4)."""
    from offload import OffloadedCausalLM

    reads, routed = [], []
    read_span, forward = DirectReader.read_span, experts_cls.forward

    def recording_read(self, span, buf):
        reads.append((self, span.offset, span.length))
        return read_span(self, span, buf)

    def recording_forward(self, hidden, index, weights):
        routed[-1].append((id(self), sorted(set(index.flatten().tolist()))))
        return forward(self, hidden, index, weights)

    monkeypatch.setattr(DirectReader, "read_span", recording_read)
    monkeypatch.setattr(experts_cls, "forward", recording_forward)
    spans = expert_spans(f, parts)
    ids = byte_level_tokenizer()(PROMPT)["input_ids"]
    per_pass = {}
    for mode in ("auto", "layers"):
        m = OffloadedCausalLM.from_pretrained(f, dtype=torch.float32, offload="disk", expert_cache=1, experts=mode)
        layer_of = {id(layer.mlp.experts): i for i, layer in enumerate(m.layers)}
        try:
            for n in (6, 1, 2):
                reads.clear()
                routed.append([])
                before = m.stats.streamed_bytes
                m(input_ids=torch.tensor([ids[:n]]))
                per_pass[(mode, n)] = m.stats.streamed_bytes - before
                if mode == "layers":
                    continue
                got = sorted((off, size) for r, off, size in reads if r is m.experts.reader)
                want = sorted(s for mod, es in routed[-1] for e in es for s in spans[(layer_of[mod], e)])
                assert got == want, (f.name, n)
                for r, off, size in reads:  # a dense part's span never covers an expert's (whole pages) bytes
                    if r is not m.experts.reader and wide:
                        assert not any(off <= lo and lo + ln <= off + size for s in spans.values() for lo, ln in s)
                dense = sum(m.store.link_bytes(i) for i in m.plan.disk_layers)
                assert per_pass[(mode, n)] == dense + sum(s for _, s in got), (f.name, n)
                per_pass[("experts", n)] = sum(s for _, s in got)
        finally:
            m.close()
    if not wide:
        return
    assert per_pass[("auto", 1)] < per_pass[("layers", 1)], per_pass
    every = sum(ln for s in spans.values() for _, ln in s)  # every expert's spans
    assert per_pass[("experts", 1)] <= 0.6 * every, (per_pass, every)  # top-2 of 4, page-rounded


def test_bytes_read_are_the_routed_experts(case, monkeypatch):
    check_bytes_read(case[2], monkeypatch)


def test_routed_experts_compute_from_their_quantized_bytes(case, monkeypatch):
    """Each routed expert's three linears run the GGUF kernel over its bytes in the expert cache; none is
    dequantized to a float weight."""
    from offload import OffloadedCausalLM
    from offload.cpu import ggml_kernel

    if not ggml_kernel.enabled():
        pytest.skip(f"the GGUF CPU kernel is not usable here: {ggml_kernel.kernel_status()}")
    calls, linear = [], ggml_kernel.linear

    def recording_linear(x, raw, qtype, out_features, rowmap=None):
        calls.append(raw.data_ptr())
        return linear(x, raw, qtype, out_features, rowmap)

    def no_dequantize(self, device):
        raise AssertionError(f"{self.hf_name} dequantized")

    monkeypatch.setattr(ggml_kernel, "linear", recording_linear)
    monkeypatch.setattr(PackedLinear, "dequantized", no_dequantize)
    m = OffloadedCausalLM.from_pretrained(case[2], dtype=torch.float32, offload="disk")
    try:
        assert m.experts is not None
        lo = m.experts.cache.data_ptr()
        hi = lo + m.experts.cache.numel()
        m(input_ids=torch.tensor([byte_level_tokenizer()(PROMPT)["input_ids"][:3]]))
        in_cache = [p for p in calls if lo <= p < hi]
        # every layer routes 3 tokens to 2 experts or more, 3 linears each
        assert len(in_cache) >= 3 * 2 * len(m.layers), (len(in_cache), len(calls))
    finally:
        m.close()
