"""Many requests, one weight stream: the forest step (core/forest.py) over offload/stream/multi.py.

On a target streamed from disk: `forward_many` gives every job the logits (and KV rows) it gets
alone, bit for bit, in one stream; a forest of requests with different prompts and seeds gives each
request exactly the ids (and cache rows) `engine.generate` gives it alone, at T = 0 and at T > 0,
with the tree budget split between them (its KV rows equal up to float rounding: its trees have
other sizes than alone, which changes matmul blocking, never the ids); a request joining mid-reply gets its first token in the
next pass; one removed mid-forest leaves the others unchanged; an out-of-memory error in the pass
that adds a request fails that request only.
"""

from __future__ import annotations

import pytest
import torch

from offload.stream.multi import ForwardJob, forward_many
from specexec_cli.core import forest as forest_mod
from specexec_cli.core import kvcache
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig, generate
from specexec_cli.core.forest import Forest, Lane
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.core.tree import causal_mask
from specexec_cli.session.loading import LoadOptions, load_models

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PROMPTS = ["def f(x):\n  return", "for i in range(10):\n", "class a:\n  def b(self", "x = (1, 2"]
N_NEW = 24


@pytest.fixture(scope="module")
def disk(tiny_pair):
    m = load_models(LoadOptions(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32", device="cpu", offload="disk"))
    assert m.target.plan.disk_layers and not m.target.plan.resident
    m.eos_ids = frozenset()  # compare whole replies
    yield m
    m.target.close()


def cfg_for(budget: int, temperature: float = 0.0, seed: int = 0, n: int = N_NEW) -> GenerationConfig:
    return GenerationConfig(
        shape=TreeShape(budget, 8), sampling=SamplingParams(temperature=temperature), seed=seed, max_new_tokens=n
    )


def alone(m, prompt: str, cfg: GenerationConfig) -> tuple[list[int], DecodeState, int]:
    """(generated ids, final state, target passes) of `prompt` decoded by engine.generate alone."""
    st, before = DecodeState(), m.target.stats.passes
    events = list(generate(m, st, m.tokenizer(prompt)["input_ids"], cfg))
    return [t for ev in events for t in ev.tokens], st, m.target.stats.passes - before


def lane(m, prompt: str, cfg: GenerationConfig) -> Lane:
    return Lane(m, DecodeState(), m.tokenizer(prompt)["input_ids"], cfg)


def rows(st: DecodeState) -> list[torch.Tensor]:
    """The target cache's committed K rows of every layer."""
    return [layer.keys[:, :, : st.target_len].clone() for layer in st.target_cache.layers]


def test_forward_many_equals_each_job_alone_in_one_stream(disk):
    m, tok = disk, disk.tokenizer
    a, b = tok(PROMPTS[0])["input_ids"], tok(PROMPTS[1])["input_ids"]
    ref = []
    for ids in (a, b):  # each job alone: its own forward, its own cache
        cache = kvcache.new_cache()
        ref.append((kvcache.forward(m.target, cache, torch.tensor(ids), torch.arange(len(ids)), None), cache))
    caches = [kvcache.new_cache(), kvcache.new_cache()]
    mask = causal_mask(0, len(b), torch.float32)  # a 4-D mask for one job, causal None for the other
    before = m.target.stats.passes
    got = forward_many(
        m.target,
        [
            ForwardJob(torch.tensor(a), torch.arange(len(a)), None, caches[0]),
            ForwardJob(torch.tensor(b), torch.arange(len(b)), mask, caches[1]),
        ],
    )
    assert m.target.stats.passes - before == 1  # one weight stream for both
    for (logits, cache), out, mine in zip(ref, got, caches):
        assert torch.equal(out, logits)
        for x, y in zip(cache.layers, mine.layers):
            assert torch.equal(x.keys[:, :, : x.length], y.keys[:, :, : y.length])


def drive(lanes: list[Lane], forest: Forest):
    """Drive `lanes` to their ends in one forest; yields (lane, event) as they come."""
    for ln in lanes:
        forest.add(ln)
    while forest.lanes:
        for ln, ev in forest.step():
            if isinstance(ev, BaseException):
                raise ev
            if ev is not None:
                yield ln, ev


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_forest_replies_equal_each_request_alone(disk, temperature):
    """Two to four requests, different prompts and seeds, interleaved in one forest with the budget
    split between them: each gets the ids and the committed KV rows it gets alone (no leak)."""
    m, budget = disk, 32
    seeds = [11, 22, 33, 44]
    refs = [alone(m, p, cfg_for(budget, temperature, s)) for p, s in zip(PROMPTS, seeds)]
    lanes = [lane(m, p, cfg_for(budget, temperature, s)) for p, s in zip(PROMPTS, seeds)]
    got = {id(ln): [] for ln in lanes}
    forest = Forest(m)
    for ln, ev in drive(lanes, forest):
        got[id(ln)].extend(ev.tokens)
    for ln, (ids, st, _) in zip(lanes, refs):
        assert got[id(ln)] == ids
        assert ln.st.ids == st.ids
        for x, y in zip(rows(ln.st), rows(st)):  # trees of other sizes: equal up to matmul blocking
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    assert len({tuple(r[0]) for r in refs}) == len(refs)  # the replies differ: a leak would show
    assert forest.passes < sum(r[2] for r in refs)


def test_budget_is_split_between_decoding_requests(disk):
    m = disk
    forest = Forest(m)
    for p in PROMPTS[:2]:
        forest.add(lane(m, p, cfg_for(32)))
    both, one = [], []
    while forest.lanes:
        n = len(forest.lanes)
        sizes = [ev.tree_size for _, ev in forest.step() if ev.pass_index > 0]
        (both if n == 2 else one).extend(sizes)
    assert both and max(both) == 16 and max(one, default=32) == 32


def test_forest_takes_each_requests_shape_from_shape_for(disk):
    """--budget auto's forest: the speed model's split (`shape_for(k)`) replaces the even split; the
    replies are still the ones alone (a tree's shape never changes the ids)."""
    m, asked = disk, []

    def shape_for(k: int) -> TreeShape:
        asked.append(k)
        return TreeShape(4 if k == 2 else 32, 8)

    forest = Forest(m, shape_for=shape_for)
    lanes = [lane(m, p, cfg_for(32)) for p in PROMPTS[:2]]
    for ln in lanes:
        forest.add(ln)
    got, sizes = {id(ln): [] for ln in lanes}, {1: [], 2: []}
    while forest.lanes:
        k = len(forest.lanes)
        for ln, ev in forest.step():
            got[id(ln)].extend(ev.tokens if ev is not None else [])
            if ev is not None and ev.pass_index > 0:
                sizes[k].append(ev.tree_size)
    assert set(asked) <= {1, 2} and 2 in asked
    assert sizes[2] and max(sizes[2]) <= 4 and max(sizes[1], default=32) > 4
    for ln, p in zip(lanes, PROMPTS):
        assert got[id(ln)] == alone(m, p, cfg_for(32))[0]


def test_request_joining_mid_reply_gets_its_first_token_next_pass(disk):
    m = disk
    forest = Forest(m)
    first = lane(m, PROMPTS[0], cfg_for(8, n=200))
    forest.add(first)
    for _ in range(3):
        forest.step()
    late = lane(m, PROMPTS[1], cfg_for(8))
    forest.add(late)
    joined_at = forest.passes
    events = [ev for ln, ev in forest.step() if ln is late]
    assert forest.passes == joined_at + 1
    assert events and events[0] is not None and events[0].pass_index == 0 and len(events[0].tokens) == 1
    assert first in forest.lanes  # the other reply goes on
    ids, _, _ = alone(m, PROMPTS[1], cfg_for(8))
    got = list(events[0].tokens)
    while late in forest.lanes:
        got += [t for ln, ev in forest.step() if ln is late and ev is not None for t in ev.tokens]
    assert got == ids


def test_removed_request_leaves_the_others_unchanged(disk):
    m = disk
    forest = Forest(m)
    gone, kept = lane(m, PROMPTS[2], cfg_for(16, 0.8, 5, n=200)), lane(m, PROMPTS[3], cfg_for(16, 0.8, 6))
    forest.add(gone)
    forest.add(kept)
    got = []
    for i in range(40):
        if i == 3:
            forest.remove(gone)  # a cancelled or disconnected request, at a pass boundary
            assert (
                gone.st.target_len == len(gone.st.ids) - 1
                and gone.st.target_cache.get_seq_length() == gone.st.target_len
            )
        got += [t for ln, ev in forest.step() if ln is kept and ev is not None for t in ev.tokens]
        if kept not in forest.lanes:
            break
    assert gone not in forest.lanes
    assert got == alone(m, PROMPTS[3], cfg_for(16, 0.8, 6))[0]


def test_oom_while_adding_a_request_fails_only_that_request(disk, monkeypatch):
    m = disk
    forest = Forest(m)
    old = lane(m, PROMPTS[0], cfg_for(16))
    forest.add(old)
    got = [t for _, ev in forest.step() for t in ev.tokens]
    real = forest_mod.forward_many

    def oom_on_prefill(model, jobs):
        if any(job.last_only for job in jobs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, jobs)

    monkeypatch.setattr(forest_mod, "forward_many", oom_on_prefill)
    new = lane(m, PROMPTS[1], cfg_for(16))
    forest.add(new)
    out = forest.step()
    assert [(ln, type(ev).__name__) for ln, ev in out] == [(new, "OutOfMemoryError")]
    assert new not in forest.lanes and old in forest.lanes
    monkeypatch.setattr(forest_mod, "forward_many", real)
    while old in forest.lanes:
        got += [t for ln, ev in forest.step() if ev is not None for t in ev.tokens]
    assert got == alone(m, PROMPTS[0], cfg_for(16))[0]
