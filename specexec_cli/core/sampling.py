"""Pure logits → probabilities and sampling functions.

Contract: every decoding method turns raw logits into the target's *processed* distribution with
`process_logits` (temperature, then top-k, then top-p), and draws from it with `sample`, which takes
an explicit `torch.Generator`. Same inputs + same generator state → same token. T == 0 means greedy:
the processed distribution is one-hot on the argmax, so every method reduces to greedy decoding.

Coupled draws (`ar` and `specexec` at T > 0): the token at absolute position `pos` is
argmax_i p_i / E_i with E ~ Exponential(1)^V drawn by `PositionNoise` from (key, pos) alone (the
exponential race, i.e. Gumbel-max: P(token = j) = p_j exactly). Noise at different positions is
independent, and the prefix before `pos` depends only on noise at earlier positions, so every
emitted token is an exact sample of the processed distribution given its prefix. The draft sees the
same noise when it picks tree children, so its top child is the target's draw whenever the two
distributions roughly agree; and the emitted text for a seed does not depend on the draft or budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 → greedy (argmax); > 0 divides the logits
    top_k: int = 0  # keep the k most likely tokens; 0 → off
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 → off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


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
    """True nucleus: keep the smallest set of most-likely tokens whose mass is >= p, renormalised.

    A token is kept when the mass of strictly-more-likely tokens (in sorted order) is < p.
    """
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


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a (V,) distribution with an explicit generator (CPU for determinism)."""
    probs = probs.detach().to("cpu", torch.float32)
    if probs.max() >= 1.0:  # one-hot (greedy): no randomness needed, keeps the generator untouched
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


def select(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One (V,) logits row → one token id under `params`. Greedy skips the softmax entirely."""
    if params.greedy:
        return int(logits.argmax(-1))
    return sample(process_logits(logits, params), generator)


def draft_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Draft scores used to rank tree nodes: log-softmax at the run temperature (T=0 → T=1)."""
    t = params.temperature if params.temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / t, dim=-1)


def _mix(key: int, pos: int) -> int:
    """A 63-bit seed from (key, position): splitmix64 finalizer, so nearby positions are unrelated."""
    z = (key * 0x9E3779B97F4A7C15 + pos * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1


class PositionNoise:
    """Exponential(1) noise per absolute position, a pure function of (key, pos); see the contract.

    Rows are drawn on the device that uses them, by a generator of that device seeded from
    (key, pos), so no row ever crosses the host link (the same seed gives the same rows on every
    CPU, and on every GPU, but CPU and CUDA streams differ); cached per (position, device);
    `forget(n)` drops positions below n once they are committed."""

    def __init__(self, key: int):
        self.key = key
        self._rows: dict[tuple[int, str], torch.Tensor] = {}  # (pos, device) → (V,) float32

    def at(self, pos: int, vocab: int, device="cpu") -> torch.Tensor:
        """(V,) noise of position `pos` on `device`."""
        dev = str(torch.device(device))
        row = self._rows.get((pos, dev))
        if row is None or row.numel() != vocab:
            g = torch.Generator(device=dev).manual_seed(_mix(self.key, pos))
            row = self._rows[(pos, dev)] = torch.empty(vocab, device=dev).exponential_(generator=g)
        return row

    def rows(self, positions: list[int], vocab: int, device) -> torch.Tensor:
        """(B, V) noise rows for `positions` on `device`."""
        return torch.stack([self.at(p, vocab, device) for p in positions])

    def forget(self, below: int) -> None:
        for k in [k for k in self._rows if k[0] < below]:
            del self._rows[k]


def coupled_select(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> int:
    """One (V,) logits row → the exponential-race draw argmax(p / E) of the processed distribution
    (greedy: argmax, no noise); `noise` = PositionNoise row E of the token's position."""
    if params.greedy:
        return int(logits.argmax(-1))
    probs = process_logits(logits, params)
    return int((probs / noise).argmax())   # noise drawn on probs' device (PositionNoise.at)


def coupled_logprobs(logp: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draft log-probs (B, V) perturbed by the same race: log q - log E (argmax = the draft's race draw)."""
    return logp - noise.log()
