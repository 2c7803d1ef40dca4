"""Routed experts' reads merged into runs (offload/stream/expertruns.py through ExpertStore.stream).

A synthetic layer on disk: three fused expert tensors (gate, up, down: expert e is row e of each, as in a GGUF's
`ffn_*_exps` or gpt-oss's fused tensors), far apart in the file, of random bytes. A pass streams some experts
through an ExpertStore whose cache holds them all; the reads are recorded by a monkeypatched
DirectReader.read_span (as tests/test_moe_experts_apart.py counts them). Checked: the requests are exactly the
runs the merge rule gives (`expected_runs`, the rule restated here over the spans known by construction), in the
order the pass needs them, their bytes are what the store and the pass's stats count, experts further apart than
the gap rule allows are not merged, a run never exceeds the cap, a copy-priced merge is refused for experts
computed in the file layout and allowed for re-laid ones, every expert's slot holds its file bytes (cast where
re-laid), a failed read leaves no expert marked cached, and a cache smaller than the pass reads expert by expert.
"""

from __future__ import annotations

import pytest
import torch

from offload.errors import OffloadError
from offload.formats.st_index import TensorEntry
from offload.stream.devmem import DevicePool
from offload.stream.expertruns import PRIOR, MergeRule
from offload.stream.expertstore import ExpertStore, expert_layers
from offload.stream.hostmem import IO_ALIGN, align_up
from offload.stream.storage import DirectReader, ParamSpec

E = 12
TENSORS = ("gate_proj", "up_proj", "down_proj")
APART = 1 << 20  # bytes between the fused tensors' starts: never merged by the rules below


def expected_runs(spans, rule: MergeRule) -> list[tuple[int, int]]:
    """[(offset, length)] of the requests a pass makes: `spans` [(need, offset, length, needed, copied)] of its
    missing experts, walked in file order, each joining the run before it when the bytes between (none where
    they overlap) plus ratio x the bytes the merge copies fit in the gap and the run stays within the cap; the
    runs in the order of the first expert each holds, then file order."""
    runs = []
    for sp in sorted(spans, key=lambda s: s[1]):
        if runs:
            run = runs[-1]
            end = max(o + n for _, o, n, _, _ in run)
            extra = max(0, sp[1] - end) + rule.ratio * (sp[4] + (run[0][4] if len(run) == 1 else 0))
            if extra <= rule.gap and max(end, sp[1] + sp[2]) - run[0][1] <= rule.cap:
                run.append(sp)
                continue
        runs.append([sp])
    runs.sort(key=lambda r: (min(s[0] for s in r), r[0][1]))
    return [(r[0][1], max(o + n for _, o, n, _, _ in r) - r[0][1]) for r in runs]


@pytest.fixture(params=[(32, 32, 0), (25, 30, 100)], ids=["whole-pages", "rows-sharing-pages"])
def layer(request, tmp_path):
    """(file, {name: entry}, {name: spec}, row bytes): three fused fp32 tensors of E experts of rows x cols,
    each starting `skew` bytes past a page (off the grid: spans are rounded out, neighbours share pages)."""
    rows, cols, skew = request.param
    row = rows * cols * 4
    path = tmp_path / "experts.bin"
    data = torch.randn((len(TENSORS) + 1) * APART // 4, generator=torch.Generator().manual_seed(0))
    path.write_bytes(data.numpy().tobytes())
    entries, specs = {}, {}
    for t, name in enumerate(TENSORS):
        full = f"mlp.experts.{name}"
        begin = t * APART + IO_ALIGN + skew
        entries[full] = TensorEntry(full, path, torch.float32, (E, rows, cols), begin, begin + E * row)
        specs[full] = ParamSpec(full, (E, rows, cols), torch.float32)
    return path, entries, specs, row


def store_of(layer, rule, capacity=E, dtype=torch.float32, align=4) -> ExpertStore:
    _, entries, specs, _ = layer
    specs = {n: ParamSpec(n, sp.shape, dtype) for n, sp in specs.items()}
    experts = {(0, e): d for e, d in expert_layers(entries, specs, align).items()}
    return ExpertStore(DirectReader(direct=False), experts, capacity, DevicePool("cpu"), rule)


def recorded(monkeypatch) -> list[tuple[int, int]]:
    reads = []
    read_span = DirectReader.read_span

    def recording_read(self, span, buf):
        reads.append((span.offset, span.length))
        return read_span(self, span, buf)

    monkeypatch.setattr(DirectReader, "read_span", recording_read)
    return reads


def spans_of(store: ExpertStore, layer, es: list[int]) -> list[tuple]:
    """The pass's missing experts' spans, from the header (each tensor's row e, rounded out to IO_ALIGN)."""
    _, entries, _, row = layer
    out = []
    for k, e in enumerate(es):
        for entry in entries.values():
            lo, hi = entry.begin + e * row, entry.begin + (e + 1) * row
            start = lo // IO_ALIGN * IO_ALIGN
            copied = 0 if store.experts[(0, e)].repack else hi - start
            out.append((k, start, align_up(hi - start, IO_ALIGN), hi - start, copied))
    return out


def check_slots(store: ExpertStore, layer, dtype=torch.float32) -> None:
    """Every cached expert's parameters are its rows of the file, cast to `dtype`."""
    path, entries, _, row = layer
    raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    for (_, e), s in store.lru.items():
        d = store.experts[(0, e)]
        for name, entry in entries.items():
            lo = entry.begin + e * row
            want = raw[lo : lo + row].view(torch.float32).view(entry.shape[1:]).to(dtype)
            assert torch.equal(d.layout.view(store._buf(s), name), want), (e, name)


def stream(store, es):
    return [read for _, _, read in store.stream(0, es)]


RULES = {
    "adjacent-only": MergeRule(gap=0, cap=1 << 20, ratio=0.0),
    "one-row-gap": MergeRule(gap=4096, cap=1 << 20, ratio=0.0),
    "capped": MergeRule(gap=4096, cap=3 * 4096, ratio=0.0),
    "copy-priced": MergeRule(gap=4096, cap=1 << 20, ratio=1.0),
}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["file-layout", "re-laid"])
def test_a_pass_reads_exactly_the_merged_runs(layer, rule, dtype, monkeypatch):
    reads = recorded(monkeypatch)
    store = store_of(layer, RULES[rule], dtype=dtype)
    try:
        store.stats = type("Stats", (), {"streamed_bytes_per_pass": 0})()
        es = [9, 0, 1, 2, 4, 7, 11]  # the order experts compute in need not be the file's
        assert stream(store, es) == [True] * len(es)
        want = expected_runs(spans_of(store, layer, es), RULES[rule])
        assert reads == want, (rule, reads, want)
        assert store.requests == len(want) and store.reads == len(es)
        assert store.bytes_read == store.stats.streamed_bytes_per_pass == sum(n for _, n in want)
        check_slots(store, layer, dtype)
        # a second pass: its hits are not read, the new experts' spans merge across the cached ones' bytes
        reads.clear()
        assert stream(store, [1, 3, 5]) == [False, True, True]
        assert reads == expected_runs(spans_of(store, layer, [1, 3, 5])[3:], RULES[rule])
        check_slots(store, layer, dtype)
    finally:
        store.close()


def test_experts_beyond_the_gap_are_not_merged(layer, monkeypatch):
    """A gap of one row merges experts one row apart (0 and 2), never two rows apart (2 and 5), nor across
    the tensors; a zero gap merges only rows that touch."""
    _, entries, _, row = layer
    if row % IO_ALIGN or entries["mlp.experts.gate_proj"].begin % IO_ALIGN:
        pytest.skip("rows sharing pages touch whatever the gap")
    reads = recorded(monkeypatch)
    for gap, runs in ((row, [[0, 2], [5]]), (0, [[0, 1], [3]])):
        store = store_of(layer, MergeRule(gap=gap, cap=1 << 20, ratio=0.0))
        try:
            reads.clear()
            es = sorted({e for run in runs for e in run})
            stream(store, es)
            want = [
                (entry.begin // IO_ALIGN * IO_ALIGN + run[0] * row, (run[-1] - run[0] + 1) * row)
                for run in runs
                for entry in entries.values()
            ]
            assert sorted(reads) == sorted(want), (gap, reads, want)
        finally:
            store.close()


def test_a_failed_read_leaves_no_expert_cached(layer, monkeypatch):
    """A read that fails reaches the caller; the experts whose runs did not land are not in the cache, and a
    later pass reads them whole."""
    read_span, calls = DirectReader.read_span, []

    def failing_read(self, span, buf):
        calls.append(span.offset)
        if len(calls) == 2:
            raise OffloadError("disk gone")
        return read_span(self, span, buf)

    monkeypatch.setattr(DirectReader, "read_span", failing_read)
    store = store_of(layer, MergeRule(gap=0, cap=1 << 20, ratio=0.0))
    try:
        with pytest.raises(OffloadError, match="disk gone"):
            stream(store, [0, 1, 6, 7])
        assert len(store.lru) + len(store.free) == store.capacity
        kept = len(store.lru)
        assert store.reads == kept < 4
        assert stream(store, [0, 1, 6, 7]).count(True) == 4 - kept
        check_slots(store, layer)
    finally:
        store.close()


def test_a_cache_smaller_than_the_pass_reads_expert_by_expert(layer, monkeypatch):
    """Three experts through a cache of two: each expert's spans one request each, the next expert read while
    this one computes (no plan of the pass: a miss may evict an expert the pass computed)."""
    reads = recorded(monkeypatch)
    store = store_of(layer, MergeRule(gap=1 << 20, cap=1 << 20, ratio=0.0), capacity=2)
    try:
        stream(store, [0, 1, 2])
        assert sorted(reads) == sorted((s[1], s[2]) for s in spans_of(store, layer, [0, 1, 2]))
        check_slots(store, layer)
    finally:
        store.close()


def test_the_rule_of_a_machine():
    """gap: the bytes one request's latency reads, page-rounded down; cap: RUN_REQUESTS of them; ratio: disk
    rate over copy rate (half the memory bandwidth); no plan: the plan's own CPU priors."""
    from offload.planning.passcost import PRIORS

    rule = MergeRule.of(dict(disk_read_s=60e-6, disk_bps=2e9, memory_bps=16e9))
    assert rule.gap == 120000 // IO_ALIGN * IO_ALIGN and rule.cap == 16 * rule.gap and rule.ratio == 0.25
    assert {k: PRIORS["cpu"][k] for k in PRIOR} == PRIOR
    assert MergeRule.of(None) == MergeRule.of({k: None for k in PRIOR}) == MergeRule.of(dict(PRIOR))


def check_merged_reads(m, monkeypatch, experts_cls, ids: list[int], sizes=(6, 1, 2, 7, 0)) -> None:
    """Loaded model `m` (experts held apart, its cache as the loader sized it): each pass of `sizes` tokens of
    `ids` (0: all of them) reads, layer by layer, exactly the runs `expected_runs` gives over the spans of the
    experts its tokens routed to that miss the cache (an LRU of the store's capacity, simulated here), in the
    order they compute; expert by expert, each span alone, where a layer routes to more experts than the cache
    holds. Some pass must merge (fewer requests than spans), and the stats count the runs' bytes."""
    from collections import OrderedDict

    events, store = [], m.experts
    read_span, forward = DirectReader.read_span, experts_cls.forward

    def recording_read(self, span, buf):
        if self is store.reader:
            events.append(("read", span.offset, span.length))
        return read_span(self, span, buf)

    def recording_forward(self, hidden, index, weights):
        events.append(("routed", id(self), sorted(set(index.flatten().tolist()))))
        return forward(self, hidden, index, weights)

    monkeypatch.setattr(DirectReader, "read_span", recording_read)
    monkeypatch.setattr(experts_cls, "forward", recording_forward)
    layer_of = {id(layer.mlp.experts): i for i, layer in enumerate(m.layers) if hasattr(layer.mlp, "experts")}
    lru, spans, requests = OrderedDict(), 0, 0
    for n in sizes:
        events.clear()
        before = store.bytes_read
        m(input_ids=torch.tensor([ids[: n or len(ids)]]))
        layers = [k for k, ev in enumerate(events) if ev[0] == "routed"]
        for a, b in zip(layers, layers[1:] + [len(events)]):
            i, es = layer_of[events[a][1]], events[a][2]
            got, missing = [ev[1:] for ev in events[a + 1 : b]], []
            for k, e in enumerate(es):
                if (i, e) in lru:
                    lru.move_to_end((i, e))
                    continue
                if len(lru) >= store.capacity:
                    lru.popitem(last=False)
                lru[(i, e)] = True
                d = store.experts[(i, e)]
                missing += [(k, s.offset, s.length, s.needed, 0 if d.repack else s.needed) for s in d.spans]
            if len(es) > store.capacity or len(es) < 2:
                want = [(s[1], s[2]) for s in missing]
            else:
                want = expected_runs(missing, store.rule)
            assert got == want, (n, i, es, got, want)
            spans, requests = spans + len(missing), requests + len(got)
        assert store.bytes_read - before == sum(ev[2] for ev in events if ev[0] == "read")
    assert requests < spans, (requests, spans)


@pytest.mark.parametrize(
    "n, m, stride, rule, copied",
    [
        (24, 2, 208896, MergeRule(196608, 16 * 196608, 0.2), True),  # Q8_0 rows: adjacent ones merge, copied
        (24, 8, 208896, MergeRule(196608, 16 * 196608, 0.2), True),
        (24, 22, 208896, MergeRule(196608, 1 << 30, 0.2), True),
        (32, 10, 4096, MergeRule(8192, 1 << 30, 0.0), False),  # up to two rows between merge
        (128, 40, 65536, MergeRule(200704, 1 << 30, 0.2), False),  # re-laid: nothing copied, three between
    ],
)
def test_expected_requests_are_the_mean_of_merged_passes(n, m, stride, rule, copied):
    """expected_requests against `merge` over random passes (m of n experts missing, uniformly): the mean
    requests and bytes between within 3% (a cap that never splits a run)."""
    from pathlib import Path
    from types import SimpleNamespace

    from offload.stream.expertruns import Piece, expected_requests, merge
    from offload.stream.storage import Span

    expert = SimpleNamespace(repack=not copied)
    gen = torch.Generator().manual_seed(0)
    requests = between = 0
    samples = 3000
    for _ in range(samples):
        es = sorted(torch.randperm(n, generator=gen)[:m].tolist())
        pieces = [Piece(k, Span(Path("f"), e * stride, stride, stride, 0), expert, None) for k, e in enumerate(es)]
        runs = merge(pieces, rule)
        requests += len(runs)
        between += sum(r[-1].span.offset + stride - r[0].span.offset for r in runs) - m * stride
    want_requests, want_between = expected_requests(m, n, stride, rule, copied)
    assert requests / samples == pytest.approx(want_requests, rel=0.03)
    assert between / samples == pytest.approx(want_between, rel=0.03, abs=0.01 * stride)
