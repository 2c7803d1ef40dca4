"""Pure logits → probabilities and sampling functions, and the counter-based race noise.

Contract: every method turns raw logits into the target's *processed* distribution with
`process_logits` (temperature, top-k, top-p); a temperature below `GREEDY_BELOW` is greedy (one-hot
on the argmax, no NaN).

Coupled draws: the token at absolute position `pos` is argmax_i p_i / E_i, E_i ~ Exponential(1) (the
exponential race: P(token = j) = p_j exactly). E_i is a pure function of (key, pos, i): MurmurHash3
over the words (key_lo, key_hi, pos, i) with two stream seeds gives 52 bits of a float64 uniform
(`race_uniform`), -log of it rounded to float32. Device ops stay below 2^49 (16-bit limbs), so the
bits are the same on every device, batching and order, and each emitted token is an exact sample
given its prefix. The draft ranks its children under the same E, so its top child is the target's
draw when the two roughly agree; a seed's text does not depend on the draft or budget. On a CPU the
step's small (B, V) ops run on one torch thread (`one_thread`: a second thread waited up to 20 ms on
a 2-core host). Streams `CHILDREN`, `ACCEPT`, `RESIDUAL` serve the static-tree methods (methods/common.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from specexec_cli.core import constrain

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (argmax), everywhere
RACE, CHILDREN, ACCEPT, RESIDUAL = 0, 1, 2, 3  # noise streams (each uses hash seeds 2s and 2s + 1)
CHUNK_ELEMENTS = 1 << 22  # rows × vocabulary processed at once (bounds the int64/fp32 temporaries)
_M32 = 0xFFFFFFFF


@contextlib.contextmanager
def one_thread(device: torch.device):
    """torch's intra-op threads set to one for the block when `device` is a CPU (restored after)."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # < GREEDY_BELOW → greedy (argmax); otherwise divides the logits
    top_k: int = 0  # keep the k most likely tokens; 0 → off
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 → off

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def validate(params: SamplingParams) -> None:
    """Raise ValueError with a fix-naming message for out-of-range values."""
    if params.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (got {params.temperature}); use 0 for greedy")
    if not (0.0 < params.top_p <= 1.0):
        raise ValueError(f"--top-p must be in (0, 1] (got {params.top_p}); use 1 to disable it")
    if params.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (got {params.top_k}); use 0 to disable it")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row (ties at the k-th value are kept); others → -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1) k-th largest value
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(probs: torch.Tensor, p: float) -> torch.Tensor:
    """True nucleus: the smallest most-likely set with mass >= p (mass ahead of a kept token < p), renormalised."""
    if p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # (..., V) mass ahead of each token
    keep_sorted = mass_before < p
    keep_sorted[..., 0] = True  # the argmax is always kept
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) raw logits → (..., V) float32 probabilities of the processed distribution."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = top_k_filter(logits / params.temperature, params.top_k)
    probs = torch.softmax(logits, dim=-1)
    return top_p_filter(probs, params.top_p)


# ---- the counter-based hash: works on Python ints and on int64 tensors alike (values in [0, 2^32))


def _mul32(a, b: int):
    """(a * b) mod 2^32 without overflowing int64: a split in 16-bit limbs (products < 2^48)."""
    return ((a & 0xFFFF) * b + ((((a >> 16) * b) & 0xFFFF) << 16)) & _M32


def _rotl(x, r: int):
    return ((x << r) & _M32) | (x >> (32 - r))


def _block(h, k):
    """MurmurHash3 (x86_32) body step: mix one 32-bit word k into the state h."""
    k = _mul32(_rotl(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _fmix(h):
    """MurmurHash3's finaliser (full avalanche)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def hash32(seed: int, key: int, pos, tok):
    """MurmurHash3_x86_32 of the words (key_lo, key_hi, pos, tok) with `seed`; pos/tok broadcast."""
    h = _block(_block(seed, key & _M32), (key >> 32) & _M32)  # a Python int: per key, not per element
    return _fmix(_block(_block(h, pos), tok) ^ 16)


def race_uniform(key: int, stream: int, pos: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in (0, 1) of (key, stream, pos, tok): 52 hash bits u, (2u + 1) / 2^53 (exact)."""
    hi = hash32(2 * stream, key, pos, tok)  # 32 bits
    lo = hash32(2 * stream + 1, key, pos, tok) >> 12  # 20 bits
    return ((hi << 21) | (lo << 1) | 1).double() * 2.0**-53


def race_exponential(key: int, stream: int, pos: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """Float32 Exponential(1) variates -log U of `race_uniform` (computed in float64)."""
    return (-torch.log(race_uniform(key, stream, pos, tok))).float()


class PositionNoise:
    """Exponential(1) noise of every (position, token), a pure function of (key, stream, pos, token),
    computed on the device that uses it and cached per (stream, device) as one block of consecutive
    positions; `forget(n)` drops positions below n. A narrower vocabulary's rows are prefixes."""

    def __init__(self, key: int):
        self.key = key
        self._blocks: dict[tuple[int, str], tuple[int, torch.Tensor]] = {}  # (stream, device) → (start, (R, V))

    def _compute(self, start: int, count: int, vocab: int, device, stream: int) -> torch.Tensor:
        pos = torch.arange(start, start + count, device=device)[:, None]  # (count, 1)
        tok = torch.arange(vocab, device=device)[None, :]  # (1, V)
        step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
        return torch.cat([race_exponential(self.key, stream, pos[a : a + step], tok) for a in range(0, count, step)])

    def block(self, start: int, count: int, vocab: int, device="cpu", stream: int = RACE) -> torch.Tensor:
        """(count, vocab) float32 noise rows of positions start .. start + count - 1 on `device`."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" share one block
            dev = torch.device("cuda", torch.cuda.current_device())
        slot = (stream, str(dev))
        have_start, rows = self._blocks.get(slot, (start, None))
        end = start + count
        if rows is None or rows.shape[1] < vocab or start < have_start:
            rows, have_start = self._compute(start, count, vocab, dev, stream), start
        elif have_start + rows.shape[0] < end:  # extend the block by the missing positions only
            have_end = have_start + rows.shape[0]
            rows = torch.cat([rows, self._compute(have_end, end - have_end, rows.shape[1], dev, stream)])
        self._blocks[slot] = (have_start, rows)
        return rows[start - have_start : end - have_start, :vocab]

    def forget(self, below: int) -> None:
        """Drop the rows of positions < below (committed)."""
        for slot, (start, rows) in list(self._blocks.items()):
            if start + rows.shape[0] <= below:
                del self._blocks[slot]
            elif start < below:
                self._blocks[slot] = (below, rows[below - start :])


def race_choice(
    logits: torch.Tensor,
    params: SamplingParams,
    noise: torch.Tensor | None,
    index: torch.Tensor | None,
    bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """(R, V) logits -> (R,) long chosen tokens on their device: argmax at T = 0, else argmax(p / E)
    with E = noise[index[r]] ((D, V) rows; index None: noise[r]). bits: (R, W) int32 grammar masks on
    the device; the tokens they forbid go to -inf first (constrained decoding)."""
    if params.greedy and bits is None:
        return logits.argmax(-1)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    step = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    with one_thread(logits.device):
        for a in range(0, logits.shape[0], step):  # (step, V) temporaries at a time
            chunk = logits[a : a + step] if bits is None else constrain.apply(logits[a : a + step], bits[a : a + step])
            if params.greedy:
                out[a : a + step] = chunk.argmax(-1)
                continue
            probs = process_logits(chunk, params)
            rows = noise[:, : probs.shape[-1]]
            e = rows[a : a + step] if index is None else rows.index_select(0, index[a : a + step])
            out[a : a + step] = (probs / e).argmax(-1)
    return out
