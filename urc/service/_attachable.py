"""``AttachableWorker``: a background worker that can join and leave a running service
(``svc.attach_worker`` / ``svc.detach_worker``), e.g. the L3 storage worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from urc.cache import UnifiedRadixCache

__all__ = ["AttachableWorker"]


@runtime_checkable
class AttachableWorker(Protocol):
    """A background worker with the hooks of a live attach and detach.

    ``attach(cache)`` and ``detach(cache)`` run inside the actor (or directly on a cache no
    service owns: the synchronous API): they subscribe to / unsubscribe from the cache's
    events and raise a :class:`~urc.errors.URCError` having changed nothing.  ``detach``
    raises :class:`~urc.errors.InvalidInputError` while the worker still holds something of
    the cache (pins, reserved slots).  ``drain(svc, timeout_s)`` runs before a detach: it
    stops taking new work, then waits for the work in flight, giving back (cancelling) what
    is still running after ``timeout_s`` (``None``: the worker's own default).  ``run(svc)``
    is the background coroutine, as for any :class:`~urc.service.BackgroundWorker`.
    """

    async def run(self, svc: Any) -> None: ...

    def attach(self, cache: UnifiedRadixCache) -> None: ...

    def detach(self, cache: UnifiedRadixCache) -> None: ...

    async def drain(self, svc: Any, timeout_s: float | None) -> None: ...
