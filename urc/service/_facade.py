"""``AsyncUnifiedRadixCache``: the public coroutines of the service.

Each builds a frozen command (:mod:`urc.service._commands`), sends it to the actor and awaits the
reply (:mod:`urc.service._transport`); what a cancelled caller gets is the cancellation table
of :mod:`urc.service`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from time import perf_counter
from typing import TypeVar

import anyio
import anyio.to_thread
import torch
from anyio import CancelScope
from anyio.lowlevel import checkpoint_if_cancelled

from urc.cache import UnifiedRadixCache
from urc.errors import InvalidInputError, LeaseError, ServiceClosedError
from urc.host_protocol import BackupTicket, LoadTicket
from urc.key import ExtraKey, RadixKey
from urc.node import ComponentType
from urc.params import EvictParams, EvictResult
from urc.req import Req
from urc.reuse_hint import ReuseHint
from urc.service._attachable import AttachableWorker
from urc.service._base import ServiceState
from urc.service._commands import (
    Alloc,
    AllocMamba,
    AllocReqMamba,
    AllocReqRow,
    AttachWorker,
    CacheFinishedReq,
    CacheUnfinishedReq,
    Call,
    DetachWorker,
    Evict,
    EvictHost,
    FinishBackups,
    FinishLoadBack,
    FinishReqLoad,
    Free,
    FreeMamba,
    Insert,
    InsertOutcome,
    Lock,
    Match,
    MatchOutcome,
    MatchReq,
    Release,
    SanityCheck,
    SlideReqWindow,
    StartBackups,
    StartLoadBack,
    StartReqLoad,
    Stats,
    WriteReqSlots,
)
from urc.service._lease import Lease, NodeHandle
from urc.service._lifecycle import Lifecycle
from urc.service._observer import TransferKind
from urc.stats import CacheStats

__all__ = ["AsyncUnifiedRadixCache"]

T = TypeVar("T")


def _as_key(key: RadixKey | Sequence[int], extra_key: ExtraKey | str | None) -> RadixKey:
    if isinstance(key, RadixKey):
        if extra_key is not None:
            raise InvalidInputError("pass extra_key inside the RadixKey, not both")
        return key
    if isinstance(key, list | tuple | array):
        return RadixKey(key, extra_key)  # packed here, outside the actor
    raise InvalidInputError(
        f"key must be a RadixKey or a list of token ids, got {type(key).__name__}"
    )


class AsyncUnifiedRadixCache(Lifecycle):
    """Async facade over a :class:`UnifiedRadixCache` (see :mod:`urc.service`).

    ``cache``: the core to own (or a :class:`~urc.config.CacheConfig` to build one).  While
    the service runs, nothing else may touch the core.  ``max_queued`` bounds the command
    stream's buffer (callers wait for room when it is full); ``max_batch`` bounds how many
    commands the actor applies before yielding to the event loop.  ``observer`` gets
    per-command callbacks and stats snapshots (:mod:`urc.service._observer`).  ``workers`` are
    started as background coroutines on entry.  ``trace`` is a test hook (see
    :data:`~urc.service._base.TraceHook`).  ``load_back``: how ``match_req(load_back=True)``
    copies (:class:`~urc.service._base.LoadBackPolicy`).
    """

    async def match(
        self,
        key: RadixKey | Sequence[int],
        *,
        lock: bool = False,
        cow_mamba: bool = False,
        req: Req | None = None,
        extra_key: ExtraKey | str | None = None,
    ) -> MatchOutcome:
        """Longest cached prefix of ``key``; with ``lock`` the result holds a :class:`Lease`
        protecting it.  Mutates access times (and may split a node).  ``cow_mamba`` with
        ``req`` copies the matched Mamba state into ``req``'s slot."""
        cmd = Match(_as_key(key, extra_key), lock, cow_mamba, req)
        result = await self._submit(cmd)
        return result

    async def match_req(
        self, req: Req, *, cow_mamba: bool = False, load_back: bool = False
    ) -> MatchOutcome:
        """Match ``req.fill_ids`` and lock the hit on the request's behalf: sets
        ``prefix_indices``, ``cache_protected_len``, and the lock that ``cache_finished_req`` /
        ``cache_unfinished_req`` release.  Raises :class:`InvalidInputError` if ``req``
        already holds a lock.

        ``load_back``: when the hit continues on host (HiCache), load that span back to
        device and lock the longer hit, in two commands: the match (one walk, also reserving
        device slots and pinning the host span), the byte copy (here, see
        :class:`LoadBackPolicy`), the commit (one walk: re-match and move the lock).  The
        outcome is the final hit; ``host_loaded_len`` of it came from host.  Once the match
        started a load-back, the copy and the commit run shielded."""
        if not isinstance(req, Req):
            raise InvalidInputError(f"match_req needs a Req, got {type(req).__name__}")
        threshold = self._load_back.threshold if load_back else None
        out = await self._submit(MatchReq(req, cow_mamba, threshold))
        if out.pending_load is None:
            return out
        return await self._finish_load(req, out, cow_mamba)

    async def load_back_req(self, req: Req, *, cow_mamba: bool = False) -> MatchOutcome:
        """For a request holding its match's lock: match it again and load the host
        continuation back (something may have reached the host since, e.g. a storage
        prefetch), moving its lock to the longer hit, as ``match_req(load_back=True)`` does.
        The outcome is the request's hit afterwards (unchanged when nothing was loaded)."""
        if not isinstance(req, Req):
            raise InvalidInputError(f"load_back_req needs a Req, got {type(req).__name__}")
        out = await self._submit(StartReqLoad(req, self._load_back.threshold))
        if out.pending_load is None:
            return out
        return await self._finish_load(req, out, cow_mamba)

    async def _finish_load(self, req: Req, out: MatchOutcome, cow_mamba: bool) -> MatchOutcome:
        """Copy the bytes of ``out``'s pending load-back and commit it (shielded)."""
        load = out.pending_load
        assert load is not None
        ok = False
        with CancelScope(shield=True):
            t0 = perf_counter()
            try:
                if self._load_back.copy_in_thread:
                    await anyio.to_thread.run_sync(load.copy)
                else:
                    load.copy()
                ok = True
            finally:
                seconds = perf_counter() - t0
                finish = FinishReqLoad(req, load, ok, cow_mamba)
                try:
                    done = await self._submit(finish)
                except ServiceClosedError:  # closing meanwhile: dropped before the close ends
                    self._give_back(FinishReqLoad(req, load, False))
                    raise
        obs = self._observer
        if obs is not None and done is not None:
            obs.on_transfer(TransferKind.LOAD_BACK, load.tokens, load.nbytes, seconds)
        return done if done is not None else replace(out, pending_load=None)

    async def insert(
        self,
        key: RadixKey | Sequence[int],
        value: torch.Tensor,
        *,
        prev_prefix_len: int = 0,
        mamba_value: torch.Tensor | None = None,
        swa_evicted_seqlen: int = 0,
        chunked: bool = False,
        priority: int = 0,
        extra_key: ExtraKey | str | None = None,
    ) -> InsertOutcome:
        """Insert ``key`` -> ``value``; the tree takes the slots (duplicates past
        ``prev_prefix_len`` are freed; an unaligned tail stays the caller's, as does
        ``mamba_value`` when the result says ``mamba_exist``).  Never withdrawn once sent: a
        scope-cancelled caller still gets the outcome; a natively cancelled one gets
        ``CancelledError`` after the insert was applied.  Either way the unaligned tail (and
        an unadopted ``mamba_value``) stays the caller's to free (see the cancellation
        rules): the insert consumed ``value[:len(key) - len(key) % page_size]`` (kept or
        freed as duplicates)."""
        cmd = Insert(
            _as_key(key, extra_key),
            value,
            prev_prefix_len,
            mamba_value,
            swa_evicted_seqlen,
            chunked,
            priority,
        )
        result = await self._submit(cmd)
        return result

    async def lock(self, node: NodeHandle) -> Lease:
        """Lock the node a match returned; raises :class:`~urc.errors.InvalidLockError` if it
        was evicted since."""
        if not isinstance(node, NodeHandle):
            raise InvalidInputError(f"lock needs a NodeHandle, got {type(node).__name__}")
        result = await self._submit(Lock(node))
        return result

    async def release(self, lease: Lease) -> None:
        """Release ``lease`` (exactly once: a second release raises :class:`LeaseError`).

        The lease is marked released before the first ``await`` unless the caller is already
        cancelled; from then on the release is applied even if the caller is cancelled while
        it waits (check :attr:`Lease.released`)."""
        if not lease.issued_by(self):
            raise LeaseError(f"lease {lease.id} was not issued by this service")
        self._check_open()
        await checkpoint_if_cancelled()  # never mark a lease released and then not send it
        lease.mark_released()
        await self._submit(Release(lease), True)

    def release_nowait(self, lease: Lease) -> None:
        """Release ``lease`` without waiting (never yields, so it works in a cancelled scope:
        what ``async with lease:`` does on exit).  The lease is marked released at once and
        its release queued; the actor applies it before any command sent later by this task.
        Raises :class:`LeaseError` on a second release or a foreign lease, and
        :class:`ServiceClosedError` / :class:`ServiceFailedError` when the service is not
        running (a close releases every lease still held)."""
        if not lease.issued_by(self):
            raise LeaseError(f"lease {lease.id} was not issued by this service")
        if self._state is not ServiceState.RUNNING and self._state is not ServiceState.CLOSING:
            raise self._not_running_error()
        lease.mark_released()
        self._give_back(Release(lease))

    async def evict(
        self, num_tokens: int = 0, swa_num_tokens: int = 0, mamba_num: int = 0
    ) -> EvictResult:
        """Evict at least these amounts where possible (never locked data)."""
        result = await self._submit(Evict(EvictParams(num_tokens, swa_num_tokens, mamba_num)))
        return result

    async def alloc(self, num_tokens: int, *, evict: bool = True) -> torch.Tensor:
        """Allocate ``num_tokens`` Full KV slots for the caller (evicting first when short);
        raises :class:`~urc.errors.OutOfMemoryError`.  The caller owns the slots."""
        if not isinstance(num_tokens, int):
            raise InvalidInputError(
                f"num_tokens must be an int, got {num_tokens!r} ({type(num_tokens).__name__})"
            )
        result = await self._submit(Alloc(num_tokens, evict))
        return result

    async def free(self, indices: torch.Tensor) -> None:
        """Give caller-owned slots back to the allocator."""
        if not isinstance(indices, torch.Tensor):
            raise InvalidInputError(f"indices must be a tensor, got {type(indices).__name__}")
        await self._submit(Free(indices))

    async def alloc_mamba(self, num: int = 1, *, evict: bool = True) -> torch.Tensor:
        """Allocate ``num`` Mamba state slots for the caller (evicting tree states first when
        short); returns their indices (1-D int64).  The caller owns them: it passes one as
        an insert's ``mamba_value`` or gives them back with :meth:`free_mamba`.  Raises
        :class:`~urc.errors.OutOfMemoryError`, and :class:`InvalidInputError` when the cache
        has no Mamba component."""
        if not isinstance(num, int):
            raise InvalidInputError(f"num must be an int, got {num!r} ({type(num).__name__})")
        result = await self._submit(AllocMamba(num, evict))
        return result

    async def free_mamba(self, indices: torch.Tensor) -> None:
        """Give caller-owned Mamba state slots back (all or nothing: a slot the tree owns or
        that is not allocated raises and frees none)."""
        if not isinstance(indices, torch.Tensor):
            raise InvalidInputError(f"indices must be a tensor, got {type(indices).__name__}")
        await self._submit(FreeMamba(indices))

    async def alloc_req_row(self, req: Req) -> int:
        """Give ``req`` a ``req_to_token`` row (``req.req_pool_idx``, which ``cache_*_req``
        frees with the request); returns it.  Raises :class:`~urc.errors.OutOfMemoryError`
        when every row is taken."""
        if not isinstance(req, Req):
            raise InvalidInputError(f"alloc_req_row needs a Req, got {type(req).__name__}")
        result = await self._submit(AllocReqRow(req))
        return result

    async def write_req_slots(self, req: Req, slots: torch.Tensor, committed: int) -> None:
        """Write ``slots`` (from :meth:`alloc`) into ``req``'s row after what it holds: the
        request owns them from then on (``cache_*_req`` caches or frees them).  Sets
        ``kv_committed_len`` to ``committed``; the first write also stores the matched
        prefix's indices at the row's start."""
        if not isinstance(slots, torch.Tensor):
            raise InvalidInputError(f"slots must be a tensor, got {type(slots).__name__}")
        await self._submit(WriteReqSlots(req, slots, committed))

    async def alloc_req_mamba(self, req: Req) -> torch.Tensor:
        """Give ``req`` its live Mamba state slot (``req.mamba_pool_idx``) unless it has one,
        evicting an unlocked state when the pool is full; returns it.  Raises
        :class:`~urc.errors.OutOfMemoryError`, and :class:`InvalidInputError` when the cache
        has no Mamba component."""
        result = await self._submit(AllocReqMamba(req))
        return result

    async def slide_req_window(self, req: Req, seq_len: int) -> int:
        """SWA: free the SWA slots of ``req``'s own tokens that slid out of the window at
        sequence length ``seq_len``; returns the SWA tokens freed.  Raises
        :class:`InvalidInputError` when the cache has no SWA component."""
        result = await self._submit(SlideReqWindow(req, seq_len))
        return result

    async def cache_finished_req(
        self, req: Req, is_insert: bool = True, *, hint: ReuseHint | None = None
    ) -> None:
        """``UnifiedRadixCache.cache_finished_req`` through the actor (``hint``: the
        serving layer's view of the next use, ``urc.reuse_hint``)."""
        if not isinstance(req, Req):
            raise InvalidInputError(f"cache_finished_req needs a Req, got {type(req).__name__}")
        if hint is not None and not isinstance(hint, ReuseHint):
            raise InvalidInputError(f"hint must be a ReuseHint, got {hint!r}")
        await self._submit(CacheFinishedReq(req, is_insert, hint))

    async def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """``UnifiedRadixCache.cache_unfinished_req`` through the actor."""
        if not isinstance(req, Req):
            raise InvalidInputError(f"cache_unfinished_req needs a Req, got {type(req).__name__}")
        await self._submit(CacheUnfinishedReq(req, chunked))

    async def stats(self) -> CacheStats:
        """A :class:`CacheStats` snapshot."""
        result = await self._submit(Stats())
        return result

    async def sanity_check(self, held: Mapping[ComponentType, int] | None = None) -> None:
        """``sanity_check()`` plus the pool conservation check; a broken invariant fails the
        service (an ``AssertionError`` is a bug, not a caller error)."""
        await self._submit(SanityCheck(held))

    # ------------------------------------------------------------------ host-tier transfers
    # The host tier's controller (``hicache.controller``) moves bytes outside the actor in
    # two phases: it starts a transfer (slots reserved, nodes pinned), copies in a worker
    # thread, then finishes it (committed or dropped, unpinned).  A caller cancelled natively
    # after a start never gets its tickets: the service aborts them.
    async def start_backups(self, limit: int) -> list[BackupTicket]:
        """Start the backups of up to ``limit`` due nodes (oldest first); their tickets."""
        return await self._submit(StartBackups(limit))

    async def finish_backups(self, tickets: Sequence[BackupTicket], ok: bool = True) -> int:
        """Commit (``ok``: every copy succeeded) or drop ``tickets``; tokens backed up."""
        return await self._submit(FinishBackups(tuple(tickets), ok))

    async def start_load_back(self, key: RadixKey, threshold: int = 0) -> LoadTicket | None:
        """Start loading the host continuation of ``key``'s cached prefix back to device (at
        least ``threshold`` tokens); ``None`` when there is none or no device memory."""
        return await self._submit(StartLoadBack(key, threshold))

    async def finish_load_back(self, tickets: Sequence[LoadTicket], ok: bool = True) -> int:
        """Commit (``ok``) or drop loads started by :meth:`start_load_back`; tokens loaded."""
        return await self._submit(FinishLoadBack(tuple(tickets), ok))

    async def evict_host(self, num_tokens: int) -> int:
        """Free host-only leaves (no host lock), oldest first, for ``num_tokens`` host
        slots; returns the Full tokens freed."""
        return await self._submit(EvictHost(num_tokens))

    async def call(
        self,
        fn: Callable[[UnifiedRadixCache], T],
        *,
        undo: Callable[[UnifiedRadixCache, T], None] | None = None,
    ) -> T:
        """Run ``fn(cache)`` inside the actor and return its result (internal use: HiCache
        workers, tests).  ``fn`` must not keep node references past the call.  ``undo``:
        run inside the actor as ``undo(cache, result)`` when the caller was cancelled
        natively and never got the result (see the cancellation rules)."""
        result = await self._submit(Call(fn, undo))
        return result

    # ------------------------------------------------------------------ live workers
    async def attach_worker(self, worker: AttachableWorker) -> None:
        """Attach a background worker to the running service: inside the actor
        ``worker.attach(cache)`` (it subscribes to the cache's events), then ``worker.run``
        in the background, as for a worker passed in ``workers=``.

        Raises :class:`~urc.errors.InvalidInputError` for an object without the hooks of an
        :class:`AttachableWorker` or a worker attached already, whatever typed error
        ``attach`` raises (nothing is attached then), and
        :class:`~urc.errors.ServiceClosedError` unless running.  A caller cancelled after
        the actor attached the worker leaves it detached again (the service gives it back).
        """
        if not isinstance(worker, AttachableWorker):
            raise InvalidInputError(f"{type(worker).__name__} is not an AttachableWorker")
        if self._is_attached(worker):
            raise InvalidInputError(f"{worker!r} is attached already")
        self._check_open()
        await self._submit(AttachWorker(worker))
        self._start_worker(worker)

    async def detach_worker(self, worker: AttachableWorker, timeout_s: float | None = None) -> None:
        """Detach a worker started by :meth:`attach_worker` or ``workers=``:
        ``await worker.drain(self, timeout_s)`` (it takes no new work and finishes or gives
        back what is in flight, within ``timeout_s``), then its background ``run`` is
        cancelled and awaited, then ``worker.detach(cache)`` runs inside the actor (it
        unsubscribes).  Once the drain is over the rest is shielded from cancellation.

        Raises :class:`~urc.errors.InvalidInputError` if ``worker`` is not attached here,
        or still holds something of the cache after its drain (a bug of the worker), and
        :class:`~urc.errors.ServiceClosedError` unless running.
        """
        if not self._is_attached(worker):
            raise InvalidInputError(f"{worker!r} is not attached to this service")
        self._check_open()
        await worker.drain(self, timeout_s)
        with CancelScope(shield=True):
            await self._stop_worker(worker)
            await self._submit(DetachWorker(worker))
