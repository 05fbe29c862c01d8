"""``AsyncUnifiedRadixCache``: an awaitable cache whose tree is owned by one actor task.

Usage::

    async with AsyncUnifiedRadixCache(CacheConfig(kv_size=1 << 16)) as svc:
        hit = await svc.match([1, 2, 3], lock=True)     # MatchOutcome with a Lease
        ...
        await hit.lease.release()

Design (ARCHITECTURE §6)
------------------------
Every public coroutine builds a frozen command (:mod:`urc.commands`), wraps it in a call
(the command plus a one-shot reply slot), sends the call on a bounded anyio memory object
stream (``max_queued`` buffered calls) and awaits the reply: on asyncio a bare
``asyncio.Future`` of the running loop, elsewhere (trio) an ``anyio.Event``; the result
travels in the call object (``python -m urc.service_bench --replies`` compares reply
objects).  Sending is ``send_nowait``: it never yields, so nothing happens between the
caller's checks and the call entering the stream.  Only when the buffer is full does a caller
fall back to ``await send(...)`` (backpressure); once one caller waits there, later callers
queue behind it through the same path, so the stream keeps send order.

One actor task takes the calls and applies them strictly in order, one at a time, through a
:class:`~urc.executor.CommandExecutor`.  It blocks on ``await receive()`` only when the
stream is empty; woken, it applies that call and every call already queued
(``receive_nowait``, at most ``max_batch`` in all) in one batch, then yields once, so the
callers it just answered run and their next commands form its next batch.  (It knows how many
calls are queued from a counter the senders bump, so draining a batch raises no
``WouldBlock``.)  Because applying a command never awaits, no other task ever sees the tree
mid-command and no lock is needed.

Handles, not nodes: results carry device indices, hit lengths, an opaque
:class:`~urc.lease.NodeHandle` and, when asked, a :class:`~urc.lease.Lease` (released exactly
once).  ``Req`` objects passed to ``match_req`` / ``cache_*_req`` do hold tree nodes
(``req.last_node``): the request belongs to the server, but only the actor may read or write
``last_node`` / ``lock_receipt`` -- callers must never touch them.

Cancellation (nothing leaks, nothing is half-applied).  Two ways of being cancelled: a
cancelled *scope* (anyio ``CancelScope`` / ``move_on_after`` / ``fail_after``, trio's
scopes; level-triggered: delivered again at every checkpoint until the scope exits), and a
*native* asyncio cancellation (``Task.cancel()``, hence ``asyncio.timeout``, ``wait_for``,
``TaskGroup`` shutdown; delivered once).  Applying a command never awaits, so the actor's
side of every command is atomic: the core raises a :class:`~urc.errors.URCError` before
changing anything, or applies the command fully.  Where the caller can be cancelled, and what
happens then (``_ON_CANCEL`` classifies the commands)::

    command kind         | cancelled where                | what it passed in / what it got
    ---------------------+--------------------------------+-----------------------------------
    any                  | before sending (scope already  | nothing is sent or applied; all it
                         | cancelled: raises at once)     | passed in is still its own
    ---------------------+--------------------------------+-----------------------------------
    match, lock          | waiting for room, or queued    | withdrawn: the actor skips it
    (may be abandoned)   | (actor has not taken it)       |
                         | after the actor applied it,    | the lease it would get is released
                         | before the caller resumed      | by the service (queued at once)
    evict, stats,        | same as match                  | skipped, or applied and the result
    sanity_check         |                                | dropped (nothing to give back)
    ---------------------+--------------------------------+-----------------------------------
    release              | anywhere after the call began  | the lease is marked released
                         | (scope or native)              | before the first await: the
                         |                                | release is applied regardless
    release_nowait,      | never yields: cannot be        | released (queued without waiting)
    ``async with lease`` | cancelled                      |
    ---------------------+--------------------------------+-----------------------------------
    ownership moves:     | scope cancelled after sending  | sent for sure; the caller waits
    insert, alloc, free, | (waiting for room or for the   | (shielded) and gets the outcome
    alloc_mamba,         | reply)                         | (result or typed error); the
    free_mamba,          |                                | cancellation lands at its next
    match_req,           |                                | checkpoint
    cache_finished_req,  | native cancellation after      | sent and applied all the same; the
    cache_unfinished_req,| sending, waiting for room or   | CancelledError is raised once the
    call                 | for the reply                  | actor answered.  Passed in: taken
                         |                                | as if the call returned (insert:
                         |                                | the tree took the value; free:
                         |                                | freed; a Req holds its outcome).
                         |                                | Got: given back by the service --
                         |                                | alloc / alloc_mamba slots freed,
                         |                                | an insert's leftovers (unaligned
                         |                                | tail, an unadopted Mamba value)
                         |                                | freed, a call's result handed to
                         |                                | its ``undo`` (else dropped).  If
                         |                                | the command failed (typed error),
                         |                                | nothing changed: what it passed in
                         |                                | is still its own

So a caller that sees ``CancelledError`` from an ownership move knows which case it is in:
its own anyio/trio scope was cancelled (``current_effective_deadline() == -inf``) -- nothing
was sent; else -- the command was applied.  The waits are bounded: the actor always answers
(it drains the stream at close and fails every queued call if it dies), and a closing or
failed service refuses new sends.  Implementation: rather than entering a shielded scope on
every call, the caller catches the cancellation and, only then, waits on in a shielded scope
(looping through native cancellations, which a shield does not stop); a native cancellation
that interrupts ``await send`` checks whether the stream took the call (``_in_stream``) and
sends it again if not.  Give-backs (releases, frees) for callers that are gone are queued
without waiting (``_give_back``), or parked when the stream is full or closing and applied at
the start of the actor's next batch (so before anything queued meanwhile), or at shutdown.

Errors: a ``URCError`` raised for one command reaches that caller only and the actor keeps
serving.  Any other exception inside the actor (an ``AssertionError`` from an invariant, a
bug, a failing observer) fails the service: the failing call and every queued or later call
get :class:`~urc.errors.ServiceFailedError` with the cause chained.  A background worker's
exception ends that worker only (logged, kept in :attr:`background_failures`): it reaches
the tree only through atomic commands, so it cannot leave the tree half-changed.  Calls after
close (or before start) raise :class:`~urc.errors.ServiceClosedError`.

Observers (:mod:`urc.observer`): the actor times every command (one clock read when the
caller sends, two around the command) and reports it; a plain observer also gets a
``cache.stats()`` snapshot after every batch, a :class:`~urc.observer.PullingObserver` pulls
snapshots from the service when it needs them (``metrics`` does so at scrape time) or asks
for them at most every so often.

Background work (HiCache): :meth:`start_background` (or ``workers=``) runs coroutines in the
service's task group; they reach the tree only through commands (``await svc.call(fn)`` runs
``fn(cache)`` inside the actor).  Close cancels them first (their cancellation handlers may
still make shielded calls), then closes the stream to new calls, lets the actor drain it,
then releases every lease still held (pins included) and reports how many.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from enum import Enum
from time import perf_counter
from types import TracebackType
from typing import Any, Protocol, TypeVar

import anyio
import torch
from anyio import (
    BrokenResourceError,
    CancelScope,
    ClosedResourceError,
    EndOfStream,
    WouldBlock,
    current_effective_deadline,
)
from anyio.abc import TaskGroup
from anyio.lowlevel import checkpoint, checkpoint_if_cancelled
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

try:  # the running backend's class: calling it directly skips a per-call backend lookup
    from anyio._core._eventloop import get_async_backend as _get_async_backend
except ImportError:  # pragma: no cover - not where anyio 4 keeps it
    _get_async_backend = None  # type: ignore[assignment]

from urc.cache import UnifiedRadixCache
from urc.commands import (
    Alloc,
    AllocMamba,
    CacheFinishedReq,
    CacheUnfinishedReq,
    Call,
    Command,
    CommandKind,
    Evict,
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
    Stats,
)
from urc.config import CacheConfig, build_cache
from urc.errors import (
    InvalidInputError,
    LeaseError,
    ServiceClosedError,
    ServiceError,
    ServiceFailedError,
    URCError,
)
from urc.executor import CommandExecutor, give_back
from urc.key import ExtraKey, RadixKey
from urc.lease import Lease, NodeHandle
from urc.observer import PullingObserver, ServiceObserver
from urc.params import EvictParams, EvictResult
from urc.req import Req
from urc.snapshots import LoopSnapshots, call_soon_threadsafe, running_asyncio_loop
from urc.stats import CacheStats
from urc.tree import ComponentType

__all__ = [
    "AsyncUnifiedRadixCache",
    "BackgroundWorker",
    "CommandKind",
    "InsertOutcome",
    "Lease",
    "MatchOutcome",
    "NodeHandle",
    "ServiceState",
    "TraceHook",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Trace hook: called by the actor after applying each command, before the reply is delivered,
# with (command, result, error).  For tests (history recording, fault injection).
TraceHook = Callable[[Command, Any, BaseException | None], None]


class _OnCancel(Enum):
    """What happens to a command whose caller is cancelled after sending it."""

    SKIP = 0  # skipped if the actor has not taken it yet; a lease it produced is released
    APPLY = 1  # applied anyway (a release: the lease is already marked released)
    AWAIT = 2  # the caller waits (shielded) for the outcome: slots or a request change owner


# Looked up by command type (a C-level hash; an Enum member hashes in Python).
_ON_CANCEL: dict[type[Any], _OnCancel] = {
    Match: _OnCancel.SKIP,
    Lock: _OnCancel.SKIP,
    Evict: _OnCancel.SKIP,
    Stats: _OnCancel.SKIP,
    SanityCheck: _OnCancel.SKIP,
    Release: _OnCancel.APPLY,
    Insert: _OnCancel.AWAIT,
    MatchReq: _OnCancel.AWAIT,
    Alloc: _OnCancel.AWAIT,
    Free: _OnCancel.AWAIT,
    AllocMamba: _OnCancel.AWAIT,
    FreeMamba: _OnCancel.AWAIT,
    CacheFinishedReq: _OnCancel.AWAIT,
    CacheUnfinishedReq: _OnCancel.AWAIT,
    Call: _OnCancel.AWAIT,
}


class ServiceState(Enum):
    """Lifecycle of the service."""

    NEW = "new"  # constructed, not entered
    RUNNING = "running"
    CLOSING = "closing"  # no new calls; the actor drains the stream
    CLOSED = "closed"
    FAILED = "failed"  # the actor (or a background worker) died; see ``failure``


class BackgroundWorker(Protocol):
    """A background coroutine of the service (HiCache backup, host eviction, prefetch)."""

    async def run(self, svc: AsyncUnifiedRadixCache) -> None: ...


class _Call:
    """One in-flight command: what travels on the stream, and the one-shot reply slot the
    actor fills.

    ``reply`` wakes the caller: a bare ``asyncio.Future`` on asyncio (awaited directly; a
    cancelled caller cancels it, so the actor only sets it if not done), an ``anyio.Event``
    otherwise (trio), ``None`` for calls the service sends on behalf of a caller that is gone.
    """

    __slots__ = ("abandoned", "command", "done", "error", "reply", "result", "sent_at")

    def __init__(self, command: Command, sent_at: float, reply: Any) -> None:
        self.command = command
        self.sent_at = sent_at
        self.reply = reply
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        # Set by a caller that stopped waiting before the actor took the command.
        self.abandoned = False


def _as_key(key: RadixKey | Sequence[int], extra_key: ExtraKey | str | None) -> RadixKey:
    if isinstance(key, RadixKey):
        if extra_key is not None:
            raise InvalidInputError("pass extra_key inside the RadixKey, not both")
        return key
    if isinstance(key, (list, tuple)):
        return RadixKey(list(key), extra_key)
    raise InvalidInputError(f"key must be a RadixKey or a list of token ids, got {type(key)}")


def _leased(result: Any) -> Lease | None:
    if isinstance(result, Lease):
        return result
    if isinstance(result, MatchOutcome):
        return result.lease
    return None


class AsyncUnifiedRadixCache:
    """Async facade over a :class:`UnifiedRadixCache` (see the module docstring).

    ``cache``: the core to own (or a :class:`CacheConfig` to build one).  While the service
    runs, nothing else may touch the core.  ``max_queued`` bounds the command stream's buffer
    (callers wait for room when it is full); ``max_batch`` bounds how many commands the actor
    applies before yielding to the event loop.  ``observer`` gets per-command callbacks and
    stats snapshots (:mod:`urc.observer`).  ``workers`` are started as background coroutines
    on entry.  ``trace`` is a test hook (see :data:`TraceHook`).
    """

    def __init__(
        self,
        cache: UnifiedRadixCache | CacheConfig,
        *,
        max_queued: int = 1024,
        max_batch: int = 256,
        observer: ServiceObserver | None = None,
        workers: Sequence[BackgroundWorker] = (),
        trace: TraceHook | None = None,
    ) -> None:
        if max_queued < 1 or max_batch < 1:
            raise InvalidInputError(f"max_queued and max_batch must be >= 1: {max_queued}")
        self._cache = build_cache(cache) if isinstance(cache, CacheConfig) else cache
        self._executor = CommandExecutor(self._cache, self)
        self._max_queued = max_queued
        self._max_batch = max_batch
        self._observer = observer
        self._trace = trace
        self._initial_workers = tuple(workers)
        self._state = ServiceState.NEW
        self._failure: BaseException | None = None
        self._released_at_close = 0
        self._closing = False
        # Give-backs for callers that are gone (releases, frees: ``_give_back``) that found
        # the stream full or closing: applied at the start of the next batch, or at shutdown.
        self._orphans: list[Command] = []
        self._worker_scopes: set[CancelScope] = set()
        self._background_failures: list[BaseException] = []
        self._workers_done: anyio.Event | None = None
        self._tg: TaskGroup | None = None
        self._actor_done: anyio.Event | None = None
        # The command stream (created on entry).  ``_pending``: calls sent or being sent and
        # not yet taken by the actor -- the senders add, the actor subtracts; it drives the
        # batch drain and ``queued``.  (A caller cancelled while waiting for room cannot
        # tell whether the stream took its call; the actor corrects the count when it finds
        # the stream empty.)  ``_sending``: callers inside ``await send`` (the slow path).
        self._send: MemoryObjectSendStream[_Call] | None = None
        self._recv: MemoryObjectReceiveStream[_Call] | None = None
        self._send_nowait: Callable[[_Call], None] = self._refuse
        self._pending = 0
        self._sending = 0
        # While the actor waits in ``receive()`` the next call is handed to it directly,
        # outside the buffer: kept here until the actor has it, so that a cancellation of
        # the actor at that moment still answers that call.
        self._idle = False
        self._handoff: _Call | None = None
        # Observer: ``_push_interval`` None: never push snapshots (the observer pulls);
        # 0.0: after every batch (plain observers); else at most that often, plus when the
        # actor goes idle.  ``_last_t``: end of the latest command (perf_counter).
        self._snapshots: LoopSnapshots | None = None
        self._push_interval: float | None = 0.0
        self._pushed_at = -math.inf
        self._push_due = False
        self._last_t = 0.0
        # Reply primitives of the running backend (see ``_Call``), chosen on entry.
        self._on_asyncio = False
        self._new_reply: Callable[[], Any] = anyio.Event
        self._checkpoint_if_cancelled: Callable[[], Awaitable[None]] = checkpoint_if_cancelled
        self._cancelled_exc: type[BaseException] = BaseException  # set on entry

    # ================================================================== lifecycle
    async def __aenter__(self) -> AsyncUnifiedRadixCache:
        """Start the actor (and ``workers``) in a new task group; a service starts once."""
        if self._state is not ServiceState.NEW:
            raise ServiceClosedError(f"service cannot be started again ({self._state.value})")
        self._actor_done = anyio.Event()
        self._cancelled_exc = anyio.get_cancelled_exc_class()
        if _get_async_backend is not None:
            self._checkpoint_if_cancelled = _get_async_backend().checkpoint_if_cancelled
        loop = running_asyncio_loop()
        if loop is not None:
            self._on_asyncio = True
            self._new_reply = loop.create_future
        else:
            # The running backend's Event class: instantiating it directly skips anyio's
            # per-call backend lookup.
            self._new_reply = type(self._actor_done)
        self._send, self._recv = anyio.create_memory_object_stream[_Call](self._max_queued)
        self._send_nowait = self._send.send_nowait
        obs = self._observer
        if isinstance(obs, PullingObserver):
            self._snapshots = LoopSnapshots(
                self._cache.stats, lambda: self.queued, call_soon_threadsafe()
            )
            self._push_interval = obs.attach(self._snapshots)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._state = ServiceState.RUNNING
        tg.start_soon(self._actor, name="urc-actor")
        for worker in self._initial_workers:
            self.start_background(worker.run)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        try:
            await self.aclose()
        finally:
            suppress = await self._tg.__aexit__(exc_type, exc, tb)
        return suppress

    async def aclose(self) -> int:
        """Stop the service; returns the number of leases it released because they were
        still held (also :attr:`leases_released_at_close`).

        Order: cancel background workers and wait for them; refuse new calls and close the
        stream's sending side (once no caller is still waiting for room); let the actor apply
        everything already queued; release every remaining lease.  Idempotent, and shielded
        from cancellation (it only waits for bounded work).
        """
        if self._state is ServiceState.NEW:
            self._state = ServiceState.CLOSED
            return 0
        assert self._actor_done is not None
        with CancelScope(shield=True):
            if not self._closing:
                self._closing = True
                await self._stop_workers()
                if self._state is ServiceState.RUNNING:
                    self._state = ServiceState.CLOSING
                self._close_sending()  # the actor drains the stream, then shuts down
            await self._actor_done.wait()
        return self._released_at_close

    close = aclose

    @property
    def state(self) -> ServiceState:
        return self._state

    @property
    def failure(self) -> BaseException | None:
        """The exception that killed the actor (``None`` while healthy)."""
        return self._failure

    @property
    def background_failures(self) -> tuple[BaseException, ...]:
        """Exceptions that ended background workers (the service kept serving)."""
        return tuple(self._background_failures)

    @property
    def leases_held(self) -> int:
        """Leases issued and not yet released."""
        return len(self._executor.leases)

    @property
    def leases_released_at_close(self) -> int:
        """How many leases the close released on their holders' behalf."""
        return self._released_at_close

    @property
    def queued(self) -> int:
        """Commands waiting for the actor (buffered, plus callers waiting for room)."""
        return self._pending if self._pending > 0 else 0

    @property
    def cache(self) -> UnifiedRadixCache:
        """The owned core.  Only for inspection after close (or inside :meth:`call`)."""
        return self._cache

    # ================================================================== background work
    def start_background(
        self, fn: Callable[[AsyncUnifiedRadixCache], Awaitable[None]], name: str | None = None
    ) -> None:
        """Run ``await fn(self)`` in the service's task group until it returns or the
        service closes (then it is cancelled).  An exception escaping ``fn`` ends that
        worker only: it is logged and kept in :attr:`background_failures`, and the service
        keeps serving (a worker reaches the tree only through atomic commands, so its
        failure cannot leave the tree half-changed).  Raises :class:`ServiceClosedError`
        unless running."""
        self._check_open()
        assert self._tg is not None
        scope = CancelScope()
        self._worker_scopes.add(scope)
        self._tg.start_soon(self._run_worker, fn, scope, name=name)

    async def _run_worker(
        self, fn: Callable[[AsyncUnifiedRadixCache], Awaitable[None]], scope: CancelScope
    ) -> None:
        try:
            with scope:
                await fn(self)
        except Exception as exc:
            # A ServiceError after close or failure is a consequence, not a cause.
            if not (isinstance(exc, ServiceError) and self._state is not ServiceState.RUNNING):
                logger.error("background worker %r failed", fn, exc_info=exc)
                self._background_failures.append(exc)
        finally:
            self._worker_scopes.discard(scope)
            if not self._worker_scopes and self._workers_done is not None:
                self._workers_done.set()

    async def _stop_workers(self) -> None:
        if not self._worker_scopes:
            return
        self._workers_done = anyio.Event()
        for scope in list(self._worker_scopes):
            scope.cancel()
        await self._workers_done.wait()

    # ================================================================== public commands
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
        result: MatchOutcome = await self._submit(cmd)
        return result

    async def match_req(self, req: Req, *, cow_mamba: bool = False) -> MatchOutcome:
        """Match ``req.fill_ids`` and lock the hit on the request's behalf: sets
        ``prefix_indices``, ``cache_protected_len``, and the lock that ``cache_finished_req`` /
        ``cache_unfinished_req`` release.  Raises :class:`InvalidInputError` if ``req``
        already holds a lock."""
        if not isinstance(req, Req):
            raise InvalidInputError(f"match_req needs a Req, got {type(req)}")
        result: MatchOutcome = await self._submit(MatchReq(req, cow_mamba))
        return result

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
        ``CancelledError`` after the insert was applied, and the service frees what would
        have stayed the caller's (see the cancellation rules)."""
        cmd = Insert(
            _as_key(key, extra_key),
            value,
            prev_prefix_len,
            mamba_value,
            swa_evicted_seqlen,
            chunked,
            priority,
        )
        result: InsertOutcome = await self._submit(cmd)
        return result

    async def lock(self, node: NodeHandle) -> Lease:
        """Lock the node a match returned; raises :class:`~urc.errors.InvalidLockError` if it
        was evicted since."""
        if not isinstance(node, NodeHandle):
            raise InvalidInputError(f"lock needs a NodeHandle, got {type(node)}")
        result: Lease = await self._submit(Lock(node))
        return result

    async def release(self, lease: Lease) -> None:
        """Release ``lease`` (exactly once: a second release raises :class:`LeaseError`).

        The lease is marked released before the first ``await`` unless the caller is already
        cancelled; from then on the release is applied even if the caller is cancelled while
        it waits (check :attr:`Lease.released`)."""
        if lease._owner is not self:
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
        if lease._owner is not self:
            raise LeaseError(f"lease {lease.id} was not issued by this service")
        if self._state is not ServiceState.RUNNING and self._state is not ServiceState.CLOSING:
            raise self._not_running_error()
        lease.mark_released()
        self._give_back(Release(lease))

    async def evict(
        self, num_tokens: int = 0, swa_num_tokens: int = 0, mamba_num: int = 0
    ) -> EvictResult:
        """Evict at least these amounts where possible (never locked data)."""
        result: EvictResult = await self._submit(
            Evict(EvictParams(num_tokens, swa_num_tokens, mamba_num))
        )
        return result

    async def alloc(self, num_tokens: int, *, evict: bool = True) -> torch.Tensor:
        """Allocate ``num_tokens`` Full KV slots for the caller (evicting first when short);
        raises :class:`~urc.errors.OutOfMemoryError`.  The caller owns the slots."""
        if not isinstance(num_tokens, int):
            raise InvalidInputError(f"num_tokens must be an int, got {type(num_tokens)}")
        result: torch.Tensor = await self._submit(Alloc(num_tokens, evict))
        return result

    async def free(self, indices: torch.Tensor) -> None:
        """Give caller-owned slots back to the allocator."""
        if not isinstance(indices, torch.Tensor):
            raise InvalidInputError(f"indices must be a tensor, got {type(indices)}")
        await self._submit(Free(indices))

    async def alloc_mamba(self, num: int = 1, *, evict: bool = True) -> torch.Tensor:
        """Allocate ``num`` Mamba state slots for the caller (evicting tree states first when
        short); returns their indices (1-D int64).  The caller owns them: it passes one as
        an insert's ``mamba_value`` or gives them back with :meth:`free_mamba`.  Raises
        :class:`~urc.errors.OutOfMemoryError`, and :class:`InvalidInputError` when the cache
        has no Mamba component."""
        if not isinstance(num, int):
            raise InvalidInputError(f"num must be an int, got {type(num)}")
        result: torch.Tensor = await self._submit(AllocMamba(num, evict))
        return result

    async def free_mamba(self, indices: torch.Tensor) -> None:
        """Give caller-owned Mamba state slots back (all or nothing: a slot the tree owns or
        that is not allocated raises and frees none)."""
        if not isinstance(indices, torch.Tensor):
            raise InvalidInputError(f"indices must be a tensor, got {type(indices)}")
        await self._submit(FreeMamba(indices))

    async def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """``UnifiedRadixCache.cache_finished_req`` through the actor."""
        if not isinstance(req, Req):
            raise InvalidInputError(f"cache_finished_req needs a Req, got {type(req)}")
        await self._submit(CacheFinishedReq(req, is_insert))

    async def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """``UnifiedRadixCache.cache_unfinished_req`` through the actor."""
        if not isinstance(req, Req):
            raise InvalidInputError(f"cache_unfinished_req needs a Req, got {type(req)}")
        await self._submit(CacheUnfinishedReq(req, chunked))

    async def stats(self) -> CacheStats:
        """A :class:`CacheStats` snapshot."""
        result: CacheStats = await self._submit(Stats())
        return result

    async def sanity_check(self, held: Mapping[ComponentType, int] | None = None) -> None:
        """``sanity_check()`` plus the pool conservation check; a broken invariant fails the
        service (an ``AssertionError`` is a bug, not a caller error)."""
        await self._submit(SanityCheck(held))

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
        result: T = await self._submit(Call(fn, undo))
        return result

    # ================================================================== caller side
    def _check_open(self) -> None:
        if self._state is not ServiceState.RUNNING:
            raise self._not_running_error()

    def _not_running_error(self) -> ServiceClosedError | ServiceFailedError:
        if self._failure is not None:
            err = ServiceFailedError(f"the cache service failed: {self._failure!r}")
            err.__cause__ = self._failure
            return err
        return ServiceClosedError(f"the cache service is {self._state.value}")

    async def _submit(self, cmd: Command, checked: bool = False) -> Any:
        if not checked:  # ``checked``: the caller just did both checks (no await since)
            if self._state is not ServiceState.RUNNING:
                raise self._not_running_error()
            # Already cancelled: raise before sending, so nothing is applied for a caller
            # that was gone before it asked (no yield when not cancelled).
            await self._checkpoint_if_cancelled()
        reply = self._new_reply()
        call = _Call(cmd, perf_counter() if self._observer is not None else 0.0, reply)
        on_cancel = _ON_CANCEL[type(cmd)]
        # Send.  The fast path (``_post``, inlined) never yields, so nothing can happen
        # between the state check and the call entering the stream; the state is RUNNING,
        # so the stream is open.
        deferred: BaseException | None = None  # a native cancellation held back while sending
        if self._sending:  # callers wait for room: get in line behind them
            deferred = await self._send_waiting(call, on_cancel)
        else:
            try:
                self._send_nowait(call)
            except WouldBlock:
                deferred = await self._send_waiting(call, on_cancel)
            except (BrokenResourceError, ClosedResourceError):  # not while RUNNING
                raise self._not_running_error() from self._failure
            else:
                self._pending += 1
                if self._idle:  # handed straight to the waiting actor (see ``_handoff``)
                    self._idle = False
                    self._handoff = call
        try:
            if deferred is not None:
                raise deferred
            if self._on_asyncio:
                await reply
            else:
                await reply.wait()
        except self._cancelled_exc:
            if on_cancel is not _OnCancel.AWAIT:
                self._abandon(call, on_cancel)
                raise
            # Once sent, an ownership move is waited for (the actor always replies), so the
            # caller never stops waiting with the move half-known.  A cancelled anyio / trio
            # scope: the caller gets the outcome; its cancellation is delivered again at its
            # next checkpoint (scopes are level-triggered).  Same as waiting in a shielded
            # scope, without paying for one on every call.  A native asyncio cancellation
            # (``Task.cancel()``: nothing would deliver it again) is raised once the command
            # was applied, and what the result hands over is given back (``give_back``).
            native = deferred is not None or (
                self._on_asyncio and current_effective_deadline() != -math.inf
            )
            if not call.done and await self._outlast(call):
                native = True
            if native:
                self._discard(call)
                raise
        except BaseException:
            self._abandon(call, on_cancel)
            raise
        if call.error is not None:
            raise call.error
        return call.result

    async def _outlast(self, call: _Call) -> bool:
        """Wait in a shielded scope until the actor answered ``call``, through native asyncio
        cancellations too (a shield does not stop those); True if one arrived meanwhile."""
        native = False
        with CancelScope(shield=True):
            while not call.done:
                try:
                    if self._on_asyncio:  # a cancellation cancelled the previous future
                        call.reply = reply = self._new_reply()
                        await reply
                    else:
                        await call.reply.wait()
                except self._cancelled_exc:  # only a native one gets through the shield
                    native = True
        return native

    def _refuse(self, call: _Call) -> None:
        """``_send_nowait`` before the stream exists (never reached: the state is NEW)."""
        raise self._not_running_error()

    def _post(self, call: _Call) -> bool:
        """``send_nowait``: False when the buffer is full (nothing sent then)."""
        try:
            self._send_nowait(call)
        except WouldBlock:
            return False
        except (BrokenResourceError, ClosedResourceError):  # not while RUNNING; defensive
            raise self._not_running_error() from self._failure
        self._pending += 1
        if self._idle:  # handed straight to the waiting actor (see ``_handoff``)
            self._idle = False
            self._handoff = call
        return True

    async def _send_waiting(self, call: _Call, on_cancel: _OnCancel) -> BaseException | None:
        """The slow path: wait for room in the stream (``await send``), in line behind any
        caller already waiting (``_sending``), so the stream keeps send order.

        Returns a native asyncio cancellation that hit an ownership move meanwhile: the call
        was sent all the same and the caller raises it once the call was answered."""
        assert self._send is not None
        self._pending += 1
        self._sending += 1
        deferred: BaseException | None = None
        try:
            if on_cancel is _OnCancel.SKIP:
                await self._send.send(call)
            elif on_cancel is _OnCancel.APPLY:  # a release is sent for sure once asked for
                with CancelScope(shield=True):
                    await self._send.send(call)
            else:  # an ownership move: sent for sure, through native cancellations too
                with CancelScope(shield=True):
                    while True:
                        try:
                            await self._send.send(call)
                            break
                        except self._cancelled_exc as exc:  # native (through the shield)
                            deferred = exc
                            if self._in_stream(call):
                                break  # the stream took it before the cancellation landed
        except (BrokenResourceError, ClosedResourceError):
            self._pending -= 1  # refused: the stream never took it
            raise self._not_running_error() from self._failure
        except BaseException:
            # Cancelled (a command that may be abandoned, or a native asyncio cancellation of
            # a release): the stream may have taken the call or not.  Withdraw it either way:
            # the actor skips it if it has it.
            call.abandoned = True
            cmd = call.command
            if call.done:
                self._discard(call)
            elif isinstance(cmd, Release):  # the lease is marked released: release it anew
                self._give_back(cmd)
            raise
        finally:
            self._sending -= 1
            if not self._sending and self._state is not ServiceState.RUNNING:
                self._close_sending()
        return deferred

    def _in_stream(self, call: _Call) -> bool:
        """Whether the stream took ``call`` (answered, or buffered): asked only after a native
        cancellation interrupted ``await send``, which may hit just after the actor moved the
        call from the waiting senders into the buffer."""
        if call.done:
            return True
        state = getattr(self._send, "_state", None)
        buffer = getattr(state, "buffer", ())
        return any(queued is call for queued in buffer)

    def _close_sending(self) -> None:
        """Close the sending side once closing and no caller still waits for room: the actor
        then drains what is queued and gets ``EndOfStream``."""
        if self._sending == 0 and self._send is not None:
            self._send.close()

    def _abandon(self, call: _Call, on_cancel: _OnCancel) -> None:
        """Its caller stopped waiting for ``call`` (cancelled)."""
        if call.done:
            self._discard(call)
        elif on_cancel is _OnCancel.SKIP:
            call.abandoned = True  # the actor skips it
        # APPLY (a release) is applied anyway: the lease is already marked released.

    def _discard(self, call: _Call) -> None:
        """The reply arrived but its caller is gone: give back what the result hands over
        (a lease, slots: :func:`~urc.executor.give_back`)."""
        if call.error is not None:
            if call.command.kind is not CommandKind.RELEASE:
                logger.debug("%s failed for a cancelled caller: %r", call.command.kind, call.error)
            return
        for cmd in give_back(call.command, call.result):
            self._give_back(cmd)

    def _give_back(self, cmd: Command) -> None:
        """Apply ``cmd`` (a release or a free) for a caller that is gone: queued without
        waiting, or parked for the start of the actor's next batch when the stream is full
        or closing, or applied here once the actor has finished (nothing else touches the
        core then).  Never yields and never raises."""
        state = self._state
        if state is ServiceState.FAILED or state is ServiceState.NEW:
            return  # failed: the core is not to be touched any more
        if state is ServiceState.RUNNING and self._post(_Call(cmd, perf_counter(), None)):
            return
        assert self._actor_done is not None
        if not self._actor_done.is_set():
            self._orphans.append(cmd)
            return
        with contextlib.suppress(URCError):  # e.g. a lease the close already released
            self._executor.apply(cmd)

    # ================================================================== actor side
    async def _actor(self) -> None:
        assert self._actor_done is not None and self._recv is not None
        recv = self._recv
        receive_nowait = recv.receive_nowait
        max_batch = self._max_batch
        hooked = self._observer is not None or self._trace is not None
        apply = self._apply_hooked if hooked else self._apply
        on_asyncio = self._on_asyncio
        try:
            try:
                while True:
                    # First call of a batch: block on ``receive()`` only when nothing is queued.
                    call: _Call | None = None
                    if self._pending > 0:
                        try:
                            call = receive_nowait()
                        except WouldBlock:  # a sender still on its way in, or a count off
                            if not self._sending:
                                self._pending = 0
                    if call is None:
                        if self._push_due:
                            self._push_stats()  # going idle: hand over the final figures
                        self._idle = True
                        try:
                            call = await recv.receive()
                        except BaseException:
                            self._idle = False  # ``_handoff`` stays for the cancel handler
                            raise
                        self._idle = False
                        self._handoff = None
                    # Apply it and every call already queued (at most max_batch), then yield
                    # once: the callers just answered run, and their next commands form the
                    # next batch.  Give-backs parked meanwhile go first.
                    if self._orphans:
                        self._apply_orphans()
                    self._pending -= 1
                    apply(call)
                    n = 1
                    while self._pending > 0 and n < max_batch:
                        try:
                            call = receive_nowait()
                        except WouldBlock:
                            if not self._sending:
                                self._pending = 0
                            break
                        self._pending -= 1
                        apply(call)
                        n += 1
                    if hooked:
                        self._end_batch()
                    if on_asyncio:
                        await asyncio.sleep(0)
                    else:
                        await checkpoint()
            except (EndOfStream, ClosedResourceError):
                # EndOfStream: closing, and everything queued was applied.
                # ClosedResourceError: the service failed (``_fail`` closed the stream).
                pass
            if self._state is not ServiceState.FAILED:
                self._shutdown()
        except self._cancelled_exc:
            # Cancelled from outside (the host scope): refuse what is queued, free leases.
            with CancelScope(shield=True):
                self._shutdown_cancelled()
            raise
        except Exception as exc:
            self._fail(exc)
        finally:
            self._idle = False
            self._handoff = None
            recv.close()
            if self._send is not None:
                self._send.close()
            self._actor_done.set()

    def _apply(self, call: _Call) -> None:
        """Apply one call: the path without observer or trace hook."""
        if call.abandoned:
            return  # its caller left before we got here: skipping is "never happened"
        try:
            result = self._executor.apply(call.command)
        except URCError as exc:
            self._deliver(call, None, exc)
            return
        except BaseException as exc:
            # Not a typed error: the core may be half-updated.  This caller learns it here;
            # the actor loop fails everyone else.
            self._deliver(call, None, self._failed_error(exc))
            raise
        self._deliver(call, result, None)

    def _apply_hooked(self, call: _Call) -> None:
        """Apply one call, timing it for the observer and reporting it to the trace hook."""
        if call.abandoned:
            return
        cmd = call.command
        obs = self._observer
        t0 = perf_counter() if obs is not None else 0.0
        result: Any = None
        error: BaseException | None = None
        try:
            try:
                result = self._executor.apply(cmd)
            except URCError as exc:
                error = exc
            if obs is not None:
                self._last_t = t1 = perf_counter()
                obs.on_command(cmd.kind, t0 - call.sent_at, t1 - t0, error)
            if self._trace is not None:
                self._trace(cmd, result, error)
        except BaseException as exc:
            # Not a typed error (or a failing hook): the core may be half-updated.  This
            # caller learns it here; the actor loop fails everyone else.
            self._deliver(call, None, self._failed_error(exc))
            raise
        self._deliver(call, result, error)

    def _deliver(self, call: _Call, result: Any, error: BaseException | None) -> None:
        call.result = result
        call.error = error
        call.done = True
        reply = call.reply
        if reply is None:
            return  # sent on behalf of a caller that is gone (``_give_back``)
        if self._on_asyncio:
            if not reply.done():  # a cancelled caller cancelled its future
                reply.set_result(None)
        else:
            reply.set()

    def _end_batch(self) -> None:
        obs = self._observer
        if obs is not None:
            interval = self._push_interval
            if interval is None:
                return  # the observer pulls snapshots when it needs them
            if self._last_t - self._pushed_at >= interval:
                self._push_stats()
            else:
                self._push_due = True

    def _apply_orphans(self) -> None:
        orphans, self._orphans = self._orphans, []
        for cmd in orphans:
            # Applied like a queued command so traces and observers see it.
            self._apply_hooked(_Call(cmd, perf_counter(), None))

    def _push_stats(self) -> None:
        """Hand the observer a fresh snapshot (``on_batch``)."""
        assert self._observer is not None
        self._push_due = False
        self._pushed_at = self._last_t
        self._observer.on_batch(self._cache.stats(), self.queued)

    def _final_stats(self) -> None:
        """The service stopped (the tree is final): give observers the last figures."""
        if self._observer is None:
            return
        if self._snapshots is not None:
            self._snapshots.finish()
        if self._push_interval is not None:
            self._push_stats()

    def _shutdown(self) -> None:
        """The stream is drained and closed: release what callers still hold."""
        self._apply_orphans()
        n = self._executor.release_all()
        self._released_at_close = n
        if n:
            logger.info("cache service closed with %d leases held; released them", n)
        self._final_stats()
        if self._state is not ServiceState.FAILED:
            self._state = ServiceState.CLOSED

    def _drain(self, error: BaseException) -> None:
        """Answer every call still in the stream (and the one handed to a waiting actor)
        with ``error``; senders still waiting for room are let in and answered too."""
        assert self._recv is not None
        handoff, self._handoff = self._handoff, None
        if handoff is not None and not handoff.done:
            self._deliver(handoff, None, error)
        while True:
            try:
                call = self._recv.receive_nowait()
            except (WouldBlock, EndOfStream, ClosedResourceError):
                break
            if not call.done:
                self._deliver(call, None, error)
        self._pending = 0

    def _shutdown_cancelled(self) -> None:
        self._closing = True
        if self._state is ServiceState.RUNNING:
            self._state = ServiceState.CLOSING
        self._drain(ServiceClosedError("the cache service was cancelled before this command ran"))
        assert self._recv is not None
        self._recv.close()  # callers still on their way in are refused
        for scope in self._worker_scopes:
            scope.cancel()
        self._shutdown()

    def _failed_error(self, cause: BaseException) -> ServiceFailedError:
        err = ServiceFailedError(f"the cache service failed: {cause!r}")
        err.__cause__ = cause
        return err

    def _fail(self, exc: BaseException) -> None:
        """Stop for good: fail every queued call, refuse new ones, cancel workers."""
        if self._state is ServiceState.FAILED:
            return
        logger.error("cache service failed", exc_info=exc)
        self._failure = exc
        self._state = ServiceState.FAILED
        if self._recv is not None:
            self._drain(self._failed_error(exc))
            # Wakes an actor waiting in ``receive()`` (a background worker failed) and refuses
            # callers still on their way in.
            self._recv.close()
        if self._snapshots is not None:
            with contextlib.suppress(Exception):  # the core may be half-updated
                self._snapshots.finish()
        for scope in self._worker_scopes:
            scope.cancel()
