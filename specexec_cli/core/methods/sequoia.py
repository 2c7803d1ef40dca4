"""Sequoia (arXiv 2402.12374): the static tree that maximises expected accepted tokens, by DP.

Contract:
- Acceptance vector a_1..a_K: a_k = probability that the rank-k sampled sibling is the one accepted,
  assumed the same at every node. A tree's expected tokens per pass is F(T) = Σ_{v in T} Π_{edges on
  root→v} a_rank (the root counts 1), and the DP maximises F over trees with `budget` non-root nodes,
  depth <= `max_depth` and siblings on contiguous ranks 1..k:
      c(n, d) = 1 + T_1(n-1, d)            best tree with at most n nodes (root included)
      T_k(n, d) = max(0, max_{1<=m<=n} a_k · c(m, d-1) + T_{k+1}(n-m, d)),   T_{K+1} = 0
  (each max-plus convolution is one vectorised (n × m) numpy op).
- `measure_acceptance` estimates a on a teacher-forced token sequence (two plain forwards, fresh
  caches): at T = 0 how often the target's argmax is the draft's rank-k token; at T > 0 a Monte-Carlo
  run of `common.choose_child` on K children sampled without replacement.
- `sequoia_step` is an engine StepFn: the vector is measured once per (pair, sampling), cached in
  memory and, when `--sequoia-profile FILE` exists, under its "sequoia_acceptance" key; the DP's tree
  is grown and verified by `static_tree.static_step`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from specexec_cli.core import kvcache
from specexec_cli.core.methods.common import MethodSettings, choose_child, sample_children
from specexec_cli.core.methods.static_tree import Template, static_step
from specexec_cli.core.sampling import SamplingParams, process_logits
from specexec_cli.core.tree import causal_mask

RANKS = 8  # K: sibling ranks measured and used by the DP
DRAWS = 8  # T > 0: Monte-Carlo draws of the multi-step rule per calibration position
MAX_DP_DEPTH = 32  # the DP's depth cap (deeper trees add ~nothing at measured acceptance rates)
CALIBRATION_TOKENS = 512  # most recent context tokens used to measure the vector
PROFILE_KEY = "sequoia_acceptance"
ACCEPT_FLOOR = 1e-3  # lower bound on each a_k, so a short calibration context never yields an empty tree
_VECTORS: dict[tuple, tuple[float, ...]] = {}  # (id(target), id(draft), sampling key) → vector


def _dp_tables(a: tuple[float, ...], n_max: int, max_depth: int):
    """c[d][n] for d <= max_depth, n <= n_max, and arg[d][k][n] = size given to the rank-k child."""
    K = len(a)
    c = np.zeros((max_depth + 1, n_max + 1))
    c[:, 1:] = 1.0  # any tree with >= 1 node has at least the root
    arg = np.zeros((max_depth + 1, K + 1, n_max + 1), dtype=np.int32)
    n_idx = np.arange(n_max + 1)[:, None]  # (N, 1) nodes available
    m_idx = np.arange(n_max + 1)[None, :]  # (1, N) nodes given to this child's subtree
    valid = (m_idx >= 1) & (m_idx <= n_idx)
    rest = np.clip(n_idx - m_idx, 0, None)
    for d in range(1, max_depth + 1):
        t_next = np.zeros(n_max + 1)  # T_{K+1} = 0
        for k in range(K, 0, -1):
            vals = np.where(valid, a[k - 1] * c[d - 1][m_idx] + t_next[rest], -np.inf)  # (N, N)
            best = vals.argmax(axis=1)
            gain = vals[np.arange(n_max + 1), best]
            take = gain > 0  # else: no rank-k child (and hence no later ranks)
            arg[d, k] = np.where(take, best, 0)
            t_next = np.where(take, gain, 0.0)
        c[d, 1:] = 1.0 + t_next[:-1]  # T_1(n - 1, d)
        if np.array_equal(c[d], c[d - 1]):  # converged: deeper caps change nothing
            c[d + 1 :], arg[d + 1 :] = c[d], arg[d]
            break
    return c, arg


@lru_cache(maxsize=32)
def optimal_tree(a: tuple[float, ...], budget: int, max_depth: int) -> tuple[Template, float]:
    """The DP's tree (≤ budget non-root nodes, depth ≤ max_depth) and its expected tokens per pass."""
    a = tuple(float(min(max(x, 0.0), 1.0)) for x in a)
    c, arg = _dp_tables(a, budget + 1, max_depth)
    parents: list[int] = [-1]

    def build(node: int, n: int, d: int) -> None:  # give `node` a subtree of n nodes, depth ≤ d
        rem, k = n - 1, 1
        while k <= len(a) and rem > 0 and d > 0:
            m = int(arg[d, k, rem])
            if m == 0:
                break
            parents.append(node)
            build(len(parents) - 1, m, d - 1)
            rem, k = rem - m, k + 1

    build(0, budget + 1, max_depth)
    return Template(tuple(parents)), float(c[max_depth, budget + 1])


def _teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """(n, V) logits of `model` over `ids` with a fresh cache."""
    cache = kvcache.new_cache()
    mask = causal_mask(0, len(ids), kvcache.model_dtype(model), model.device)
    return kvcache.forward(model, cache, torch.tensor(ids), torch.arange(len(ids)), mask).float().cpu()


def measure_acceptance(m, ids: list[int], params: SamplingParams) -> tuple[float, ...]:
    """Estimate a_1..a_K on the last CALIBRATION_TOKENS of `ids` (module docstring)."""
    ids = ids[-CALIBRATION_TOKENS:]
    p_logits, q_logits = _teacher_forced(m.target, ids), _teacher_forced(m.draft, ids)
    counts = np.zeros(RANKS)
    if params.greedy:
        top = torch.topk(q_logits, RANKS, dim=-1).indices  # (n, K) draft ranks
        hit = top == p_logits.argmax(-1, keepdim=True)  # (n, K)
        return tuple(float(x) for x in hit.float().mean(0))
    gen = torch.Generator().manual_seed(0)
    p_all, q_all = process_logits(p_logits, params), process_logits(q_logits, params)
    for p, q in zip(p_all, q_all):
        for _ in range(DRAWS):
            pick, _ = choose_child(p, q, sample_children(q, RANKS, gen), gen)
            if pick >= 0:
                counts[pick] += 1
    return tuple(float(x) for x in counts / (len(ids) * DRAWS))


def sampling_key(params: SamplingParams) -> str:
    t = 0.0 if params.greedy else params.temperature  # tiny temperatures are greedy
    return f"T={t:g},top_k={params.top_k},top_p={params.top_p:g}"


def acceptance_vector(m, ids: list[int], params: SamplingParams, profile: str | None) -> tuple[float, ...]:
    """Memory cache → profile JSON (if the file exists) → measure (and write back to the profile)."""
    key = (id(m.target), id(m.draft), sampling_key(params))
    if key in _VECTORS:
        return _VECTORS[key]
    path = Path(profile) if profile else None
    data = json.loads(path.read_text() or "{}") if path is not None and path.is_file() else None
    stored = (data or {}).get(PROFILE_KEY, {}).get(sampling_key(params))
    if stored:
        vec = tuple(float(x) for x in stored)
    else:
        vec = measure_acceptance(m, ids, params)
        if data is not None:
            data.setdefault(PROFILE_KEY, {})[sampling_key(params)] = [round(x, 5) for x in vec]
            path.write_text(json.dumps(data, indent=1) + "\n")
    _VECTORS[key] = vec
    return vec


def sequoia_step(m, st, cfg, gen, limit: int):
    vec = acceptance_vector(m, st.ids, cfg.sampling, MethodSettings.of(cfg).sequoia_profile)
    vec = tuple(max(x, ACCEPT_FLOOR) for x in vec)  # a never-seen rank still gets a (tiny) share
    tpl, _ = optimal_tree(vec, cfg.shape.budget, min(cfg.shape.max_depth, MAX_DP_DEPTH))
    return static_step(m, st, cfg, gen, limit, tpl)
