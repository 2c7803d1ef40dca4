"""The decoding loop: prefill, then one speculative (or plain) step per target pass, as events.

Contract: `generate(models, state, prompt_ids, config)` yields one `StepEvent` for the prefill (with
its first token) and one per target pass, and never prints. `DecodeState` keeps the committed tokens
and both caches, so a chat prefills only its new turn. Between steps the target cache holds ids[:-1]
(the last token is the next root) and the draft cache ids[:draft_len], draft_len < len(ids). With
`Models.shared_kv` the draft's cache is a view of the target's (kvcache.SharedCache): no draft prefill.

A `Pass` is a step as a generator: it yields the `ForwardJob` of its target pass, is sent that pass's
logits and returns its `StepResult`. A `Request` is one generate call: `begin()` gives its next job,
`end(logits)` its `StepEvent` (None while a prefill has chunks to go). `generate` runs one Request
alone; core/forest.py runs many in one shared pass. A StepFn that runs its own passes is a Pass that
asks for none (`whole`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace

import torch

from offload import ForwardJob
from specexec_cli.core import calibrate, constrain, kvcache, transfers
from specexec_cli.core.draft import DraftContext, Scoring, TreeShape, grow_tree
from specexec_cli.core.grammar import GrammarError, compile_grammar, output_width
from specexec_cli.core.logprobs import token_logprobs
from specexec_cli.core.ngram import NgramIndex
from specexec_cli.core.sampling import RACE, PositionNoise, SamplingParams, race_choice
from specexec_cli.core.state import (
    DecodeState, GenerationConfig, Models, StepEvent, StepFn, StepResult, add_prompt, check_fits,
    finish_reason,
)
from specexec_cli.core.text import TextStream
from specexec_cli.core.tree import causal_mask, subtree, top_budget
from specexec_cli.core.verify import accept_tree, verify_inputs
from specexec_cli.errors import SpecxError

Pass = Generator[ForwardJob, torch.Tensor, StepResult]   # yields its target pass, is sent the logits


def new_noise(gen: torch.Generator) -> PositionNoise:
    """Coupled-draw noise keyed by one draw of `gen` (successive calls get unrelated noise)."""
    return PositionNoise(int(torch.randint(0, 2**62, (1,), generator=gen)))


def draw(st: DecodeState, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The target's token after st.ids from its (V,) logits: sampling.py's race (argmax at T = 0), masked
    by the grammar's committed state; one counted copy."""
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


def forward_job(model, job: ForwardJob) -> torch.Tensor:
    """One job's pass alone: kvcache.forward on its staged inputs (no copy: they are uploaded)."""
    return kvcache.forward(model, job.cache, job.ids, job.positions, job.mask, last_only=job.last_only)


def run_alone(model, steps: Pass) -> StepResult:
    """Drive a Pass by itself: every target pass it asks for runs at once."""
    try:
        job = next(steps)
        while True:
            job = steps.send(forward_job(model, job))
    except StopIteration as done:
        return done.value


def ar_pass(m: Models, st: DecodeState, cfg: GenerationConfig, gen: torch.Generator, limit: int) -> Pass:
    """Plain autoregressive decoding: one target pass over the root yields one token."""
    t0 = time.perf_counter()
    root, pos = kvcache.stage(m.target, torch.tensor(st.ids[-1:], dtype=torch.long), torch.tensor([len(st.ids) - 1]))
    mask = causal_mask(st.target_len, 1, kvcache.model_dtype(m.target), m.target.device)
    logits = yield ForwardJob(root, pos, mask, st.target_cache)
    tok = draw(st, logits[-1], cfg.sampling, gen)
    st.target_len += 1
    st.ids.append(tok)
    return StepResult([tok], 0, target_seconds=time.perf_counter() - t0,
                      logprobs=logprobs_of(cfg, logits[-1:], [0], [tok]))


def ar_step(m: Models, st: DecodeState, cfg: GenerationConfig, gen: torch.Generator, limit: int) -> StepResult:
    return run_alone(m.target, ar_pass(m, st, cfg, gen, limit))


def commit_tree(st: DecodeState, tree, vt, acc, n_pending: int) -> None:
    """Keep the accepted path in both caches (compacted in place) and extend st.ids: the target's holds
    root + accepted nodes, the draft's root + the accepted nodes it already ran."""
    in_cache = acc.path if acc.bonus else acc.path[:-1]
    keep = torch.tensor([0] + in_cache, dtype=torch.long)
    kvcache.compact(st.target_cache, st.target_len, st.target_len + keep)
    st.target_len += int(keep.numel())
    if not follow_target(st):   # a shared draft cache's committed rows are the target's
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
    extra = cfg.extra or {}
    mode = extra.get("scores", DEFAULT_SCORES)
    if mode not in ("calibrated+ngram", "calibrated", "draft"):
        raise SpecxError(f"scores must be calibrated+ngram, calibrated or draft (got {mode!r})")
    if mode == "draft":
        return None
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
    """Where the draft starts a tree: its cached rows and the committed tokens it has not run (last = root)."""
    follow_target(st)
    return DraftContext(n_cached=st.draft_len, pending=st.ids[st.draft_len :], root_pos=len(st.ids) - 1)


def default_grow(m: Models, st: DecodeState, ctx: DraftContext, shape: TreeShape, params: SamplingParams, scoring=None):
    return grow_tree(m.draft, st.draft_cache, ctx, shape, params, scoring, grammar=st.grammar)


def speculative_pass(m: Models, st: DecodeState, cfg: GenerationConfig, gen: torch.Generator, limit: int,
                     grow=default_grow) -> Pass:
    """SpecExec: grow a draft tree, verify it in one target pass, accept, trim both caches (no room for
    a tree: a plain step). `grow(m, st, ctx, shape, sampling, scoring) -> Tree` swaps the growth stage."""
    n = len(st.ids)
    depth = min(cfg.shape.max_depth, limit - 1, m.ctx_limit - n - 1)  # the bonus needs one slot
    if depth < 1 or cfg.shape.budget < 1:
        return (yield from ar_pass(m, st, cfg, gen, limit))
    shape = replace(cfg.shape, max_depth=depth)
    # 1) propose: the draft grows the tree; the target checks the best `budget` nodes (ancestor-closed)
    t0 = time.perf_counter()
    ctx = draft_context(st)
    st.noise = st.noise or new_noise(gen)
    scoring = tree_scoring(m, st, cfg) if grow is default_grow else None
    tree = grow(m, st, ctx, shape, cfg.sampling, scoring)
    vt = subtree(tree, top_budget(tree.logp, shape.budget))
    bits, ends = [], frozenset()
    if st.grammar is not None and grow is default_grow:   # every verified node's mask (the draft's are reused)
        ids = vt.draft_ids.tolist()
        bits, ends = [st.grammar.bitmask(ids)], frozenset(i for i, s in enumerate(st.grammar.stopped(ids)) if s)
    t1 = time.perf_counter()
    # 2) verify: one target pass over root + tree, tokens at root_pos + depth (the masks ride in its upload)
    ids, positions, mask, *bits = verify_inputs(m.target, vt, st.target_len, n - 1, *bits)
    logits = yield ForwardJob(ids, positions, mask, st.target_cache)
    # 3) accept: every node's token on the device, one (n,) copy, then the walk down the tree
    acc = accept_tree(vt, logits, cfg.sampling, st.noise, n, m.eos_ids, limit, depth=positions - (n - 1),
                      bits=bits[0] if bits else None, ends=ends)
    lps = logprobs_of(cfg, logits, ([0] + acc.path)[: len(acc.tokens)], acc.tokens)  # row of each token's draw
    if scoring is not None and scoring.cal is not None:  # learn which features the target accepts
        calibrate.observe_pass(scoring.cal, tree, vt.draft_ids[acc.path].tolist(), acc.tokens)
    t2 = time.perf_counter()
    # 4) commit: trim both caches to the accepted path; the last emitted token becomes the next root
    commit_tree(st, tree, vt, acc, len(ctx.pending))
    t3 = time.perf_counter()
    return StepResult(tokens=acc.tokens, accepted=len(acc.path), tree_size=vt.size - 1,
                      tree_depth=int(vt.depth.max()), draft_seconds=t1 - t0 + (t3 - t2), target_seconds=t2 - t1,
                      logprobs=lps)


def speculative_step(m: Models, st: DecodeState, cfg: GenerationConfig, gen: torch.Generator, limit: int,
                     grow=default_grow) -> StepResult:
    return run_alone(m.target, speculative_pass(m, st, cfg, gen, limit, grow))


STEP_METHODS: dict[str, StepFn] = {"ar": ar_step, "specexec": speculative_step}  # core methods only
PASSES: dict[StepFn, Callable[..., Pass]] = {ar_step: ar_pass, speculative_step: speculative_pass}


def core_step(method: str) -> StepFn:
    """The step of a core method; the others live in specexec_cli.core.methods (which imports this module)."""
    if method not in STEP_METHODS:
        raise SpecxError(
            f"method {method!r} is not a core engine method; use specexec_cli.core.methods.generate "
            "(or pass step_fn=specexec_cli.core.methods.step_for(name))"
        )
    return STEP_METHODS[method]


def whole(step_fn: StepFn) -> Callable[..., Pass]:
    """A StepFn that runs its own target passes as a Pass that asks for none."""
    def steps(m, st, cfg, gen, limit):
        yield from ()
        return step_fn(m, st, cfg, gen, limit)
    return steps


def prompt_chunks(model, cache, ids: list[int], start: int, chunk: int) -> Iterator[tuple[int, ForwardJob]]:
    """ids[start:] as causal passes of at most `chunk` tokens (0 = one pass): (end, staged job) each.
    The jobs keep the last token's logits only, so a long prompt never builds a (T, V) logits tensor."""
    step = chunk if chunk > 0 else max(1, len(ids) - start)
    for a in range(start, len(ids), step):
        b = min(a + step, len(ids))
        tokens, positions = kvcache.stage(model, torch.tensor(ids[a:b], dtype=torch.long), torch.arange(a, b))
        # mask None: the model's own causal path (SDPA's is_causal; no dense (T, past + T) mask)
        yield b, ForwardJob(tokens, positions, None, cache, last_only=True)


def run_prompt(model, cache, ids: list[int], start: int, chunk: int) -> torch.Tensor:
    """Feed ids[start:] alone in `prompt_chunks`; returns the (V,) logits of the last token."""
    for _, job in prompt_chunks(model, cache, ids, start, chunk):
        logits = forward_job(model, job)
    return logits[-1]


def prefill_pass(m: Models, st: DecodeState, cfg: GenerationConfig, gen) -> Pass:
    """Both models over the not-yet-cached tokens (one target pass per chunk) -> the first new token."""
    for end, job in prompt_chunks(m.target, st.target_cache, st.ids, st.target_len, m.pass_tokens):
        logits = yield job
        st.target_len = end
    if m.draft is not None and cfg.method != "ar" and not m.shared_kv:   # shared KV: the target's rows serve
        run_prompt(m.draft, st.draft_cache, st.ids, st.draft_len, m.pass_tokens)
        st.draft_len = len(st.ids)
    tok = draw(st, logits[-1], cfg.sampling, gen)
    st.ids.append(tok)
    return StepResult([tok], 0, logprobs=logprobs_of(cfg, logits[-1:], [0], [tok]))


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


class Request:
    """One generate call as a step machine (module docstring): the prefill, then one step per pass."""

    def __init__(self, m: Models, st: DecodeState, new_ids: list[int], cfg: GenerationConfig,
                 gen: torch.Generator | None = None, step_fn: StepFn | None = None):
        check_fits(m, st, new_ids)
        step_fn = step_fn or core_step(cfg.method)
        st.grammar = start_constraints(m, st, cfg, len(st.ids) + len(new_ids), step_fn)
        self.m, self.st, self.cfg, self.step = m, st, cfg, PASSES.get(step_fn) or whole(step_fn)
        self.gen = gen if gen is not None else torch.Generator().manual_seed(cfg.seed)
        st.noise = new_noise(self.gen)  # this call's coupled draws
        self.stream, self.n_prompt = TextStream(m.tokenizer), len(st.ids) + len(new_ids) - st.target_len
        self.t0, self.t_prefill = time.perf_counter(), 0.0
        add_prompt(m, st, new_ids)
        self.prefilling, self.produced, self.pass_index = True, 0, 0
        self.passes = 0                  # target passes it took part in (prefill chunks included)
        self.finish: str | None = None   # set with the last event
        self.steps: Pass | None = None   # the step in flight, the job it waits for, then its result
        self.job: ForwardJob | None = None
        self.result: StepResult | None = None
        self.own, self.moved = 0.0, transfers.TransferCount()   # the step's own seconds and copies

    def begin(self, shape: TreeShape | None = None) -> ForwardJob | None:
        """The job of the next target pass (`shape`: its tree shape, None = the config's); None when
        the step ran its own passes."""
        t, before = time.perf_counter(), transfers.snapshot()
        if self.steps is None:   # a new step: the prefill, or a decoding step within the limit
            m, st, cfg = self.m, self.st, self.cfg if shape is None else replace(self.cfg, shape=shape)
            limit = min(cfg.max_new_tokens - self.produced, m.ctx_limit - len(st.ids))
            self.own, self.moved = 0.0, transfers.TransferCount()
            self.steps = prefill_pass(m, st, cfg, self.gen) if self.prefilling else self.step(m, st, cfg, self.gen, limit)
            self._send(None)
        self._spent(t, before)
        return self.job

    def end(self, logits: torch.Tensor | None = None, seconds: float | None = None) -> StepEvent | None:
        """Accept and commit the pass's `logits` -> the StepEvent (None while a prefill has chunks to
        go). `seconds`: a shared pass's wall time, the step's target time (its draft time is its own)."""
        t, before = time.perf_counter(), transfers.snapshot()
        if self.job is not None:
            self.passes += 1
            self._send(logits)
        self._spent(t, before)
        if self.job is not None:
            return None
        res, first = self.result, self.prefilling and not self.produced   # first: this call's prefill
        self.steps, self.prefilling = None, False
        if first:
            self.t_prefill = time.perf_counter() - self.t0
        else:   # a decoding step (or a resumed request's prefill, which stands for one)
            self.st.noise.forget(len(self.st.ids))
            self.pass_index += 1
            if seconds is not None:
                res.target_seconds, res.draft_seconds = seconds, self.own if res.draft_seconds else 0.0
        return self._event(res, self.moved if not first else transfers.TransferCount())

    def _send(self, logits: torch.Tensor | None) -> None:
        try:
            self.job = self.steps.send(logits)   # send(None) starts a fresh step
        except StopIteration as done:
            self.job, self.result = None, done.value

    def _spent(self, t: float, before: transfers.TransferCount) -> None:
        moved = transfers.since(before)
        self.own += time.perf_counter() - t
        self.moved = transfers.TransferCount(self.moved.calls + moved.calls, self.moved.bytes + moved.bytes)

    def _event(self, res: StepResult, moved: transfers.TransferCount) -> StepEvent:
        self.produced += len(res.tokens)
        self.finish = finish_reason(self.m, self.st, res.tokens, self.produced, self.cfg)
        return StepEvent(
            text=self.stream.feed_split(res.tokens, res.accepted), tokens=res.tokens, accepted=res.accepted,
            pass_index=self.pass_index, tree_size=res.tree_size, tree_depth=res.tree_depth,
            draft_seconds=res.draft_seconds, target_seconds=res.target_seconds,
            prefill_seconds=self.t_prefill, decode_seconds=time.perf_counter() - self.t0 - self.t_prefill,
            new_tokens=self.produced, prompt_tokens=self.n_prompt, finish=self.finish,
            host_transfers=moved.calls, host_transfer_bytes=moved.bytes,
            prefill_streams=self.st.prefill_streams if self.pass_index == 0 else 0, logprobs=res.logprobs,
        )


def generate(
    m: Models, st: DecodeState, new_ids: list[int], cfg: GenerationConfig, gen: torch.Generator | None = None,
    step_fn: StepFn | None = None,
) -> Iterator[StepEvent]:
    """Prefill `new_ids` on top of `st`, then decode until EOS, max_new_tokens, the context end or the
    grammar's completion. `step_fn`: one target pass; None = the core method `cfg.method` names."""
    try:
        req = Request(m, st, new_ids, cfg, gen, step_fn)
        while req.finish is None:
            job = req.begin()
            ev = req.end(None if job is None else forward_job(m.target, job))
            if ev is not None:
                yield ev
    finally:
        st.grammar = None
