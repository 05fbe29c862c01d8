"""``AsyncUnifiedRadixCache``: an awaitable cache whose tree is owned by one actor task.

Usage::

    async with AsyncUnifiedRadixCache(CacheConfig(kv_size=1 << 16)) as svc:
        hit = await svc.match([1, 2, 3], lock=True)     # MatchOutcome with a Lease
        ...
        await hit.lease.release()

Design (ARCHITECTURE §6)
------------------------
Every public coroutine builds a frozen command (:mod:`urc.commands`), appends it to the
actor's queue (a deque: sending never blocks or yields, so nothing happens between the
caller's checks and the command entering the queue) and awaits a one-shot reply: on asyncio
a bare ``asyncio.Future`` of the running loop, elsewhere (trio) an ``anyio.Event``; the
result travels in the call object (``python -m urc.service_bench --replies`` compares reply
objects).  One actor task takes the commands and applies them strictly in order, one at a
time, through a :class:`~urc.executor.CommandExecutor`: it applies every command already
queued in one wake-up (at most ``max_batch``), then yields once, so the callers it just
answered run and their next commands form its next batch; it sleeps on a wake-up (set by the
next sender) only when the queue is empty.  Because applying a command never awaits, no
other task ever sees the tree mid-command and no lock is needed.  Backpressure: at most
``max_queued`` commands are queued; later senders wait in line (FIFO) for a place, which is
the same wait as for their reply.

Handles, not nodes: results carry device indices, hit lengths, an opaque
:class:`~urc.lease.NodeHandle` and, when asked, a :class:`~urc.lease.Lease` (released exactly
once).  ``Req`` objects passed to ``match_req`` / ``cache_*_req`` do hold tree nodes
(``req.last_node``): the request belongs to the server, but only the actor may read or write
``last_node`` / ``lock_receipt`` -- callers must never touch them.

Cancellation (nothing leaks, nothing is half-applied).  A caller whose scope is already
cancelled raises before sending anything.  After sending, by command (``_ON_CANCEL``):

- Commands that move ownership of slots or requests between caller and tree (insert,
  match_req, alloc, free, cache_finished_req, cache_unfinished_req, call): a cancelled caller
  still waits for the outcome and gets it; its cancellation lands at its next checkpoint.
  The actor always answers (it drains the queue at close and fails every queued call if it
  dies), so the wait is bounded.  (Rather than entering a shielded scope on every call, the
  caller catches the cancellation and, only then, waits on in a shielded scope; anyio and
  trio scopes deliver it again at the next checkpoint.  A native asyncio ``Task.cancel()``,
  with no cancelled scope to deliver it again, goes through, as it would through a shield.)
- A release is applied even if its caller is cancelled meanwhile (the lease was marked
  released before sending).
- Other commands (match, lock, evict, stats, sanity_check) may be abandoned: a caller
  cancelled before the actor took its command marks it abandoned and the actor skips it.  If
  the reply was already delivered when the cancellation hit (the window between the actor
  taking a lock and the caller resuming), the caller's handler releases the lease it never
  received by queueing a release (or parking it for the actor's next batch when the queue is
  full).
- Every command is atomic: the core raises a :class:`~urc.errors.URCError` before changing
  anything, or applies the command fully.

Errors: a ``URCError`` raised for one command reaches that caller only and the actor keeps
serving.  Any other exception (an ``AssertionError`` from an invariant, a bug, a failing
observer or background worker) fails the service: the failing call and every queued or
later call get :class:`~urc.errors.ServiceFailedError` with the cause chained.  Calls after
close (or before start) raise :class:`~urc.errors.ServiceClosedError`.

Background work (HiCache): :meth:`start_background` (or ``workers=``) runs coroutines in the
service's task group; they reach the tree only through commands (``await svc.call(fn)`` runs
``fn(cache)`` inside the actor).  Close cancels them first (their cancellation handlers may
still make shielded calls), then drains the queue, then releases every lease still held
(pins included) and reports how many.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from enum import Enum
from time import perf_counter
from types import TracebackType
from typing import Any, Protocol, TypeVar

import anyio
import torch
from anyio import CancelScope, current_effective_deadline
from anyio.abc import TaskGroup
from anyio.lowlevel import checkpoint, checkpoint_if_cancelled

try:  # the running backend's class: calling it directly skips a per-call backend lookup
    from anyio._core._eventloop import get_async_backend as _get_async_backend
except ImportError:  # pragma: no cover - not where anyio 4 keeps it
    _get_async_backend = None  # type: ignore[assignment]

from urc.cache import UnifiedRadixCache
from urc.commands import (
    Alloc,
    CacheFinishedReq,
    CacheUnfinishedReq,
    Call,
    Command,
    CommandKind,
    Evict,
    Free,
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
from urc.executor import CommandExecutor
from urc.key import ExtraKey, RadixKey
from urc.lease import Lease, NodeHandle
from urc.observer import ServiceObserver
from urc.params import EvictParams, EvictResult
from urc.req import Req
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
    CacheFinishedReq: _OnCancel.AWAIT,
    CacheUnfinishedReq: _OnCancel.AWAIT,
    Call: _OnCancel.AWAIT,
}


class ServiceState(Enum):
    """Lifecycle of the service."""

    NEW = "new"  # constructed, not entered
    RUNNING = "running"
    CLOSING = "closing"  # no new calls; the actor drains the queue
    CLOSED = "closed"
    FAILED = "failed"  # the actor (or a background worker) died; see ``failure``


class BackgroundWorker(Protocol):
    """A background coroutine of the service (HiCache backup, host eviction, prefetch)."""

    async def run(self, svc: AsyncUnifiedRadixCache) -> None: ...


class _Call:
    """One in-flight command: the one-shot reply slot the actor fills.

    ``reply`` wakes the caller: a bare ``asyncio.Future`` on asyncio (awaited directly; a
    cancelled caller cancels it, so the actor only sets it if not done), an ``anyio.Event``
    otherwise (trio)."""

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


def _running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop running the current task, or ``None`` (trio, trio guest mode)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return None
    return None if task is None else task.get_loop()


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
    runs, nothing else may touch the core.  ``max_queued`` bounds the command queue (callers
    wait when it is full); ``max_batch`` bounds how many commands the actor applies before
    yielding to the event loop.  ``observer`` gets per-command and per-batch callbacks
    (:mod:`urc.observer`).  ``workers`` are started as background coroutines on entry.
    ``trace`` is a test hook (see :data:`TraceHook`).
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
        # Leases whose caller vanished while the queue was full; released at the next batch.
        self._orphans: list[Lease] = []
        self._worker_scopes: set[CancelScope] = set()
        self._workers_done: anyio.Event | None = None
        self._tg: TaskGroup | None = None
        self._actor_done: anyio.Event | None = None
        # The command queue: at most ``max_queued`` calls; later senders wait in line in
        # ``_overflow`` (FIFO, the actor moves one in per command it takes).  Every sender
        # awaits its own reply, so the wait "to send" and the wait for the reply are one.
        self._queue: deque[_Call] = deque()
        self._overflow: deque[_Call] = deque()
        # Set while the actor sleeps on an empty queue: the next sender wakes it.
        self._wakeup: Any = None
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
        loop = _running_asyncio_loop()
        if loop is not None:
            self._on_asyncio = True
            self._new_reply = loop.create_future
        else:
            # The running backend's Event class: instantiating it directly skips anyio's
            # per-call backend lookup.
            self._new_reply = type(self._actor_done)
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

        Order: cancel background workers and wait for them; refuse new calls; let the actor
        apply everything already queued; release every remaining lease.  Idempotent, and
        shielded from cancellation (it only waits for bounded work).
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
                self._wake_actor()  # it drains the queue, then shuts down
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
    def leases_held(self) -> int:
        """Leases issued and not yet released."""
        return len(self._executor.leases)

    @property
    def leases_released_at_close(self) -> int:
        """How many leases the close released on their holders' behalf."""
        return self._released_at_close

    @property
    def queued(self) -> int:
        """Commands waiting for the actor (buffered plus blocked senders)."""
        return len(self._queue) + len(self._overflow)

    @property
    def cache(self) -> UnifiedRadixCache:
        """The owned core.  Only for inspection after close (or inside :meth:`call`)."""
        return self._cache

    # ================================================================== background work
    def start_background(
        self, fn: Callable[[AsyncUnifiedRadixCache], Awaitable[None]], name: str | None = None
    ) -> None:
        """Run ``await fn(self)`` in the service's task group until it returns or the
        service closes (then it is cancelled).  An exception escaping ``fn`` fails the
        service.  Raises :class:`ServiceClosedError` unless running."""
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
                self._fail(exc)
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
        ``prev_prefix_len`` are freed; an unaligned tail stays the caller's).  Not abandoned
        on cancellation: the caller always learns whether the tree took the slots."""
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

    async def call(self, fn: Callable[[UnifiedRadixCache], T]) -> T:
        """Run ``fn(cache)`` inside the actor and return its result (internal use: HiCache
        workers, tests).  ``fn`` must not keep node references past the call."""
        result: T = await self._submit(Call(fn))
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
        # Send.  Never blocks (see ``_queue``), so nothing can happen between the state check
        # and the command entering the queue.
        queue = self._queue
        if len(queue) < self._max_queued and not self._overflow:
            queue.append(call)
        else:
            self._overflow.append(call)
        if self._wakeup is not None:
            self._wake_actor()
        on_cancel = _ON_CANCEL[type(cmd)]
        try:
            if self._on_asyncio:
                await reply
            else:
                await reply.wait()
        except self._cancelled_exc:
            if on_cancel is not _OnCancel.AWAIT:
                self._abandon(call, on_cancel)
                raise
            # Once sent, the caller must learn whether ownership moved, so the cancellation is
            # deferred: wait for the reply (the actor always replies) and return it; the
            # cancellation is delivered again at the caller's next checkpoint (anyio and trio
            # cancel scopes are level-triggered).  Same as waiting in a shielded scope,
            # without paying for one on every call.  A native asyncio cancellation (no scope
            # cancelled: nothing would deliver it again) goes through, as it would through a
            # shielded scope.
            if self._on_asyncio and current_effective_deadline() != -math.inf:
                raise
            if not call.done:
                with CancelScope(shield=True):
                    if self._on_asyncio:  # the cancellation cancelled the future
                        call.reply = reply = self._new_reply()
                        await reply
                    else:
                        await reply.wait()
        except BaseException:
            self._abandon(call, on_cancel)
            raise
        if call.error is not None:
            raise call.error
        return call.result

    def _abandon(self, call: _Call, on_cancel: _OnCancel) -> None:
        """Its caller stopped waiting for ``call`` (cancelled)."""
        if call.done:
            self._discard(call)
        elif on_cancel is _OnCancel.SKIP:
            call.abandoned = True  # the actor skips it
        # APPLY (a release) is applied anyway: the lease is already marked released.

    def _wake_actor(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None
            if self._on_asyncio:
                if not wakeup.done():
                    wakeup.set_result(None)
            else:
                wakeup.set()

    def _discard(self, call: _Call) -> None:
        """The reply arrived but its caller is gone: give back a lease it would hold."""
        lease = _leased(call.result)
        if lease is None or lease.released:
            return
        lease.mark_released()
        if self._state is not ServiceState.RUNNING:
            return  # closing: the actor releases every remaining lease; failed: nothing to do
        if len(self._queue) >= self._max_queued or self._overflow:
            self._orphans.append(lease)  # the actor is busy; it releases it after this batch
            return
        self._queue.append(_Call(Release(lease), perf_counter(), None))
        self._wake_actor()

    # ================================================================== actor side
    async def _actor(self) -> None:
        assert self._actor_done is not None
        queue = self._queue
        overflow = self._overflow
        max_batch = self._max_batch
        apply = self._apply
        on_asyncio = self._on_asyncio
        new_reply = self._new_reply
        running = ServiceState.RUNNING
        try:
            while True:
                if not queue:
                    if self._state is not running:
                        break  # closing (the queue is drained) or failed
                    self._wakeup = wakeup = new_reply()
                    if on_asyncio:
                        await wakeup
                    else:
                        await wakeup.wait()
                    continue
                # Apply every command already queued (at most max_batch), then yield once:
                # the callers just answered run, and their next commands form the next batch.
                n = 0
                while queue and n < max_batch:
                    call = queue.popleft()
                    if overflow:
                        queue.append(overflow.popleft())
                    apply(call)
                    n += 1
                self._end_batch()
                if on_asyncio:
                    await asyncio.sleep(0)
                else:
                    await checkpoint()
            if self._state is not ServiceState.FAILED:
                self._shutdown()
        except anyio.get_cancelled_exc_class():
            # Cancelled from outside (the host scope): refuse what is queued, free leases.
            with CancelScope(shield=True):
                self._shutdown_cancelled()
            raise
        except Exception as exc:
            self._fail(exc)
        finally:
            self._wakeup = None
            self._actor_done.set()

    def _apply(self, call: _Call) -> None:
        if call.abandoned:
            return  # its caller left before we got here: skipping is "never happened"
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
            if self._trace is not None:
                self._trace(cmd, result, error)
            if obs is not None:
                obs.on_command(cmd.kind, t0 - call.sent_at, perf_counter() - t0, error)
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
            return  # sent on behalf of a caller that is gone (``_discard``)
        if self._on_asyncio:
            if not reply.done():  # a cancelled caller cancelled its future
                reply.set_result(None)
        else:
            reply.set()

    def _end_batch(self) -> None:
        if self._orphans:
            orphans, self._orphans = self._orphans, []
            for lease in orphans:
                # Applied like a queued Release so traces and observers see it.
                self._apply(_Call(Release(lease), perf_counter(), None))
        obs = self._observer
        if obs is not None:
            obs.on_batch(self._cache.stats(), self.queued)

    def _shutdown(self) -> None:
        """The queue is drained and closed: release what callers still hold."""
        self._end_batch()
        n = self._executor.release_all()
        self._released_at_close = n
        if n:
            logger.info("cache service closed with %d leases held; released them", n)
        if self._state is not ServiceState.FAILED:
            self._state = ServiceState.CLOSED

    def _take_all(self) -> list[_Call]:
        calls = [*self._queue, *self._overflow]
        self._queue.clear()
        self._overflow.clear()
        return calls

    def _shutdown_cancelled(self) -> None:
        self._closing = True
        if self._state is ServiceState.RUNNING:
            self._state = ServiceState.CLOSING
        closed = ServiceClosedError("the cache service was cancelled before this command ran")
        for call in self._take_all():
            if not call.done:
                self._deliver(call, None, closed)
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
        for call in self._take_all():
            self._deliver(call, None, self._failed_error(exc))
        self._wake_actor()  # it exits (a background worker failed while it slept)
        for scope in self._worker_scopes:
            scope.cancel()
