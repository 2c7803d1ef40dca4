"""The decoding loop: prefill, then one speculative (or plain) step per target pass, as events.

Contract: `generate(models, state, prompt_ids, config)` is a generator of `StepEvent`s — one for the
prefill and one per target pass — and never prints. The first event carries the token the prefill
yields. `DecodeState` holds the committed tokens and both caches, so a chat can call `generate`
again with only the new turn's tokens and prefill nothing twice. Invariants between steps:
the target cache holds ids[:-1] (the last committed token is the next root) and the draft cache
holds ids[:draft_len] for some draft_len < len(ids). Every method keeps them. With `Models.shared_kv`
the draft's cache is a view of the target's (kvcache.SharedCache): the draft never prefills, and
each tree starts from the target's committed rows with only the root pending (`draft_context`).
The dataclasses it reads and yields live in `state.py`, the detokenizer in `text.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from specexec_cli.core import calibrate, constrain, kvcache, transfers
from specexec_cli.core.draft import DraftContext, Scoring, TreeShape, grow_tree
from specexec_cli.core.grammar import GrammarError, compile_grammar, output_width
from specexec_cli.core.logprobs import TokenLogprob, token_logprobs
from specexec_cli.core.ngram import NgramIndex
from specexec_cli.errors import SpecxError
from specexec_cli.core.sampling import RACE, PositionNoise, SamplingParams, race_choice
from specexec_cli.core.tree import causal_mask, subtree, top_budget
from specexec_cli.core.verify import accept_tree, target_pass
from specexec_cli.core.state import (ContextOverflow, DecodeState, GenerationConfig, Models, StepEvent,  # noqa: F401
                                     StepFn, StepResult)
from specexec_cli.core.text import TextChunk, TextStream  # noqa: F401


def new_noise(gen: torch.Generator) -> PositionNoise:
    """Coupled-draw noise keyed by one draw of `gen` (successive calls get unrelated noise)."""
    return PositionNoise(int(torch.randint(0, 2**62, (1,), generator=gen)))


def draw(st: DecodeState, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The target's token at position len(st.ids) from its (V,) logits: the race of sampling.py
    (argmax at T = 0), on the logits' device, masked by the grammar's committed state when the call
    has one; one counted copy of the chosen id."""
    rows = bits = None
    if not params.greedy:
        st.noise = st.noise or new_noise(gen)
        rows = st.noise.block(len(st.ids), 1, logits.shape[-1], logits.device, RACE)  # (1, V)
    if st.grammar is not None:
        (bits,) = transfers.upload(logits.device, st.grammar.root_bitmask())  # (1, W)
    return int(transfers.to_host(race_choice(logits[None], params, rows, None, bits))[0])


def logprobs_of(cfg: GenerationConfig, logits: torch.Tensor, rows: list[int], tokens: list[int]):
    """StepResult.logprobs: the emitted tokens' logprobs from the pass's (n, V) logits (None when off)."""
    return None if cfg.logprobs is None else token_logprobs(logits, rows, tokens, cfg.logprobs)




def ar_step(m: Models, st: DecodeState, cfg: GenerationConfig, gen: torch.Generator, limit: int) -> StepResult:
    """Plain autoregressive decoding: one target pass over the root yields one token."""
    t0 = time.perf_counter()
    root = torch.tensor(st.ids[-1:], dtype=torch.long)
    mask = causal_mask(st.target_len, 1, kvcache.model_dtype(m.target), m.target.device)
    logits = kvcache.forward(m.target, st.target_cache, root, torch.tensor([len(st.ids) - 1]), mask)
    tok = draw(st, logits[-1], cfg.sampling, gen)
    st.target_len += 1
    st.ids.append(tok)
    return StepResult([tok], 0, target_seconds=time.perf_counter() - t0,
                      logprobs=logprobs_of(cfg, logits[-1:], [0], [tok]))


def commit_tree(st: DecodeState, tree, vt, acc, n_pending: int) -> None:
    """Keep the accepted path in both caches (compacted in place) and extend st.ids.

    Target cache afterwards: ids[:-1] (root + accepted nodes; the last emitted token is the next
    root). Draft cache: prefix + root + the accepted nodes the draft already ran (a path prefix).
    """
    in_cache = acc.path if acc.bonus else acc.path[:-1]
    keep = torch.tensor([0] + in_cache, dtype=torch.long)
    kvcache.compact(st.target_cache, st.target_len, st.target_len + keep)
    st.target_len += int(keep.numel())
    if follow_target(st):   # a shared draft cache: its committed rows are the target's
        st.ids.extend(acc.tokens)
        return
    base = st.draft_len + n_pending - 1  # draft cache row of the root
    nodes = vt.draft_ids[torch.tensor(in_cache, dtype=torch.long)]
    run = tree.slot[nodes][tree.slot[nodes] >= 0]  # accepted nodes the draft already ran
    kvcache.compact(st.draft_cache, base + 1, base + run)
    st.draft_len = base + 1 + int(run.numel())
    st.ids.extend(acc.tokens)


DEFAULT_SCORES = "calibrated+ngram"  # node scores of --method specexec (see tree_scoring)


def sampling_key(params: SamplingParams) -> str:
    """Calibration key; ",race": children ranked under the coupled-draw noise (T > 0); ",gap": greedy
    children featured by their log-prob gap to the draft's top child (T = 0). Both use gap features."""
    race = ",gap" if params.greedy else ",race"
    t = 0.0 if params.greedy else params.temperature
    return f"T={t:g},top_k={params.top_k},top_p={params.top_p:g}{race}"


def tree_scoring(m: Models, st: DecodeState, cfg: GenerationConfig) -> Scoring | None:
    """SpecExec's node scores, chosen by cfg.extra "scores" (default DEFAULT_SCORES): "draft" (raw
    cumulative draft log-probs, plain SpecExec) | "calibrated" | "calibrated+ngram" (calibrate.py)."""
    mode = (cfg.extra or {}).get("scores", DEFAULT_SCORES)
    if mode not in ("calibrated+ngram", "calibrated", "draft"):
        raise SpecxError(f"scores must be calibrated+ngram, calibrated or draft (got {mode!r})")
    if mode == "draft":
        return None
    extra = cfg.extra or {}
    cal = calibrate.for_pair(m.target, m.draft, sampling_key(cfg.sampling), extra.get("sequoia_profile"),
                             extra.get(calibrate.PROFILE_KEY), constrained=st.grammar is not None)
    ngram = NgramIndex(st.ids) if mode == "calibrated+ngram" else None
    noise = st.noise if not cfg.sampling.greedy else None
    return Scoring(cal=cal, ngram=ngram, committed=st.ids, noise=noise)


def follow_target(st: DecodeState) -> bool:
    """Put a shared draft cache (kvcache.SharedCache) at the target's committed rows; False if not shared."""
    if not isinstance(st.draft_cache, kvcache.SharedCache):
        return False
    st.draft_len = st.target_len
    st.draft_cache.follow(st.target_len)
    return True


def draft_context(st: DecodeState) -> DraftContext:
    """Where the draft starts a tree: its cached committed rows and the committed tokens it has not
    run yet (the last one is the root). A shared cache starts at the target's rows: only the root."""
    follow_target(st)
    return DraftContext(n_cached=st.draft_len, pending=st.ids[st.draft_len :], root_pos=len(st.ids) - 1)


def default_grow(m: Models, st: DecodeState, ctx: DraftContext, shape: TreeShape, params: SamplingParams, scoring=None):
    return grow_tree(m.draft, st.draft_cache, ctx, shape, params, scoring, grammar=st.grammar)


def verify_pass(m: Models, st: DecodeState, vt, *extra: torch.Tensor) -> list[torch.Tensor]:
    """verify.target_pass over root + tree from the state: [(n, V) logits, (n,) positions, *extra]."""
    return target_pass(m.target, st.target_cache, vt, st.target_len, len(st.ids) - 1, *extra)


def speculative_step(
    m: Models, st: DecodeState, cfg: GenerationConfig, gen: torch.Generator, limit: int, grow=default_grow
) -> StepResult:
    """SpecExec: grow a draft tree, verify it in one target pass, accept, trim both caches.

    `grow(m, st, ctx, shape, sampling, scoring) -> Tree` lets a method swap the tree-growth stage only.
    The stages before and after the target's pass are `grow_step` and `accept_step` (core/forest.py
    runs them around one pass shared by several requests).
    """
    ts = grow_step(m, st, cfg, gen, limit, grow)
    if ts is None:
        return ar_step(m, st, cfg, gen, limit)
    # 2) one target pass over root + tree: (n_tree,) tokens at positions root_pos + depth
    # (the grammar masks of the nodes, if any, ride in the pass's upload)
    logits, positions, *bits = verify_pass(m, st, ts.vt, *([ts.bits] if ts.bits is not None else []))
    ts.bits = bits[0] if bits else None
    return accept_step(m, st, cfg, ts, logits, positions)


@dataclass
class TreeStep:
    """A grown tree waiting for the target's pass (speculative_step between stages 1 and 3)."""

    tree: object  # the draft's whole Tree
    vt: object  # the VerifyTree the target checks (best `budget` nodes, ancestor-closed)
    n_pending: int  # committed tokens the draft ran this step (DraftContext.pending)
    scoring: Scoring | None  # node scores to calibrate from the outcome
    limit: int  # most tokens this step may emit
    t0: float  # perf_counter when growth began
    t1: float  # perf_counter when the tree was ready
    bits: torch.Tensor | None = None  # (n_tree, W) int32 grammar masks of the verified nodes; None = free
    ends: frozenset = frozenset()  # VerifyTree indices where the grammar is complete (the walk stops)


def grow_step(m: Models, st: DecodeState, cfg: GenerationConfig, gen: torch.Generator, limit: int,
              grow=default_grow) -> TreeStep | None:
    """Stage 1: grow the tree with the draft and keep the best `budget` nodes; None = no room for
    a tree (depth < 1 or budget < 1: a plain step instead)."""
    n = len(st.ids)
    depth = min(cfg.shape.max_depth, limit - 1, m.ctx_limit - n - 1)  # the bonus needs one slot
    if depth < 1 or cfg.shape.budget < 1:
        return None
    shape = replace(cfg.shape, max_depth=depth)
    t0 = time.perf_counter()
    ctx = draft_context(st)
    st.noise = st.noise or new_noise(gen)
    scoring = tree_scoring(m, st, cfg) if grow is default_grow else None
    tree = grow(m, st, ctx, shape, cfg.sampling, scoring)
    vt = subtree(tree, top_budget(tree.logp, shape.budget))
    bits, ends = None, frozenset()
    if st.grammar is not None and grow is default_grow:   # every verified node's mask (the draft's are reused)
        ids = vt.draft_ids.tolist()
        bits, ends = st.grammar.bitmask(ids), frozenset(i for i, s in enumerate(st.grammar.stopped(ids)) if s)
    return TreeStep(tree, vt, len(ctx.pending), scoring, limit, t0, time.perf_counter(), bits, ends)


def accept_step(m: Models, st: DecodeState, cfg: GenerationConfig, ts: TreeStep, logits: torch.Tensor,
                positions: torch.Tensor) -> StepResult:
    """Stages 3-4 after the target's (n_tree, V) logits at (n_tree,) positions: accept, trim both caches."""
    n = len(st.ids)
    # 3) every node's token on the device, one (n,) copy, then the walk down the tree
    bits = transfers.upload(logits.device, ts.bits)[0] if ts.bits is not None else None  # no copy when staged
    acc = accept_tree(ts.vt, logits, cfg.sampling, st.noise, n, m.eos_ids, ts.limit, depth=positions - (n - 1),
                      bits=bits, ends=ts.ends)
    lps = logprobs_of(cfg, logits, ([0] + acc.path)[: len(acc.tokens)], acc.tokens)  # row of each token's draw
    if ts.scoring is not None and ts.scoring.cal is not None:  # learn which features the target accepts
        calibrate.observe_pass(ts.scoring.cal, ts.tree, ts.vt.draft_ids[acc.path].tolist(), acc.tokens)
    t2 = time.perf_counter()
    # 4) trim caches to the accepted path; the last emitted token becomes the next root
    commit_tree(st, ts.tree, ts.vt, acc, ts.n_pending)
    t3 = time.perf_counter()
    return StepResult(
        tokens=acc.tokens,
        accepted=len(acc.path),
        tree_size=ts.vt.size - 1,
        tree_depth=int(ts.vt.depth.max()),
        draft_seconds=ts.t1 - ts.t0 + (t3 - t2),
        target_seconds=t2 - ts.t1,
        logprobs=lps,
    )


STEP_METHODS: dict[str, StepFn] = {"ar": ar_step, "specexec": speculative_step}  # core methods only


def core_step(method: str) -> StepFn:
    """The step of a core method; the others live in specexec_cli.core.methods (which imports this module)."""
    if method not in STEP_METHODS:
        raise SpecxError(
            f"method {method!r} is not a core engine method; use specexec_cli.core.methods.generate "
            "(or pass step_fn=specexec_cli.core.methods.step_for(name))"
        )
    return STEP_METHODS[method]


def run_prompt(model, cache, ids: list[int], start: int, chunk: int) -> torch.Tensor:
    """Feed ids[start:] causally in passes of at most `chunk` tokens (0 = one pass); returns the
    (V,) logits of the last token only, so a long prompt never builds a (T, V) logits tensor."""
    step = chunk if chunk > 0 else max(1, len(ids) - start)
    logits = None
    for a in range(start, len(ids), step):
        b = min(a + step, len(ids))
        # mask None: the model's own causal path (SDPA's is_causal; no dense (T, past + T) mask)
        logits = kvcache.forward(model, cache, torch.tensor(ids[a:b], dtype=torch.long), torch.arange(a, b), None,
                                 last_only=True)
    return logits[-1]


def reserve_caches(m: Models, st: DecodeState) -> None:
    """Preallocate both caches for the planned rows (no-op when unplanned or already allocated)."""
    if m.shared_kv and not isinstance(st.draft_cache, kvcache.SharedCache):
        st.draft_cache, st.draft_len = kvcache.SharedCache(st.target_cache), 0
    if m.kv_rows is not None:
        kvcache.reserve(st.target_cache, m.target, m.kv_rows[0], m.pool, "kv_target")
        if m.draft is not None and not m.shared_kv:
            kvcache.reserve(st.draft_cache, m.draft, m.kv_rows[1], m.pool, "kv_draft")


def prefill_passes(n_new: int, chunk: int) -> int:
    """Target passes `run_prompt` makes over n_new tokens in chunks of `chunk` (0 = one pass)."""
    return 0 if n_new <= 0 else (1 if chunk <= 0 else -(-n_new // chunk))


def prefill(m: Models, st: DecodeState, new_ids: list[int], cfg: GenerationConfig, gen, logprobs=None) -> int:
    """Run both models over the not-yet-cached tokens; returns the first generated token (its
    TokenLogprob appended to the list `logprobs` when cfg.logprobs is set and a list is given)."""
    reserve_caches(m, st)
    st.ids.extend(new_ids)
    st.prefill_streams = prefill_passes(len(st.ids) - st.target_len, m.pass_tokens)
    last = run_prompt(m.target, st.target_cache, st.ids, st.target_len, m.pass_tokens)
    st.target_len = len(st.ids)
    if m.draft is not None and cfg.method != "ar" and not m.shared_kv:   # shared KV: the target's rows serve
        run_prompt(m.draft, st.draft_cache, st.ids, st.draft_len, m.pass_tokens)
        st.draft_len = len(st.ids)
    tok = draw(st, last, cfg.sampling, gen)
    st.ids.append(tok)
    if logprobs is not None:
        logprobs.extend(logprobs_of(cfg, last[None], [0], [tok]) or [])
    return tok


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
    if st.grammar is not None and st.grammar.done:   # the grammar is complete: nothing more can follow
        return "stop"
    if produced >= cfg.max_new_tokens:
        return "length"
    if len(st.ids) >= m.ctx_limit:
        return "context"
    return None


def generate(
    m: Models, st: DecodeState, new_ids: list[int], cfg: GenerationConfig, gen: torch.Generator | None = None,
    step_fn: StepFn | None = None,
) -> Iterator[StepEvent]:
    """Prefill `new_ids` on top of `st`, then decode until EOS, max_new_tokens, the context end or,
    with `cfg.grammar`, the grammar's completion.

    `step_fn` runs one target pass; None = the core method `cfg.method` names (ar, specexec).
    """
    check_fits(m, st, new_ids)
    step_fn = step_fn or core_step(cfg.method)
    st.grammar = start_constraints(m, st, cfg, len(st.ids) + len(new_ids), step_fn)
    try:
        yield from decode(m, st, new_ids, cfg, gen, step_fn)
    finally:
        st.grammar = None


def start_constraints(m: Models, st: DecodeState, cfg: GenerationConfig, start: int, step_fn=None):
    """The call's constrain.GrammarRun (None without cfg.grammar), the grammar starting after
    st.ids[:start]; GrammarError when the grammar or the method cannot serve the request."""
    if (cfg.grammar is not None or cfg.logprobs is not None) and step_fn not in (None, ar_step, speculative_step):
        raise GrammarError(f"structured output and logprobs need --method specexec or ar (this run uses "
                           f"--method {cfg.method})")
    if cfg.logprobs is not None and cfg.logprobs < 0:
        raise GrammarError(f"logprobs must be >= 0 alternatives per token (got {cfg.logprobs})")
    if cfg.grammar is None:
        return None
    width = output_width(m.target, m.draft)   # the rows cover every column either model draws from
    return constrain.GrammarRun(compile_grammar(m.tokenizer, cfg.grammar, m.eos_ids, width), st, start)


def decode(m: Models, st: DecodeState, new_ids: list[int], cfg: GenerationConfig, gen, step_fn) -> Iterator[StepEvent]:
    """generate's loop: the prefill's event, then one event per `step_fn` pass."""
    gen = gen if gen is not None else torch.Generator().manual_seed(cfg.seed)
    st.noise = new_noise(gen)  # this call's coupled draws
    stream = TextStream(m.tokenizer)
    n_prompt = len(st.ids) + len(new_ids) - st.target_len
    t0 = time.perf_counter()
    first_lp: list[TokenLogprob] = []
    first = prefill(m, st, new_ids, cfg, gen, first_lp)
    t_prefill = time.perf_counter() - t0
    res, produced, pass_index = StepResult([first], 0, logprobs=first_lp if cfg.logprobs is not None else None), 0, 0
    moved = transfers.TransferCount()
    while True:
        produced += len(res.tokens)
        finish = finish_reason(m, st, res.tokens, produced, cfg)
        yield StepEvent(
            text=stream.feed_split(res.tokens, res.accepted), tokens=res.tokens, accepted=res.accepted,
            pass_index=pass_index, tree_size=res.tree_size, tree_depth=res.tree_depth,
            draft_seconds=res.draft_seconds, target_seconds=res.target_seconds,
            prefill_seconds=t_prefill, decode_seconds=time.perf_counter() - t0 - t_prefill,
            new_tokens=produced, prompt_tokens=n_prompt, finish=finish,
            host_transfers=moved.calls, host_transfer_bytes=moved.bytes,
            prefill_streams=st.prefill_streams if pass_index == 0 else 0, logprobs=res.logprobs,
        )  # fmt: skip
        if finish:
            return
        limit = min(cfg.max_new_tokens - produced, m.ctx_limit - len(st.ids))
        before = transfers.snapshot()
        res = step_fn(m, st, cfg, gen, limit)
        st.noise.forget(len(st.ids))
        moved = transfers.since(before)
        pass_index += 1
