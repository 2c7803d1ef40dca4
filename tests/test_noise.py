"""The race noise of sampling.py: a pure, device-independent function of (key, stream, position, token).

- Golden bits: the 32-bit hash and the float32 exponential of a few (key, position, token) triples
  are pinned, so a change of hash (which would change every sampled text for a seed) is caught.
- Oracle: the hash is MurmurHash3_x86_32 of the four little-endian words (key_lo, key_hi, pos, tok),
  checked against a plain Python reference and against the `mmh3` package when it is installed.
- Batching: the same triples computed as a block, row by row, and in shuffled orders give the same
  bits (no state, no generator, nothing depends on what else is in the batch).
- Statistics: the uniforms pass Kolmogorov-Smirnov on 1e5 draws, neighbouring positions and tokens
  are uncorrelated, and the race argmax p / E draws a known distribution (chi-square).
- Tiny temperatures (< 1e-5) are greedy, without NaN, through the engine too.
"""

from __future__ import annotations

import struct

import pytest
import torch
from scipy.stats import chisquare, kstest

from specexec_cli.core.sampling import (
    ACCEPT,
    CHILDREN,
    RACE,
    PositionNoise,
    SamplingParams,
    hash32,
    process_logits,
    race_choice,
    race_exponential,
    race_uniform,
)

KEY = (0x1234_5678 << 32) | 0x9ABC_DEF0  # a 61-bit key, as engine.new_noise draws them
M32 = 0xFFFFFFFF


def murmur3_reference(words: list[int], seed: int) -> int:
    """MurmurHash3_x86_32 over 32-bit words, straight from the published algorithm (Python ints)."""

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & M32

    h = seed
    for k in words:
        k = (k * 0xCC9E2D51) & M32
        k = rotl(k, 15)
        k = (k * 0x1B873593) & M32
        h = rotl(h ^ k, 13)
        h = (h * 5 + 0xE6546B64) & M32
    h ^= 4 * len(words)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


TRIPLES = [(KEY, 0, 0), (KEY, 17, 5), (3, 4095, 128255), (2**62 - 1, 123456, 77)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def test_golden_values():
    """Pinned outputs: changing the hash, its word order or the uniform → exponential map fails here."""
    h = [int(hash32(0, key, torch.tensor(p), torch.tensor(t))) for key, p, t in TRIPLES[:2]]
    assert h == [3076288915, 2742015921]
    e = [race_exponential(key, RACE, torch.tensor([p]), torch.tensor([t])) for key, p, t in TRIPLES[:2]]
    assert [int(bits(x)[0]) for x in e] == [1051385176, 1055244962]


@pytest.mark.parametrize("seed", [0, 1, 6, 7])
def test_hash_is_murmur3(seed):
    for key, p, t in TRIPLES:
        words = [key & M32, key >> 32, p, t]
        got = int(hash32(seed, key, torch.tensor(p), torch.tensor(t)))
        assert got == murmur3_reference(words, seed)
    mmh3 = pytest.importorskip("mmh3")
    for key, p, t in TRIPLES:
        packed = struct.pack("<4I", key & M32, key >> 32, p, t)
        assert int(hash32(seed, key, torch.tensor(p), torch.tensor(t))) == mmh3.hash(packed, seed=seed, signed=False)


def test_same_bits_in_any_batching_and_order():
    vocab, start, count = 97, 40, 6
    noise = PositionNoise(KEY)
    block = noise.block(start, count, vocab)  # (6, 97) at once
    rows = torch.stack([PositionNoise(KEY).block(start + i, 1, vocab)[0] for i in range(count)])  # row by row
    assert torch.equal(bits(block), bits(rows))
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(start, start + count, (500,), generator=g)  # scattered (pos, tok) pairs
    tok = torch.randint(0, vocab, (500,), generator=g)
    scattered = race_exponential(KEY, RACE, pos, tok)
    assert torch.equal(bits(scattered), bits(block[pos - start, tok]))
    perm = torch.randperm(500, generator=g)
    assert torch.equal(bits(race_exponential(KEY, RACE, pos[perm], tok[perm])), bits(scattered[perm]))
    # a wider vocabulary and a later, extended block keep the same rows (a cache that grows)
    wide = PositionNoise(KEY)
    wide.block(start, 2, vocab)
    assert torch.equal(bits(wide.block(start, count, 2 * vocab)[:, :vocab]), bits(block))
    wide.forget(start + 3)
    assert torch.equal(bits(wide.block(start + 3, 3, vocab)), bits(block[3:]))


def test_streams_and_keys_differ():
    pos, tok = torch.arange(8)[:, None], torch.arange(64)[None]
    a = race_exponential(KEY, RACE, pos, tok)
    for other in (
        race_exponential(KEY, CHILDREN, pos, tok),
        race_exponential(KEY, ACCEPT, pos, tok),
        race_exponential(KEY + 1, RACE, pos, tok),
    ):
        assert (a != other).float().mean() > 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_same_bits_on_cuda():
    pos, tok = torch.arange(3, 40)[:, None], torch.arange(5000)[None]
    cpu = race_uniform(KEY, RACE, pos, tok)
    gpu = race_uniform(KEY, RACE, pos.cuda(), tok.cuda()).cpu()
    assert torch.equal(bits(cpu), bits(gpu))
    e_cpu, e_gpu = PositionNoise(KEY).block(3, 37, 5000), PositionNoise(KEY).block(3, 37, 5000, "cuda").cpu()
    assert (bits(e_cpu) != bits(e_gpu)).sum() <= 2  # -log in float64 may differ by an ulp before rounding


def test_uniforms_are_uniform_and_independent():
    u = race_uniform(KEY, RACE, torch.arange(1000)[:, None], torch.arange(100)[None])  # 1e5 draws
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    for a, b in ((u[:-1], u[1:]), (u[:, :-1], u[:, 1:])):  # neighbouring positions, neighbouring tokens
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(r)) < 4 / (a.numel() ** 0.5)
    # the 16 x 16 grid of (u at token t, u at token t + 1) pairs: every cell equally likely
    cells = (u[:, :-1] * 16).long() * 16 + (u[:, 1:] * 16).long()
    assert chisquare(torch.bincount(cells.flatten(), minlength=256).numpy()).pvalue > 1e-3
    e = race_exponential(KEY, ACCEPT, torch.arange(1000)[:, None], torch.arange(100)[None])
    assert kstest(e.flatten().double().numpy(), "expon").pvalue > 1e-3


def test_race_draws_the_processed_distribution():
    """argmax p / E over 20000 positions (one row each) follows p (chi-square)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=5)
    n = 20000
    noise = PositionNoise(KEY).block(0, n, 6)
    tokens = race_choice(logits.expand(n, 6), params, noise, torch.arange(n))
    p = process_logits(logits, params)
    counts = torch.bincount(tokens, minlength=6)
    assert counts[5] == 0  # cut by top-k
    assert chisquare(counts[:5].double().numpy(), (p[:5].double() / p[:5].double().sum() * n).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("t", [1e-6, 1e-9, 9.9e-6])
def test_tiny_temperature_is_greedy(t):
    params = SamplingParams(temperature=t, top_p=0.9)
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]]) * 1e3
    probs = process_logits(logits, params)
    assert params.greedy and not torch.isnan(probs).any()
    assert race_choice(logits, params, None, None).tolist() == [1, 2]


def test_tiny_temperature_decodes_like_greedy():
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import DecodeState, GenerationConfig
    from specexec_cli.core.methods import generate
    from tests.fakes import fake_models, noisy, random_table

    table = random_table(8, seed=0)
    outs = {}
    for method in ("ar", "specexec", "chain", "sequoia"):
        for t in (0.0, 1e-7):
            cfg = GenerationConfig(method=method, shape=TreeShape(8, 4), sampling=SamplingParams(t), max_new_tokens=20)
            m = fake_models(table, noisy(table, 0.5, seed=1))
            outs[method, t] = [x for ev in generate(m, DecodeState(), [1, 2], cfg) for x in ev.tokens]
    assert len(set(map(tuple, outs.values()))) == 1


def test_served_tiny_temperature_is_greedy():
    """A request's temperature 1e-7 reaches the engine as greedy settings (the worker's merge)."""
    from specexec_cli.serve.models import CompletionRequest
    from specexec_cli.serve.structured import to_work
    from specexec_cli.session.gendefaults import merge

    work = to_work(CompletionRequest(prompt="x", temperature=1e-7))
    params = merge(SamplingParams(0.6, top_p=0.9), work.temperature, work.top_k, work.top_p)
    assert params.temperature == 1e-7 and params.greedy
    logits = torch.randn(3, 50)
    assert not torch.isnan(process_logits(logits, params)).any()
    assert torch.equal(race_choice(logits, params, None, None), logits.argmax(-1))
