"""Background workers of the service (HiCache backup, host eviction, prefetch): started in
the service's task group, cancelled first at close; an exception ends that worker only."""

from __future__ import annotations

import logging

import anyio
from anyio import CancelScope

from urc.errors import ServiceError
from urc.service._base import BackgroundWorker, ServiceBase, ServiceState, WorkerFn

__all__ = ["WorkerSupervisor"]

logger = logging.getLogger("urc.service")


class WorkerSupervisor(ServiceBase):
    """Starts, supervises and stops background workers (a mixin of the service)."""

    def start_background(self, fn: WorkerFn, name: str | None = None) -> None:
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
        self._tg.start_soon(self._run_worker, fn, scope, None, name=name)

    def _start_worker(self, worker: BackgroundWorker) -> None:
        """:meth:`start_background` of ``worker.run``, kept where :meth:`_stop_worker`
        finds it (``workers=`` and ``attach_worker``)."""
        self._check_open()
        assert self._tg is not None
        scope = CancelScope()
        done = anyio.Event()
        self._worker_scopes.add(scope)
        self._attached[id(worker)] = (worker, scope, done)
        self._tg.start_soon(self._run_worker, worker.run, scope, done, name=repr(worker))

    def _is_attached(self, worker: object) -> bool:
        entry = self._attached.get(id(worker))
        return entry is not None and entry[0] is worker

    async def _stop_worker(self, worker: object) -> None:
        """Cancel ``worker``'s ``run`` (started by :meth:`_start_worker`) and wait until it
        ended (its cancellation handlers' shielded calls included)."""
        entry = self._attached.pop(id(worker), None)
        if entry is None:
            return
        _, scope, done = entry
        scope.cancel()
        await done.wait()

    @property
    def background_failures(self) -> tuple[BaseException, ...]:
        """Exceptions that ended background workers (the service kept serving)."""
        return tuple(self._background_failures)

    async def _run_worker(self, fn: WorkerFn, scope: CancelScope, done: anyio.Event | None) -> None:
        try:
            with scope:
                await fn(self)  # ``self`` is the facade
        except Exception as exc:
            # A ServiceError after close or failure is a consequence, not a cause.
            if not (isinstance(exc, ServiceError) and self._state is not ServiceState.RUNNING):
                logger.error("background worker %r failed", fn, exc_info=exc)
                self._background_failures.append(exc)
        finally:
            self._worker_scopes.discard(scope)
            if done is not None:
                done.set()
            if not self._worker_scopes and self._workers_done is not None:
                self._workers_done.set()

    async def _stop_workers(self) -> None:
        if not self._worker_scopes:
            return
        self._workers_done = anyio.Event()
        for scope in list(self._worker_scopes):
            scope.cancel()
        await self._workers_done.wait()
