"""What the decoding loop reads and yields: the loaded models, one call's configuration, a
conversation's decode state, and the per-pass results and events.

Contract: plain dataclasses that `engine.py` drives, then the rules it applies between passes:
`check_fits` (else ContextOverflow), `add_prompt` (caches reserved, prefill passes counted) and
`finish_reason`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specexec_cli.core import kvcache
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.grammar import GrammarSpec
from specexec_cli.core.logprobs import TokenLogprob
from specexec_cli.core.sampling import PositionNoise, SamplingParams
from specexec_cli.errors import SpecxError


class ContextOverflow(SpecxError):
    """The prompt (or conversation) does not fit in the models' context window."""


@dataclass
class Models:
    """Everything loaded once per process."""

    target: object  # HF causal LM (resident or offloaded)
    draft: object | None  # small HF causal LM on the device; None for --method ar
    tokenizer: object  # shared by both models (checked at load time)
    eos_ids: frozenset[int]  # any of these ends generation
    ctx_limit: int  # max positions both models support (and --ctx, when planned)
    pool: object = None  # offload.stream.storage.DevicePool counting device bytes; None = plain torch allocations
    kv_rows: tuple[int, int] | None = None  # (target, draft) cache rows to preallocate; None = grow on demand
    pass_tokens: int = 0  # most tokens per prefill pass (the plan's largest pass); 0 = whole prompt at once
    shared_kv: bool = False  # the draft reads the target's committed KV (self-draft: kvcache.SharedCache)
    stop_strings: tuple[str, ...] = ()  # a reply ends before the first of these texts (the checkpoint's own)


@dataclass(frozen=True)
class GenerationConfig:
    method: str = "specexec"  # name in methods.METHODS (the core ones in STEP_METHODS)
    shape: TreeShape = TreeShape(budget=64, max_depth=64)  # noqa: RUF009 - frozen, shared safely
    sampling: SamplingParams = SamplingParams()  # noqa: RUF009 - frozen
    seed: int = 0
    max_new_tokens: int = 256
    extra: dict = field(default_factory=dict, hash=False, compare=False)  # method options (methods/common.py)
    grammar: GrammarSpec | None = None  # structured output (core/grammar.py); None = free text
    logprobs: int | None = None  # None = off; k >= 0: each emitted token's logprob and its top-k (core/logprobs.py)


@dataclass
class DecodeState:
    """A conversation's committed tokens and both models' KV caches."""

    ids: list[int] = field(default_factory=list)  # prompt + generated tokens, all turns
    target_cache: Any = field(default_factory=kvcache.new_cache)
    target_len: int = 0  # committed tokens in the target cache
    draft_cache: Any = field(default_factory=kvcache.new_cache)
    draft_len: int = 0  # committed tokens in the draft cache
    noise: PositionNoise | None = None  # coupled draws of the current generate call (sampling.py)
    prefill_streams: int = 0  # target passes the latest prefill took
    grammar: Any = None  # constrain.GrammarRun of the current generate call; None = unconstrained


@dataclass
class StepResult:
    """What one target pass of a method produced."""

    tokens: list[int]  # emitted tokens (accepted draft tokens + the target's own token)
    accepted: int  # how many of `tokens` came from the draft's tree
    tree_size: int = 0  # draft nodes the target verified (root excluded)
    tree_depth: int = 0  # deepest verified node
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    logprobs: list[TokenLogprob] | None = None  # one per token when GenerationConfig.logprobs is set


@dataclass
class StepEvent:
    """One streamed update: what the CLI prints and what RunStats accumulates."""

    text: str  # newly decodable text (may be "" while a UTF-8 sequence is incomplete)
    tokens: list[int]  # token ids emitted by this step
    accepted: int  # of which came from the draft (from_draft)
    pass_index: int  # 0 = prefill, then 1, 2, ... target passes
    tree_size: int
    tree_depth: int
    draft_seconds: float
    target_seconds: float
    prefill_seconds: float  # whole prefill time (set on every event)
    decode_seconds: float  # wall time since the prefill ended
    new_tokens: int  # generated so far, this call
    prompt_tokens: int  # tokens prefilled by this call
    finish: str | None = None  # "eos" | "stop" (grammar complete) | "length" | "context" on the last event
    host_transfers: int = 0  # host<->device copies this step made (transfers.to_host / upload calls)
    host_transfer_bytes: int = 0  # their payload bytes
    prefill_streams: int = 0  # target passes of the prefill (each streams every offloaded layer once)
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens` when GenerationConfig.logprobs is set


StepFn = Callable[[Models, DecodeState, GenerationConfig, torch.Generator, int], StepResult]


def reserve_caches(m: Models, st: DecodeState) -> None:
    """Preallocate both caches for the planned rows (no-op when unplanned or already allocated)."""
    if m.shared_kv and not isinstance(st.draft_cache, kvcache.SharedCache):
        st.draft_cache, st.draft_len = kvcache.SharedCache(st.target_cache), 0
    if m.kv_rows is not None:
        kvcache.reserve(st.target_cache, m.target, m.kv_rows[0], m.pool, "kv_target")
        if m.draft is not None and not m.shared_kv:
            kvcache.reserve(st.draft_cache, m.draft, m.kv_rows[1], m.pool, "kv_draft")


def add_prompt(m: Models, st: DecodeState, new_ids: list[int]) -> None:
    """Commit `new_ids` for the next prefill (caches reserved, its target passes counted)."""
    reserve_caches(m, st)
    st.ids.extend(new_ids)
    n_new, chunk = len(st.ids) - st.target_len, m.pass_tokens  # engine.prompt_chunks' passes (chunk 0: one)
    st.prefill_streams = 0 if n_new <= 0 else (1 if chunk <= 0 else -(-n_new // chunk))


def check_fits(m: Models, st: DecodeState, new_ids: list[int]) -> None:
    total = len(st.ids) + len(new_ids)
    if total + 1 > m.ctx_limit:
        raise ContextOverflow(
            f"prompt needs {total} tokens but the context holds {m.ctx_limit}; shorten the prompt"
            + (" or /clear the conversation" if st.ids else "")
        )


def finish_reason(m: Models, st: DecodeState, tokens: list[int], produced: int, cfg) -> str | None:
    if any(t in m.eos_ids for t in tokens):
        return "eos"
    if st.grammar is not None and st.grammar.done:  # the grammar is complete: nothing more can follow
        return "stop"
    if produced >= cfg.max_new_tokens:
        return "length"
    if len(st.ids) >= m.ctx_limit:
        return "context"
    return None
