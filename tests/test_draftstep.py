"""The static draft step (core/draftstep.py) on the CPU, with padding buckets forced.

- At exact widths (the CPU's default) a pass is bit-identical to the plain forward under
  tree.attention_mask / tree.causal_mask: CPU results are unchanged.
- Padded rows never change a real row: the logits equal the exact pass's (to the rounding of a GEMM
  with more rows) and are bit-identical whatever the padded rows hold; the cache afterwards holds
  the same rows.
- The static-shaped pass (mask over the whole slab, K/V written at device rows: what CUDA captures)
  equals the appended one.
- Trees grown with padding and every method's ids (T = 0 against `ar`, seeded T > 0 against the
  unpadded run) are unchanged.
- Every method's draft forwards are draft steps (counted by wrapping `draftstep.run` from here), and
  its ids, trees and acceptance equal those of the plain forward under tree.py's masks (the path
  chain, SpecInfer, Sequoia and staged took before they used the step), at T = 0 and seeded T > 0.
- Buffers are allocated once per bucket (counted from here, by wrapping the module's allocators).
"""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest
import torch

from specexec_cli.core import calibrate, draftstep, engine, kvcache, transfers
from specexec_cli.core.draft import DraftContext, TreeShape, grow_tree
from specexec_cli.core.engine import DecodeState, GenerationConfig
from specexec_cli.core.methods import METHODS, generate, sequoia
from specexec_cli.core.methods.common import with_settings
from specexec_cli.core.sampling import SamplingParams
from specexec_cli.core.tree import attention_mask, causal_mask
from specexec_cli.session.loading import LoadOptions, load_models
from tests.test_transfers import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PREFIX = [(7 * i) % 50 + 1 for i in range(20)]
SHAPE = TreeShape(budget=24, max_depth=6, max_beams=5, max_branch=3)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the box is shared; tiny models gain nothing from threads
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(64, 2)


@pytest.fixture
def padded(monkeypatch):
    """Powers of two on the CPU (appended passes)."""
    monkeypatch.setitem(draftstep.BUCKETS, "cpu", draftstep.POWERS)


@pytest.fixture
def static(monkeypatch, padded):
    """Powers of two, run static-shaped on the CPU (where the cache is reserved)."""
    monkeypatch.setattr(draftstep, "STATIC", {"cpu"})


def prefilled(model, reserve: int | None = None):
    """A draft cache holding PREFIX (run through the plain forward)."""
    cache = kvcache.new_cache()
    if reserve:
        kvcache.reserve(cache, model, reserve)
    n = len(PREFIX)
    kvcache.forward(model, cache, torch.tensor(PREFIX), torch.arange(n), causal_mask(0, n, torch.float32))
    return cache


# a tree step over the prefix: 3 nodes, ancestors among the prefix's last columns
IDS, POS = torch.tensor([5, 9, 13]), torch.tensor([20, 21, 21])
ANC = torch.tensor([[-1, -1], [19, -1], [19, 18]])
N_PAST = 18


def test_exact_pass_is_bit_identical_to_the_plain_forward(model):
    """CPU default (no bucket listed): the step's pass is the plain forward under tree.py's masks."""
    a, b = prefilled(model), prefilled(model)
    n = len(PREFIX)
    own = torch.arange(n, n + 3)
    mask = attention_mask(N_PAST, ANC, own, n + 3, torch.float32)
    ref = kvcache.forward(model, a, IDS, POS, mask)
    got, pos, _ = draftstep.run(model, b, IDS, POS, N_PAST, ANC)
    assert torch.equal(got, ref) and pos.tolist() == POS.tolist()
    assert kvcache.cache_len(a) == kvcache.cache_len(b) == n + 3
    assert torch.equal(a.layers[1].keys[:, :, : n + 3], b.layers[1].keys[:, :, : n + 3])
    # the causal pass (pending committed tokens)
    ref = kvcache.forward(model, a, IDS, torch.arange(n + 3, n + 6), causal_mask(n + 3, 3, torch.float32))
    got, _, _ = draftstep.run(model, b, IDS, torch.arange(n + 3, n + 6), n + 3, None, causal=True)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("causal", [False, True])
def test_padded_rows_never_change_a_real_row(model, padded, monkeypatch, causal):
    """3 rows padded to 4: logits as the exact pass's; bit-identical whatever the padding holds."""
    anc = None if causal else ANC
    n_past = len(PREFIX) if causal else N_PAST
    exact_cache = prefilled(model)
    monkeypatch.setitem(draftstep.BUCKETS, "cpu", ())
    exact, _, _ = draftstep.run(model, exact_cache, IDS, POS, n_past, anc, causal=causal)
    monkeypatch.setitem(draftstep.BUCKETS, "cpu", draftstep.POWERS)
    outs = []
    for pad in (0, 41):
        monkeypatch.setattr(draftstep, "PAD_TOKEN", pad)
        cache = prefilled(model)
        step = draftstep.step_for(model, cache)
        assert step.bucket(cache, len(PREFIX), 3) == (4, False)
        outs.append(draftstep.run(model, cache, IDS, POS, n_past, anc, causal=causal)[0])
        end = len(PREFIX) + 3
        assert kvcache.cache_len(cache) == end  # the padded row's K/V lie past the length
        assert torch.allclose(cache.layers[1].keys[:, :, :end], exact_cache.layers[1].keys[:, :, :end], atol=1e-6)
    assert outs[0].shape == exact.shape == (3, 64)
    assert torch.equal(outs[0], outs[1])
    assert torch.allclose(outs[0], exact, atol=1e-5, rtol=1e-5)


def test_static_pass_equals_the_appended_one(model, static):
    """Static-shaped (whole-slab mask, K/V at device rows): the logits and live rows of the append."""
    ref_cache = prefilled(model, reserve=64)
    mask = attention_mask(N_PAST, ANC, torch.arange(20, 23), 23, torch.float32)
    ref = kvcache.forward(model, ref_cache, IDS, POS, mask)
    cache = prefilled(model, reserve=64)
    for layer in cache.layers:  # never-written rows: whatever the allocator left (zeroed before a static pass)
        layer.keys[:, :, 20:] = float("nan")
        layer.values[:, :, 20:] = float("inf")
    step = draftstep.step_for(model, cache)
    assert step.bucket(cache, 20, 3) == (4, True)
    got, _, _ = draftstep.run(model, cache, IDS, POS, N_PAST, ANC)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert kvcache.cache_len(cache) == 23 and cache.write_rows is None
    assert torch.allclose(cache.layers[0].values[:, :, :23], ref_cache.layers[0].values[:, :, :23], atol=1e-6)


def test_bucket_policy(model, monkeypatch):
    """CPU: exact widths. Listed buckets: the smallest that fits, exact beyond LARGEST or without room.
    CUDA: powers of two only where the static pass is replayed as a graph."""
    cache = prefilled(model, reserve=64)
    step = draftstep.step_for(model, cache)
    assert [step.bucket(cache, 20, b) for b in (1, 3, 17)] == [(1, False), (3, False), (17, False)]
    monkeypatch.setitem(draftstep.BUCKETS, "cpu", (4, 16))
    assert [step.bucket(cache, 20, b) for b in (1, 5, 16, 17)] == [(4, False), (16, False), (16, False), (17, False)]
    assert step.bucket(cache, 61, 3) == (3, False)  # 61 + 4 rows > the 64 reserved: no padding
    step.device = torch.device("cuda")  # the policy alone (nothing runs here)
    step.graphs = False
    assert step.bucket(cache, 20, 3) == (3, False)  # a draft that cannot be captured: exact, eager
    step.graphs = True
    assert step.bucket(cache, 20, 3) == (4, True)
    assert step.bucket(cache, 20, 129) == (129, False)  # beyond LARGEST
    assert step.bucket(kvcache.SharedCache(cache), 20, 3) == (3, False)  # a self-draft's view


def grow(model, shape=SHAPE, reserve=None):
    cache = kvcache.new_cache()
    if reserve:
        kvcache.reserve(cache, model, reserve)
    ctx = DraftContext(n_cached=0, pending=PREFIX, root_pos=len(PREFIX) - 1)
    return grow_tree(model, cache, ctx, shape, SamplingParams()), cache


@pytest.mark.parametrize("mode", ["padded", "static"])
def test_grown_tree_unchanged_by_padding(model, monkeypatch, mode, request):
    plain, plain_cache = grow(model, reserve=128)
    request.getfixturevalue(mode)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    before = transfers.snapshot()
    try:
        tree, cache = grow(model, reserve=128)
    finally:
        hook.remove()
    assert torch.equal(tree.tokens, plain.tokens) and torch.equal(tree.parents, plain.parents)
    assert torch.allclose(tree.logp, plain.logp, atol=1e-5)
    assert tree.size > 10 and len(forwards) > 2
    assert transfers.since(before).uploads == len(forwards)  # still one upload per draft forward
    n = kvcache.cache_len(plain_cache)
    assert kvcache.cache_len(cache) == n
    assert torch.allclose(cache.layers[1].keys[:, :, :n], plain_cache.layers[1].keys[:, :, :n], atol=1e-5)


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_models(LoadOptions(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu"))


def run_of(models, method, temperature=0.0, seed=0):
    """(emitted ids, (tree size, accepted) per target pass): the ids alone cannot tell a broken
    draft (every method is lossless whatever the draft proposes); the trees and acceptance can."""
    cfg = GenerationConfig(
        method=method,
        shape=TreeShape(24, 8, max_beams=6),
        sampling=SamplingParams(temperature=temperature),
        max_new_tokens=40,
        seed=seed,
    )
    cfg = with_settings(cfg, gamma=3, branching=(3, 2, 1))
    prompt = list(models.tokenizer("def add(a, b):\n    return a")["input_ids"])
    calibrate._PAIRS.clear()  # each run from the prior: the node calibration is learned online, per process
    events = list(generate(models, DecodeState(), prompt, cfg))
    return [t for ev in events for t in ev.tokens], [(ev.tree_size, ev.accepted) for ev in events]


def test_every_method_is_unchanged_by_padding(pair, monkeypatch):
    """Padding buckets forced: T = 0 ids equal ar's for every method; at T = 0 and seeded T > 0 the
    ids, trees and acceptance equal the unpadded run's; with reserved caches the static-shaped
    passes give the same."""
    greedy_ids = run_of(pair, "ar")[0]
    plain = {(m, t): run_of(pair, m, t, seed=3) for m in METHODS for t in (0.0, 0.8)}
    assert any(acc for _, acc in plain["specexec", 0.0][1])  # the draft's tokens were accepted
    monkeypatch.setitem(draftstep.BUCKETS, "cpu", draftstep.POWERS)
    for (method, t), ref in plain.items():
        got = run_of(pair, method, t, seed=3)
        assert got == ref, (method, t)
        assert t > 0 or got[0] == greedy_ids, method
    monkeypatch.setattr(draftstep, "STATIC", {"cpu"})
    reserved = replace(pair, kv_rows=(256, 256))
    for method in METHODS:
        for t in (0.0, 0.8):
            assert run_of(reserved, method, t, seed=3) == plain[method, t], (method, t)


def test_buffers_allocated_once_per_bucket(pair, monkeypatch, static):
    """Two requests on one state (a chat's turns): each bucket's buffers and the mask store are
    allocated once; the second request reuses the same tensors."""
    made, masks = collections.Counter(), []
    new_buffers, new_mask = draftstep.new_buffers, draftstep.new_mask

    def counted_buffers(p, *a):
        made[p] += 1
        return new_buffers(p, *a)

    def counted_mask(*a):
        masks.append(a)
        return new_mask(*a)

    monkeypatch.setattr(draftstep, "new_buffers", counted_buffers)
    monkeypatch.setattr(draftstep, "new_mask", counted_mask)
    models, st = replace(pair, kv_rows=(256, 256)), DecodeState()
    cfg = GenerationConfig(method="specexec", shape=TreeShape(24, 8, max_beams=6), max_new_tokens=16)
    list(generate(models, st, [3 + (5 * i) % 30 for i in range(12)], cfg))
    step = draftstep.step_for(models.draft, st.draft_cache)
    first = {p: b.ids.data_ptr() for p, b in step.buffers.items()}
    list(generate(models, st, [4, 5, 6], cfg))
    assert len(made) >= 3 and set(made.values()) == {1}, made
    assert set(made) <= set(draftstep.POWERS) and len(masks) == 1
    assert all(step.buffers[p].ids.data_ptr() == ptr for p, ptr in first.items())


def plain_run(draft, cache, tokens, positions, n_past: int, anc, *extra, causal: bool = False):
    """draftstep.run's contract as the methods met it before the step: one staged upload, then the
    plain forward appending B rows under tree.py's masks (the reference of the next test)."""
    start, b = kvcache.cache_len(cache), tokens.numel()
    ids, pos, *rest = kvcache.stage(draft, tokens, positions, *([] if anc is None else [anc]), *extra)
    dtype = kvcache.model_dtype(draft)
    if causal:  # the pending committed tokens (+ staged's root chain): a chain over the cached prefix
        assert anc is None and n_past == start
        mask = causal_mask(start, b, dtype, draft.device)
    else:
        mask = attention_mask(n_past, rest.pop(0), torch.arange(start, start + b), start + b, dtype, draft.device)
    return kvcache.forward(draft, cache, ids, pos, mask), pos, rest


def test_every_method_gives_the_ids_of_the_plain_forward(pair, monkeypatch):
    """Through the step (exact widths on the CPU) every method's ids, trees and acceptance equal the
    plain forward's, at T = 0 (then also ar's ids) and seeded T = 0.7."""
    greedy_ids = run_of(pair, "ar")[0]
    stepped = {(m, t): run_of(pair, m, t, seed=3) for m in METHODS for t in (0.0, 0.7)}
    monkeypatch.setattr(draftstep, "run", plain_run)
    for (method, t), got in stepped.items():
        assert got == run_of(pair, method, t, seed=3), (method, t)
        assert t > 0 or got[0] == greedy_ids, method
    assert any(acc for _, acc in stepped["staged", 0.7][1])


def test_every_draft_forward_of_a_step_is_a_draft_step(pair, monkeypatch):
    """Per method, each draft forward is attributed to the wrapper it ran under: the step, the
    prompt's prefill (engine.run_prompt) or Sequoia's teacher-forced measurement; none runs outside
    them, and every pass that verified a tree made at least one step."""
    stack: list[str] = []
    where: collections.Counter = collections.Counter()

    def under(name, fn):
        def call(*args, **kwargs):
            stack.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()

        return call

    monkeypatch.setattr(draftstep, "run", under("step", draftstep.run))
    monkeypatch.setattr(engine, "run_prompt", under("prompt", engine.run_prompt))
    monkeypatch.setattr(sequoia, "_teacher_forced", under("measure", sequoia._teacher_forced))
    monkeypatch.setattr(sequoia, "_VECTORS", {})  # Sequoia measures its vector in this test
    hook = pair.draft.register_forward_pre_hook(lambda *_: where.update([stack[-1] if stack else "direct"]))
    try:
        for method in (m for m in METHODS if m != "ar"):
            where.clear()
            passes = run_of(pair, method, 0.7, seed=3)[1]
            assert where["direct"] == 0, (method, where)
            assert where["step"] >= sum(1 for size, _ in passes if size > 0) > 0, (method, where)
            assert where["prompt"] >= 1 and where["measure"] == (method == "sequoia"), (method, where)
    finally:
        hook.remove()
