"""Request-level operations a serving loop needs besides caching: its ``req_to_token`` row,
its KV slots in that row, its Mamba slot, its SWA window, and matching with load-back.

Synchronous functions over a :class:`~urc.cache.UnifiedRadixCache` (the actor applies them
for the service's request commands, :mod:`urc.service._commands`).  Each raises a
:class:`~urc.errors.URCError` before changing anything, or succeeds.  They reach the cache
only through its public methods and the public two-phase transfer functions of
:mod:`urc.host.transfers`.

Matching with load-back is two steps so that the byte copy runs outside the tree's owner:

1. :func:`match_req` (one walk): match, lock the device hit on the request's behalf and,
   when the hit continues on host, reserve device slots for the host span and pin it
   (a :class:`PendingLoad`);
2. the caller copies (:meth:`PendingLoad.copy`, no tree access: safe in a worker thread);
3. :func:`finish_req_load` (one walk): commit the copy (or drop it), re-match the request
   and move its lock to the longer hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from urc.components.mamba import MambaComponent
from urc.components.swa import SWAComponent
from urc.errors import InvalidIndicesError, InvalidInputError, OutOfMemoryError, PoolError
from urc.host import transfers as host_transfers
from urc.host_protocol import HostTier, LoadTicket
from urc.key import RadixKey
from urc.node import ComponentType
from urc.params import MatchPrefixParams, MatchResult
from urc.req import Req

if TYPE_CHECKING:
    from urc.cache import UnifiedRadixCache

__all__ = [
    "PendingLoad",
    "alloc_req_mamba",
    "alloc_req_row",
    "finish_req_load",
    "match_req",
    "slide_req_window",
    "start_req_load",
    "write_req_slots",
]


class PendingLoad:
    """A load-back started for a request: device slots reserved and the host span pinned
    until :func:`finish_req_load` (which must follow, exactly once).

    ``tokens``: tokens being loaded; ``nbytes``: their Full KV bytes; ``host_hit_length`` /
    ``prefix_len``: the match that started it (device hit, and its host continuation).
    Holds tree nodes: only the cache's owner may pass it back (callers keep it opaque).
    """

    __slots__ = ("_ticket", "_tier", "host_hit_length", "nbytes", "prefix_len", "tokens")

    def __init__(
        self, ticket: LoadTicket, tier: HostTier, prefix_len: int, host_hit_length: int, nbytes: int
    ) -> None:
        self._ticket = ticket
        self._tier = tier
        self.tokens = ticket.tokens
        self.nbytes = nbytes
        self.prefix_len = prefix_len
        self.host_hit_length = host_hit_length

    def copy(self) -> None:
        """Copy the host bytes into the reserved device slots (no tree access)."""
        host_transfers.copy_load_back(self._tier, self._ticket)

    def finish(self, cache: UnifiedRadixCache, ok: bool) -> int:
        """Commit the load (``ok``) or drop it, unpinning either way; returns the tokens
        committed (see :func:`urc.host.transfers.finish_load_back`)."""
        return host_transfers.finish_load_back(cache, self._ticket, ok)

    def __repr__(self) -> str:
        return f"PendingLoad({self.tokens} tokens)"


def _key(req: Req) -> RadixKey:
    """``req``'s whole :attr:`~urc.req.Req.fill_ids` as a key, packed once per request
    (:meth:`~urc.req.Req.fill_prefix`, which the chunk commits then reuse)."""
    return RadixKey(req.fill_prefix(), req.extra_key)


def _lock(cache: UnifiedRadixCache, req: Req, res: MatchResult) -> int:
    """Move ``req``'s tree lock to ``res``'s device hit (the request layer's
    :func:`~urc.request_caching.move_lock`) and record the hit in the request; returns the
    hit's length."""
    cache.move_lock(req, res.last_device_node)
    req.prefix_indices = res.indices
    n = int(res.indices.shape[0])
    req.cache_protected_len = n
    req.mamba_branching_seqlen = res.mamba_branching_seqlen
    return n


def _start(cache: UnifiedRadixCache, res: MatchResult, threshold: int | None) -> PendingLoad | None:
    tier = cache.host_tier
    if threshold is None or tier is None or res.host_hit_length == 0:
        return None
    ticket = host_transfers.start_load_back(cache, res.best_match_node, threshold)
    if ticket is None:
        return None
    n = int(res.indices.shape[0])
    kv = cache.pools.kv_pool
    nbytes = ticket.tokens * kv.shape.bytes_per_token if kv is not None else 0
    return PendingLoad(ticket, tier, n, res.host_hit_length, nbytes)


def match_req(
    cache: UnifiedRadixCache, req: Req, cow_mamba: bool = False, load_back: int | None = None
) -> tuple[MatchResult, PendingLoad | None]:
    """Match ``req.fill_ids`` and lock the device hit on the request's behalf (sets
    ``last_node``, ``lock``, ``prefix_indices``, ``cache_protected_len``,
    ``mamba_branching_seqlen``).  ``load_back``: a threshold (tokens): when the hit continues
    on host for at least that many tokens and device memory can be found, also start loading
    that span back (the :class:`PendingLoad`).  Raises :class:`InvalidInputError` if ``req``
    already holds a lock."""
    if req.last_node is not None:
        raise InvalidInputError(f"request {req.rid} already holds a lock")
    res = cache.match_prefix(MatchPrefixParams(_key(req), cow_mamba, req))
    _lock(cache, req, res)
    return res, _start(cache, res, load_back)


def start_req_load(
    cache: UnifiedRadixCache, req: Req, threshold: int = 0
) -> tuple[MatchResult, PendingLoad | None]:
    """For a request that holds its match's lock: match again (something may have reached
    the host meanwhile, e.g. a storage prefetch) and start loading the host continuation
    back, as :func:`match_req` does.  The request's lock is unchanged."""
    if req.last_node is None:
        raise InvalidInputError(f"request {req.rid} holds no lock (match it first)")
    res = cache.match_prefix(MatchPrefixParams(_key(req)))
    return res, _start(cache, res, threshold)


def finish_req_load(
    cache: UnifiedRadixCache, req: Req, load: PendingLoad, ok: bool, cow_mamba: bool = False
) -> MatchResult | None:
    """Commit ``load`` (``ok``: its copy succeeded) or drop it, unpinning either way.  After a
    commit, re-match the request and move its lock to the longer hit, as :func:`match_req`
    records it.  Returns that match (``None`` when nothing was loaded)."""
    if load.finish(cache, ok) == 0:
        return None
    res = cache.match_prefix(MatchPrefixParams(_key(req), cow_mamba, req))
    _lock(cache, req, res)
    return res


def alloc_req_row(cache: UnifiedRadixCache, req: Req) -> int:
    """Give ``req`` a ``req_to_token`` row (``req.req_pool_idx``); returns it.  Raises
    :class:`OutOfMemoryError` when every row is taken, :class:`InvalidInputError` when the
    request has one."""
    if req.req_pool_idx is not None:
        raise InvalidInputError(f"request {req.rid} already has row {req.req_pool_idx}")
    row = cache.req_to_token_pool.alloc()
    if row is None:
        raise OutOfMemoryError("no free request row")
    req.req_pool_idx = row
    return row


def write_req_slots(
    cache: UnifiedRadixCache, req: Req, slots: torch.Tensor, committed: int
) -> None:
    """Write caller-owned ``slots`` into ``req``'s row after what it holds (from then on the
    request owns them: ``cache_*_req`` caches or frees them) and set ``kv_committed_len`` to
    ``committed``.  The first write also stores the matched prefix's indices at the row's
    start.  Raises :class:`InvalidInputError` past the row's end or without a row, and
    :class:`~urc.errors.InvalidIndicesError` (or :class:`~urc.errors.TreeOwnedSlotError`)
    unless ``slots`` are page runs held by the caller, each page once (O(len(slots))); a
    slot the request's row already holds is not detected (it is held too)."""
    row = req.req_pool_idx
    if row is None:
        raise InvalidInputError(f"request {req.rid} has no req_pool_idx")
    pool = cache.req_to_token_pool
    pool.check_row(row)
    check_held = getattr(cache.token_to_kv_pool_allocator, "check_held", None)
    if check_held is not None:
        try:
            check_held(slots, "writing request slots:")
        except PoolError as exc:  # a slot that is not allocated: the caller's input
            raise InvalidIndicesError(str(exc)) from None
    prefix = req.cache_protected_len
    start = max(req.kv_allocated_len, prefix)
    end = start + int(slots.shape[0])
    if end > pool.max_context_len:
        raise InvalidInputError(f"request {req.rid}: {end} tokens exceed the row")
    if req.kv_allocated_len < prefix:
        pool.write(row, 0, req.prefix_indices)
    pool.write(row, start, slots)
    req.kv_allocated_len = end
    req.kv_committed_len = committed


def alloc_req_mamba(cache: UnifiedRadixCache, req: Req) -> torch.Tensor:
    """Give ``req`` its live Mamba state slot (``req.mamba_pool_idx``) unless it has one,
    evicting an unlocked state when the pool is full; returns it.  Raises
    :class:`OutOfMemoryError`, and :class:`InvalidInputError` without a Mamba component."""
    comp = _component(cache, ComponentType.MAMBA)
    assert isinstance(comp, MambaComponent)
    return comp.alloc_req_slot(req)


def slide_req_window(cache: UnifiedRadixCache, req: Req, seq_len: int) -> int:
    """SWA: free the SWA slots of ``req``'s own tokens that slid out of the window at
    sequence length ``seq_len``; returns the SWA tokens freed.  Raises
    :class:`InvalidInputError` without an SWA component or a row."""
    comp = _component(cache, ComponentType.SWA)
    assert isinstance(comp, SWAComponent)
    return comp.free_out_of_window_slots(req, seq_len)


def _component(cache: UnifiedRadixCache, ct: ComponentType) -> object:
    if not cache.has_component(ct):
        raise InvalidInputError(f"this cache has no {ct.name} component")
    return cache.component(ct)
