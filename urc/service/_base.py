"""The service's state, shared by its rooms: the transport (:mod:`urc.service._transport`),
the actor (:mod:`urc.service._actor`), worker supervision (:mod:`urc.service._workers`) and
the lifecycle (:mod:`urc.service._lifecycle`) are mixins over :class:`ServiceBase`, so one
object holds every field and no call on the hot path goes through a second object."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, cast

import anyio
from anyio import CancelScope
from anyio.abc import TaskGroup
from anyio.lowlevel import checkpoint_if_cancelled
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from urc.cache import UnifiedRadixCache, build_cache
from urc.config import CacheConfig
from urc.errors import InvalidInputError, ServiceClosedError, ServiceFailedError
from urc.service._call import ServiceCall
from urc.service._commands import Command
from urc.service._executor import CommandExecutor
from urc.service._observer import ServiceObserver
from urc.service._snapshots import LoopSnapshots

if TYPE_CHECKING:
    from urc.service._lease import LeaseOwner

__all__ = [
    "BackgroundWorker",
    "LoadBackPolicy",
    "ServiceBase",
    "ServiceState",
    "TraceHook",
    "WorkerFn",
]

# Trace hook: called by the actor after applying each command, before the reply is delivered,
# with (command, result, error).  For tests (history recording, fault injection).
TraceHook = Callable[[Command, Any, BaseException | None], None]


# A worker is given the service (an ``AsyncUnifiedRadixCache``); typed ``Any`` here because
# this module sits below the facade it is a part of (a worker's own signature names it).
WorkerFn = Callable[[Any], Awaitable[None]]


class BackgroundWorker(Protocol):
    """A background coroutine of the service (HiCache backup, host eviction, prefetch):
    ``run(svc)`` gets the :class:`~urc.service.AsyncUnifiedRadixCache` it runs in."""

    async def run(self, svc: Any) -> None: ...


class ServiceState(Enum):
    """Lifecycle of the service."""

    NEW = "new"  # constructed, not entered
    RUNNING = "running"
    CLOSING = "closing"  # no new calls; the actor drains the stream
    CLOSED = "closed"
    FAILED = "failed"  # the actor (or a background worker) died; see ``failure``


@dataclass(frozen=True, slots=True)
class LoadBackPolicy:
    """How ``match_req(..., load_back=True)`` loads a host hit back to device.

    ``threshold``: host spans shorter than this many tokens stay on host.
    ``copy_in_thread``: copy the bytes in a worker thread (the event loop keeps serving;
    when the copy ends relative to other commands then depends on the machine) instead of
    inside the event loop (the order of every command is a function of the workload).
    """

    threshold: int = 0
    copy_in_thread: bool = False

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise InvalidInputError(f"load-back threshold must be >= 0, got {self.threshold}")


class ServiceBase:
    """Every field of the service (see the package docstring for what they mean)."""

    def __init__(
        self,
        cache: UnifiedRadixCache | CacheConfig,
        *,
        max_queued: int = 1024,
        max_batch: int = 256,
        observer: ServiceObserver | None = None,
        workers: Sequence[BackgroundWorker] = (),
        trace: TraceHook | None = None,
        load_back: LoadBackPolicy | None = None,
    ) -> None:
        if max_queued < 1 or max_batch < 1:
            raise InvalidInputError(f"max_queued and max_batch must be >= 1: {max_queued}")
        self._cache = build_cache(cache) if isinstance(cache, CacheConfig) else cache
        # Leases name the service as their releaser: the facade (the concrete subclass)
        # implements ``LeaseOwner``.
        self._executor = CommandExecutor(self._cache, cast("LeaseOwner", self))
        self._max_queued = max_queued
        self._max_batch = max_batch
        self._observer = observer
        self._trace = trace
        self._load_back = load_back if load_back is not None else LoadBackPolicy()
        self._initial_workers = tuple(workers)
        self._state = ServiceState.NEW
        self._failure: BaseException | None = None
        self._released_at_close = 0
        self._closing = False
        # Give-backs for callers that are gone (releases, frees: ``_give_back``) that found
        # the stream full or closing: applied at the start of the next batch, or at shutdown.
        self._orphans: list[Command] = []
        self._worker_scopes: set[CancelScope] = set()
        # Workers that ``detach_worker`` can stop, by id: (worker, its scope, set when its
        # ``run`` ended).
        self._attached: dict[int, tuple[Any, CancelScope, anyio.Event]] = {}
        self._background_failures: list[BaseException] = []
        self._workers_done: anyio.Event | None = None
        self._tg: TaskGroup | None = None
        self._actor_done: anyio.Event | None = None
        # The command stream (created on entry).  ``_pending``: calls sent or being sent and
        # not yet taken by the actor -- the senders add, the actor subtracts; it drives the
        # batch drain and ``queued``.  (A caller cancelled while waiting for room cannot
        # tell whether the stream took its call; the actor corrects the count when it finds
        # the stream empty.)  ``_sending``: callers inside ``await send`` (the slow path).
        self._send: MemoryObjectSendStream[ServiceCall] | None = None
        self._recv: MemoryObjectReceiveStream[ServiceCall] | None = None
        self._send_nowait: Callable[[ServiceCall], None] = self._refuse
        self._pending = 0
        self._sending = 0
        # While the actor waits in ``receive()`` the next call is handed to it directly,
        # outside the buffer: kept here until the actor has it, so that a cancellation of
        # the actor at that moment still answers that call.
        self._idle = False
        self._handoff: ServiceCall | None = None
        # Observer: ``_push_interval`` None: never push snapshots (the observer pulls);
        # 0.0: after every batch (plain observers); else at most that often, plus when the
        # actor goes idle.  ``_last_t``: end of the latest command (perf_counter).
        self._snapshots: LoopSnapshots | None = None
        self._push_interval: float | None = 0.0
        self._pushed_at = -math.inf
        self._push_due = False
        self._last_t = 0.0
        # Reply primitives of the running backend (see ``ServiceCall``), chosen on entry.
        self._on_asyncio = False
        self._new_reply: Callable[[], Any] = anyio.Event
        self._checkpoint_if_cancelled: Callable[[], Awaitable[None]] = checkpoint_if_cancelled
        self._cancelled_exc: type[BaseException] = BaseException  # set on entry

    @property
    def queued(self) -> int:
        """Commands waiting for the actor (buffered, plus callers waiting for room)."""
        return self._pending if self._pending > 0 else 0

    # ------------------------------------------------------------------ shared checks
    def _check_open(self) -> None:
        if self._state is not ServiceState.RUNNING:
            raise self._not_running_error()

    def _not_running_error(self) -> ServiceClosedError | ServiceFailedError:
        if self._failure is not None:
            return self._failed_error(self._failure)
        return ServiceClosedError(f"the cache service is {self._state.value}")

    def _failed_error(self, cause: BaseException) -> ServiceFailedError:
        err = ServiceFailedError(f"the cache service failed: {cause!r}")
        err.__cause__ = cause
        return err

    def _refuse(self, call: ServiceCall) -> None:
        """``_send_nowait`` before the stream exists (never reached: the state is NEW)."""
        raise self._not_running_error()
