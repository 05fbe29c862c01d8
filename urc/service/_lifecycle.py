"""The service's lifecycle: start (actor, workers), close (workers first, then the stream
drained, then leases still held released), and the figures a caller may read meanwhile."""

from __future__ import annotations

from types import TracebackType
from typing import Self

import anyio
from anyio import CancelScope

from urc.cache import UnifiedRadixCache
from urc.errors import ServiceClosedError
from urc.service._actor import Actor
from urc.service._anyio_private import backend_checkpoint_if_cancelled
from urc.service._base import ServiceState
from urc.service._call import ServiceCall
from urc.service._observer import PullingObserver
from urc.service._snapshots import LoopSnapshots, call_soon_threadsafe, running_asyncio_loop
from urc.service._transport import Transport
from urc.service._workers import WorkerSupervisor

__all__ = ["Lifecycle"]


class Lifecycle(Actor, Transport, WorkerSupervisor):
    """Entering and leaving the service (a mixin of the service)."""

    async def __aenter__(self) -> Self:
        """Start the actor (and ``workers``) in a new task group; a service starts once."""
        if self._state is not ServiceState.NEW:
            raise ServiceClosedError(f"service cannot be started again ({self._state.value})")
        self._actor_done = anyio.Event()
        self._cancelled_exc = anyio.get_cancelled_exc_class()
        self._checkpoint_if_cancelled = backend_checkpoint_if_cancelled()
        loop = running_asyncio_loop()
        if loop is not None:
            self._on_asyncio = True
            self._new_reply = loop.create_future
        else:
            # The running backend's Event class: instantiating it directly skips anyio's
            # per-call backend lookup.
            self._new_reply = type(self._actor_done)
        self._send, self._recv = anyio.create_memory_object_stream[ServiceCall](self._max_queued)
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
            self._start_worker(worker)
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
    def leases_held(self) -> int:
        """Leases issued and not yet released by their holders: a lease whose release is
        still queued to the actor (``async with lease:`` just exited, or a give-back) no
        longer counts.  O(leases held)."""
        return sum(not entry[0].released for entry in self._executor.leases.values())

    @property
    def leases_released_at_close(self) -> int:
        """How many leases the close released on their holders' behalf."""
        return self._released_at_close

    @property
    def cache(self) -> UnifiedRadixCache:
        """The owned core.  Only for inspection after close (or inside :meth:`call`)."""
        return self._cache
