"""A prompt cache of several conversations: KV snapshots in host RAM, matched by longest token prefix.

Contract: `PromptCache(capacity)` keeps `Snapshot`s of a `DecodeState` (committed ids and host copies
of both caches' rows; pinned on CUDA when `pin`); the device caches stay the one live entry. Before
each request `ChatSession.prefill_ids` calls `prepare(state, full_ids, models)`, which restores the
snapshot sharing the longest prefix when it reuses more rows than the live state, else saves the
live state when the request would discard at least `min_tokens` of its rows (`keep`; `save=False`:
restore only, serve's scheduler decides). `copy_prefix` copies one live state's first rows into
another's (serve's sequences). Restores and copies are bit-exact; bytes are counted exactly.

Admission and eviction (so an active conversation survives the title/tag/follow-up requests chat
front ends send after every reply): snapshots under `min_tokens` rows are not kept; one that extends
another's rows (or the entry the live state came from) replaces it; one already covered is not kept.
Room is made least recently used first, except PROTECTED entries, used within `protect_requests`
requests and either longer than the newcomer or continued (restored by a later request; an extension
inherits that). If evicting every unprotected entry is not enough, the newcomer is refused.
`stats` counts hits, saves, evictions, refusals.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

import psutil
import torch

from specexec_cli.core import kvcache

PROTECT_REQUESTS = 8  # requests during which a longer, recently used entry cannot be evicted by a shorter one
MIN_TOKENS = 16  # snapshots shorter than this are not kept


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (blocks compared in C, only the differing one walked)."""
    n, i, step = min(len(a), len(b)), 0, 512
    while i < n and a[i : i + step] == b[i : i + step]:
        i += step
    for j in range(i, min(i + step, n)):
        if a[j] != b[j]:
            return j
    return n


def reusable(full: list[int], held) -> int:
    """Rows of `held` (DecodeState or Snapshot) a request for `full` reuses; its last token is always prefilled."""
    return max(0, min(common_prefix(full, held.ids), held.target_len, len(full) - 1))


@dataclass
class Snapshot:
    """A DecodeState's committed ids and host copies of both caches' rows."""

    ids: list[int]  # the committed ids (the last one has no target row: it is the next root)
    target_len: int  # target rows saved: they hold ids[:target_len]
    draft_len: int  # draft rows saved (0 with no draft cache of its own, e.g. a self-draft's shared KV)
    target: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each (1, kv_heads, target_len, head_dim)
    draft: list[tuple[torch.Tensor, torch.Tensor]]  # per draft layer, (1, kv_heads, draft_len, head_dim)
    nbytes: int  # host bytes of all those tensors
    last_used: int = 0  # the cache's request clock when it was last saved or restored
    continued: int = 0  # times a request restored it (or the snapshots it extends): > 0 = a conversation


@dataclass
class CacheStats:
    """The counters /metrics shows as prompt_cache_<field>_total."""

    requests: int = 0  # prepare() calls
    hits: int = 0  # requests that restored a snapshot
    restored_tokens: int = 0  # rows those restores brought back
    saves: int = 0  # snapshots kept
    refused: int = 0  # snapshots not kept (too short, too large, or no room without evicting a protected one)
    evictions: int = 0  # snapshots dropped to make room (superseded ones not counted)


@dataclass
class PromptCache:
    capacity: int  # host bytes the snapshots may take
    pin: bool = False  # pinned host memory (CUDA: faster, async copies)
    protect_requests: int = PROTECT_REQUESTS
    min_tokens: int = MIN_TOKENS
    entries: list[Snapshot] = field(default_factory=list)
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self):
        self.clock = 0  # requests seen (prepare calls)
        self.sources: dict[int, Snapshot] = {}  # id(state) -> the entry that state was last restored from
        self.lock = threading.Lock()  # /metrics reads while the worker writes

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    # -- per request ----------------------------------------------------------------------------
    def prepare(self, st, full: list[int], models, save: bool = True) -> int:
        """Make `st` the best start for a request for `full`; returns rows restored (module docstring)."""
        self.clock += 1
        self.stats.requests += 1
        live = reusable(full, st)
        best = max(self.entries, key=lambda e: reusable(full, e), default=None)
        rows = reusable(full, best) if best is not None else 0
        if rows >= live + self.min_tokens:  # worth a copy: it saves at least min_tokens of prefill
            if save:
                self.save(st, keep=best)
            restore(best, st, models, rows)
            best.last_used, self.sources[id(st)] = self.clock, best
            best.continued += 1
            self.stats.hits += 1
            self.stats.restored_tokens += rows
            return rows
        if save:
            self.keep(st, full)
        return 0

    def keep(self, st, full: list[int]) -> bool:
        """Save `st` when a request for `full` would rewind it past at least `min_tokens` rows."""
        kept = min(common_prefix(full, st.ids), len(full) - 1)
        return st.target_len - kept >= self.min_tokens and self.save(st)

    def covered(self, st) -> int:
        """How many of `st`'s first rows some entry holds (a restore would bring them back)."""
        return max((min(common_prefix(e.ids, st.ids), e.target_len, st.target_len) for e in self.entries), default=0)

    # -- entries --------------------------------------------------------------------------------
    def save(self, st, keep: Snapshot | None = None) -> bool:
        """Snapshot `st` if the policy admits it (True: kept or covered); `keep` must survive."""
        n = st.target_len
        if n < self.min_tokens:
            return self._refuse()
        ids = list(st.ids)
        for e in self.entries:  # already covered
            if e.target_len >= n and common_prefix(e.ids, ids) >= n:
                e.last_used = self.clock
                return True
        draft_len = st.draft_len if _own_rows(st.draft_cache) else 0
        nbytes = _rows_bytes(st.target_cache, n) + _rows_bytes(st.draft_cache, draft_len)
        stale = [e for e in self.entries if e is not keep and self._superseded(e, ids, n, st)]
        room = self.capacity - sum(e.nbytes for e in self.entries if e not in stale)
        victims = []
        for e in sorted((e for e in self.entries if e not in stale), key=lambda e: e.last_used):
            if room >= nbytes:
                break
            recent = self.clock - e.last_used < self.protect_requests
            if e is keep or (recent and (e.target_len > n or e.continued)):
                continue  # a longer entry or a conversation, in use: protected
            victims.append(e)
            room += e.nbytes
        if room < nbytes:
            return self._refuse()
        snap = Snapshot(
            ids,
            n,
            draft_len,
            _host_rows(st.target_cache, n, self.pin),
            _host_rows(st.draft_cache, draft_len, self.pin),
            nbytes,
            self.clock,
            max((e.continued for e in stale), default=0),
        )
        with self.lock:
            self.entries = [e for e in self.entries if e not in stale and e not in victims] + [snap]
        gone = [k for k, e in self.sources.items() if any(e is x for x in (*stale, *victims))]
        for k in gone:
            del self.sources[k]
        self.stats.saves += 1
        self.stats.evictions += len(victims)
        return True

    def _superseded(self, e: Snapshot, ids: list[int], n: int, st=None) -> bool:
        """`e`'s rows are a prefix of the new snapshot's, or `e` is the live state's source and the
        state still holds every row reused from it (its tail is replaced by the new tokenization)."""
        shared = common_prefix(e.ids, ids)
        if e.target_len <= n and shared >= e.target_len:
            return True
        return e is self.sources.get(id(st)) and shared >= min(n, e.target_len) - self.min_tokens

    def _refuse(self) -> bool:
        self.stats.refused += 1
        return False

    def clear(self) -> None:
        with self.lock:
            self.entries, self.sources = [], {}

    def metrics(self) -> dict:
        """Counters and gauges for /metrics (names without the specx_ prefix)."""
        with self.lock:
            totals = {f"{k}_total": v for k, v in asdict(self.stats).items()}
            gauges = dict(entries=len(self.entries), bytes=self.nbytes, capacity_bytes=self.capacity)
            return {f"prompt_cache_{k}": v for k, v in (totals | gauges).items()}


# -- cache rows <-> host ---------------------------------------------------------------------------
def _own_rows(cache) -> bool:
    """A cache whose rows are its own (not a self-draft's view of the target's)."""
    return not isinstance(cache, kvcache.SharedCache) and bool(getattr(cache, "layers", None))


def _layers(cache) -> list:
    return [layer for layer in getattr(cache, "layers", []) if getattr(layer, "is_initialized", False)]


def _rows_bytes(cache, n: int) -> int:
    total = 0
    for layer in _layers(cache):
        b, h, _, d = layer.keys.shape
        total += 2 * b * h * n * d * layer.keys.element_size()
    return total


@torch.inference_mode()
def _host_rows(cache, n: int, pin: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Host copies of rows [0, n) of every layer's K and V."""
    if n <= 0:
        return []
    out, on_cuda = [], False
    for layer in _layers(cache):
        pair = []
        for t in (layer.keys, layer.values):
            rows = t[:, :, :n]  # (1, H, n, D) view of the slab
            on_cuda = on_cuda or rows.is_cuda
            host = _host_empty(rows, pin and rows.is_cuda)
            host.copy_(rows, non_blocking=host.is_pinned())
            pair.append(host)
        out.append(tuple(pair))
    if on_cuda:
        torch.cuda.synchronize()  # the async copies land before anyone overwrites the slabs
    return out


def _host_empty(like: torch.Tensor, pin: bool) -> torch.Tensor:
    if pin:
        try:
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        except RuntimeError:  # pinned pages refused (locked-memory limit): a pageable copy still works
            pass
    return torch.empty(like.shape, dtype=like.dtype)


@torch.inference_mode()  # the slabs are inference tensors (written under kvcache.forward's inference mode)
def restore(snap: Snapshot, st, models, rows: int | None = None) -> None:
    """Put `snap`'s first `rows` positions (default: all) into the live state, bit-exact."""
    from specexec_cli.core.state import reserve_caches

    n = snap.target_len if rows is None else min(rows, snap.target_len)
    reserve_caches(models, st)  # planned slabs (or the self-draft's shared view) exist before the copy
    _put_rows(st.target_cache, snap.target, n, models.target)
    st.target_len = n
    if isinstance(st.draft_cache, kvcache.SharedCache):
        st.draft_cache.follow(0)
        st.draft_len = 0
    else:
        st.draft_len = min(snap.draft_len, n)
        _put_rows(st.draft_cache, snap.draft, st.draft_len, models.draft)
    st.ids[:] = snap.ids if rows is None else snap.ids[:n]


def copy_prefix(src, dst, rows: int, models) -> None:
    """Make `dst` hold `src`'s first `rows` committed positions: `restore` from views of `src`'s slabs
    (committed rows, so a sequence decoding elsewhere can lend them between passes)."""
    n = min(rows, src.target_len)
    own = _own_rows(src.draft_cache)
    draft_len = min(src.draft_len, n) if own else 0

    def view(cache, k):
        return [(layer.keys[:, :, :k], layer.values[:, :, :k]) for layer in _layers(cache)] if k else []

    snap = Snapshot(list(src.ids[:n]), n, draft_len, view(src.target_cache, n), view(src.draft_cache, draft_len), 0)
    restore(snap, dst, models, n)


def _put_rows(cache, layers: list, n: int, model) -> None:
    for layer in getattr(cache, "layers", []):
        layer.length = 0
    device = getattr(model, "device", torch.device("cpu")) if model is not None else torch.device("cpu")
    for i, (k, v) in enumerate(layers):
        k, v = k[:, :, :n], v[:, :, :n]
        layer = cache.layers[i] if i < len(cache.layers) else None
        if layer is not None and layer.is_initialized and layer.keys.shape[-2] >= n:
            layer.keys[:, :, :n].copy_(k, non_blocking=k.is_pinned())
            layer.values[:, :, :n].copy_(v, non_blocking=v.is_pinned())
            layer.length = n
        else:  # an unreserved cache: the slab is allocated (or grown) on the model's device
            cache.update(k.to(device), v.to(device), i)


# -- sizing ------------------------------------------------------------------------------------------
DEFAULT_CONTEXTS = 8  # the default capacity holds this many full-context snapshots, RAM permitting


def token_bytes(model) -> int:
    """K and V bytes one position takes in `model`'s cache (all layers)."""
    if model is None:
        return 0
    layers, kv_heads, head_dim = kvcache.kv_shape(model)
    return 2 * layers * kv_heads * head_dim * kvcache.model_dtype(model).itemsize


def make_prompt_cache(models, plan, capacity: int | None) -> PromptCache | None:
    """The cache for `--cache-ram` (None: half the free host RAM, at most DEFAULT_CONTEXTS full
    contexts; 0: none). Pinned on CUDA when it fits in that free RAM (pinned pages cannot swap)."""
    per_token = token_bytes(models.target) + (0 if models.shared_kv else token_bytes(models.draft))
    # host bytes the memory plan leaves free; without a plan, half the RAM available now
    room = max(0, plan.host_capacity - plan.host_total) if plan is not None else psutil.virtual_memory().available // 2
    if capacity is None:
        capacity = min(room // 2, DEFAULT_CONTEXTS * per_token * models.ctx_limit)
    if capacity <= 0:
        return None
    on_cuda = getattr(models.target, "device", torch.device("cpu")).type == "cuda"
    return PromptCache(capacity, pin=on_cuda and capacity <= room)
