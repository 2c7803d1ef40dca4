"""Hardware-fitted draft budget: a chooser plus online acceptance and timing statistics.

Contract: `choose_budget(expected, t_draft, t_target, candidates)` is pure: the budget B maximising
E[tokens per pass](B) / (t_draft(B) + t_target(B + 1)), tokens/second (`lanes=k`: k requests sharing
each pass). `BudgetTuner.drive(models, state, ids, cfg)` wraps `engine.generate`, observes every pass
and re-tunes budget and depth every `retune_every` passes; the engine reads `cfg.shape` from a
`LiveConfig` at each step. `split(k)` and `observe(ev, budget, pass_tokens)` serve a forest.

Models (corrected online): E(B) = 1 + a·log2(1 + B), capped at depth + 1, `a` a least-squares fit
through the origin regularised towards PRIOR_A with the weight of PRIOR_PASSES passes (budgets seen
MIN_OBSERVED times use their mean); t_target and t_draft from timing.py's `TimingModel`, rescaled
by the observed/predicted ratio (observed points replace it). Each shape carries `min_prob`. Plain
decoding (budget PLAIN) competes from the PLAIN_AFTER-th speculative pass on; a fallback to it is a
trial, judged again once PLAIN_TRIAL plain passes are timed, and the best tree is probed again every
PROBE_EVERY plain passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import fields, replace

from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import GenerationConfig
from specexec_cli.core.timing import TimingModel, draft_steps

PRIOR_A = 0.5  # prior tokens-per-pass slope per doubling of the budget
PRIOR_PASSES = 8.0  # weight of the prior, in passes
MIN_OBSERVED = 12  # passes at one budget before its empirical mean replaces the fitted curve
PLAIN = 0  # the budget of plain decoding: the engine's step without a tree (no draft forward)
PLAIN_AFTER = 4  # speculative passes measured before plain decoding competes (each may cost several steps)
PROBE_EVERY = 64  # plain passes after which the tuner tries its best tree again (the reply may have changed)
PLAIN_TRIAL = 3  # plain passes timed before a fallback to plain decoding is judged again on measurements
MAX_MIN_PROB = 0.8  # the highest min_prob the tuner sets: a tree always keeps its draft's likeliest chains


def candidate_budgets(max_budget: int) -> list[int]:
    """B = 2^k − 1, so the verified tree (B + root) is exactly a measured power-of-two n."""
    out, n = [], 2
    while n - 1 <= max_budget:
        out.append(n - 1)
        n *= 2
    return out or [1]


def choose_budget(
    expected: Callable[[int], float],
    t_draft: Callable[[int], float],
    t_target: Callable[[int], float],
    candidates: Iterable[int],
    lanes: int = 1,
) -> tuple[int, float]:
    """(b, aggregate tok/s): the per-request budget maximising lanes·E(b) / (lanes·t_draft(b) +
    t_target(lanes·(b + 1))) when `lanes` requests share each pass; ties go to the smaller b."""
    best, best_rate = None, -1.0
    for b in sorted(candidates):
        secs = lanes * t_draft(b) + t_target(lanes * (b + 1))
        rate = lanes * expected(b) / secs if secs > 0 else 0.0
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = b, rate
    if best is None:
        raise ValueError("choose_budget needs at least one candidate budget")
    return best, best_rate


def n_bin(n: int) -> int:
    """Round a token count up to a power of two (the profile's measurement grid)."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def tally(store: dict[int, list[float]], key: int, value: float) -> int:
    """Add one observation to store[key] = [count, sum]; returns the new count."""
    rec = store.setdefault(key, [0, 0.0])
    rec[0], rec[1] = rec[0] + 1, rec[1] + value
    return rec[0]


class ShapeHolder:
    """The mutable cell a LiveConfig reads its tree shape from."""

    def __init__(self, shape: TreeShape):
        self.shape = shape


class LiveConfig(GenerationConfig):
    """A GenerationConfig whose `shape` is read from a ShapeHolder at every access (`replace` works:
    __init__ assigns `shape` through the setter, which makes a fresh holder)."""

    @property
    def shape(self) -> TreeShape:  # type: ignore[override]
        return self._holder.shape

    @shape.setter
    def shape(self, value: TreeShape) -> None:
        object.__setattr__(self, "_holder", ShapeHolder(value))

    @classmethod
    def wrap(cls, cfg: GenerationConfig, holder: ShapeHolder) -> LiveConfig:
        live = cls(**{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init})
        object.__setattr__(live, "_holder", holder)
        return live


class BudgetTuner:
    """Online statistics → budget/depth; `drive` wraps engine.generate (see module docstring)."""

    def __init__(self, timing: TimingModel, shape: TreeShape, max_budget: int = 1024, retune_every: int = 8):
        self.timing = timing
        self.max_budget = max_budget
        self.depth_cap = shape.max_depth  # the user's --max-depth is an upper bound
        self.retune_every = retune_every
        self.holder = ShapeHolder(shape)
        self.passes = 0
        self.sxy = self.sxx = 0.0  # least-squares sums for the slope a
        self.by_budget: dict[int, list[float]] = {}  # budget → [passes, tokens]
        self.accepted_hist: dict[int, int] = {}  # accepted draft tokens per pass → count
        self.target_obs: dict[int, list[float]] = {}  # n-bin → [count, seconds]
        self.draft_obs: dict[int, list[float]] = {}  # budget → [count, seconds]
        self.plain_passes = 0  # plain passes observed (budget PLAIN, or no room for a tree)
        self.retune()

    @property
    def shape(self) -> TreeShape:
        return self.holder.shape

    def expected_tokens(self, budget: int) -> float:
        obs = self.by_budget.get(budget)
        if obs and obs[0] >= MIN_OBSERVED:
            return obs[1] / obs[0]
        # the prior weighs as much as PRIOR_PASSES passes at the observed budgets (B = 64 before data)
        lam = PRIOR_PASSES * (self.sxx / self.passes if self.passes else math.log2(1 + 64) ** 2)
        a = (self.sxy + lam * PRIOR_A) / (self.sxx + lam)
        return min(1.0 + a * math.log2(1 + budget), self.depth_cap + 1.0)

    def _seconds(self, obs: dict[int, list[float]], key: int, x: int, model: Callable[[int], float]) -> float:
        """The mean of obs[key] once 3 passes are timed, else model(x) rescaled to this machine/moment by
        the geometric mean of the observed/predicted seconds."""
        rec = obs.get(key)
        if rec and rec[0] >= 3:
            return rec[1] / rec[0]
        logs = [(c, math.log(max(s / c, 1e-9) / max(model(k), 1e-12))) for k, (c, s) in obs.items() if c]
        total = sum(c for c, _ in logs)
        return model(x) * (math.exp(sum(c * v for c, v in logs) / total) if total else 1.0)

    def t_target(self, n: int) -> float:
        return self._seconds(self.target_obs, n_bin(n), n, self.timing.t_target)

    def t_draft(self, budget: int) -> float:
        if budget == PLAIN:
            return 0.0
        return self._seconds(self.draft_obs, budget, budget, lambda b: self.timing.t_draft(b, self.shape.max_beams))

    def choose_depth(self, budget: int) -> int:
        """1.5 x the smallest d with P(accepted ≥ d) < 2 % (doubled when ≥ 5 % of passes hit the current
        depth: censored), within [2, --max-depth]; --max-depth before MIN_OBSERVED passes."""
        total = sum(self.accepted_hist.values())
        if total < MIN_OBSERVED:
            guess = self.depth_cap
        else:
            tail, guess = total, 1
            for d in range(0, max(self.accepted_hist) + 2):
                tail -= self.accepted_hist.get(d - 1, 0)
                if tail / total < 0.02:
                    guess = d
                    break
            guess = math.ceil(1.5 * guess) + 1
            cur = self.shape.max_depth
            if sum(v for k, v in self.accepted_hist.items() if k >= cur) / total >= 0.05:
                guess = max(guess, 2 * cur)
        return int(max(2, min(self.depth_cap, guess, budget)))

    def retune(self, plain: bool = True) -> None:
        """The budget with the most tokens/s on the live statistics (`plain` False: the best tree, probed)."""
        cands = candidate_budgets(self.max_budget)
        if plain and self.passes >= PLAIN_AFTER:
            cands = [PLAIN, *cands]
        budget, _ = choose_budget(self.expected_tokens, self.t_draft, self.t_target, cands)
        self.holder.shape = self._shape(budget)

    def _shape(self, budget: int) -> TreeShape:
        """The tree shape of `budget`: its depth, and the probability below which a node is not expanded."""
        return replace(self.shape, budget=budget, max_depth=self.choose_depth(budget), min_prob=self.min_prob(budget))

    def min_prob(self, budget: int) -> float:
        """Expanding a node of probability p adds at most ~p tokens for one draft forward: it pays where
        p > t_step / t_token at this budget's modelled speed (at most MAX_MIN_PROB)."""
        if budget == PLAIN:
            return 0.0
        t_draft = self.t_draft(budget)
        t_token = (t_draft + self.t_target(budget + 1)) / max(self.expected_tokens(budget), 1.0)
        return min(MAX_MIN_PROB, t_draft / draft_steps(budget, self.shape.max_beams) / t_token) if t_token > 0 else 0.0

    def split(self, lanes: int) -> TreeShape:
        """Each request's tree shape when `lanes` requests share a forest pass (within the planned budget)."""
        if lanes <= 1:
            return self.shape
        cap = max(1, (self.max_budget + 1) // lanes - 1)
        b, _ = choose_budget(self.expected_tokens, self.t_draft, self.t_target, candidate_budgets(cap), lanes)
        return self._shape(b)

    def observe(self, ev, budget: int | None = None, pass_tokens: int | None = None) -> None:
        """Feed one StepEvent (the prefill's is skipped). `budget`: its step's tree budget (default the
        current one); `pass_tokens`: the tokens its pass verified (default its own tree + root)."""
        if ev.pass_index == 0:
            return
        if ev.tree_size == 0:  # a plain pass: its seconds are t_target(1)
            timed = tally(self.target_obs, 1, ev.target_seconds)
            self.plain_passes += 1
            if self.shape.budget == PLAIN and timed == PLAIN_TRIAL and self.passes >= PLAIN_AFTER:
                self.retune()  # plain's own time measured now: the trial fallback judged again
            elif self.shape.budget == PLAIN and self.plain_passes % PROBE_EVERY == 0:
                self.retune(plain=False)
            return
        b, tokens = budget or self.shape.budget, len(ev.tokens)
        self.passes += 1
        x = math.log2(1 + b)
        self.sxy += x * (tokens - 1)
        self.sxx += x * x
        tally(self.by_budget, b, tokens)
        self.accepted_hist[ev.accepted] = self.accepted_hist.get(ev.accepted, 0) + 1
        tally(self.target_obs, n_bin(pass_tokens or ev.tree_size + 1), ev.target_seconds)
        tally(self.draft_obs, b, ev.draft_seconds)
        if self.passes % self.retune_every == 0 or self.passes == PLAIN_AFTER:
            self.retune()

    def drive(self, models, state, ids, cfg: GenerationConfig, gen=None):
        """engine.generate with a live shape; yields the engine's events unchanged."""
        from specexec_cli.core.methods import generate

        for ev in generate(models, state, ids, LiveConfig.wrap(cfg, self.holder), gen):
            self.observe(ev)
            yield ev


def make_tuner(profile: dict | None, shape: TreeShape, on_cuda: bool, plan: dict | None = None) -> BudgetTuner:
    """A tuner on a profile's timings, else the memory plan's (`plan`: MemoryPlan.to_json(), capped at
    its largest budget), else the fallback prior."""
    planned = TimingModel.from_plan(plan)
    timing = TimingModel.from_profile(profile, (plan or {}).get("draft_key"), planned) if profile else None
    timing = timing or planned or TimingModel.prior()
    if timing.source == "profile":
        cap = max(timing.target_points) - 1
    elif planned is not None:
        cap = max(planned.draft_points)
    else:
        cap = 4095 if on_cuda else 1023
    return BudgetTuner(timing, shape, max_budget=max(1, cap))


def tuner_for(models, shape: TreeShape, profile: dict | None) -> BudgetTuner:
    """`make_tuner` for loaded `models`: their device and their plan's speed model."""
    on_cuda = getattr(getattr(models.target, "device", None), "type", None) == "cuda"
    return make_tuner(profile, shape, on_cuda, getattr(models, "plan_json", None))
