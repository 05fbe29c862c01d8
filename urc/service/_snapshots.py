"""The service's snapshot source: figures taken on the event loop, asked for from any thread.

A :class:`~urc.service.PullingObserver` (the metrics exporter) asks for a snapshot at
scrape time, possibly from an HTTP server thread.  Snapshots are only ever built on the event
loop thread, between two task steps, so never in the middle of a command: a call from another
thread schedules the build on the loop and waits for it a bounded time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from urc.service._observer import ServiceSnapshot
from urc.stats import CacheStats

__all__ = ["LoopSnapshots", "call_soon_threadsafe", "running_asyncio_loop"]

# How long a snapshot asked for from another thread waits for the event loop before it falls
# back to the newest one taken (the loop only runs it between two task steps).
SNAPSHOT_WAIT_S = 1.0


class LoopSnapshots:
    """A :class:`~urc.service.StatsSource` (see its contract) for a service on the event loop
    that creates it.  ``stats`` and ``queued`` read the figures (loop thread only);
    ``call_soon`` schedules a callback on that loop from another thread."""

    __slots__ = ("_call_soon", "_final", "_last", "_queued", "_seq", "_stats", "_thread")

    def __init__(
        self,
        stats: Callable[[], CacheStats],
        queued: Callable[[], int],
        call_soon: Callable[[Callable[[], None]], object],
    ) -> None:
        self._stats = stats
        self._queued = queued
        self._thread = threading.get_ident()
        self._call_soon = call_soon
        self._seq = 0
        self._final: ServiceSnapshot | None = None
        self._last = self.take()

    def take(self) -> ServiceSnapshot:
        """A new snapshot (event loop thread only)."""
        self._seq += 1
        snap = ServiceSnapshot(self._stats(), self._queued(), self._seq)
        self._last = snap
        return snap

    def finish(self) -> None:
        """The service stopped: from now on every caller gets the snapshot taken now."""
        self._final = self.take()

    def snapshot(self) -> ServiceSnapshot:
        final = self._final
        if final is not None:
            return final
        if threading.get_ident() == self._thread:
            return self.take()
        box: list[ServiceSnapshot] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append(self._final or self.take())
            finally:
                done.set()

        try:
            self._call_soon(run)
        except Exception:  # the loop is gone (closed, or the trio run finished)
            pass
        else:
            if done.wait(SNAPSHOT_WAIT_S) and box:
                return box[0]
        return self._final or self._last


def call_soon_threadsafe() -> Callable[[Callable[[], None]], object]:
    """How another thread schedules a callback on the running event loop."""
    loop = running_asyncio_loop()
    if loop is not None:
        return loop.call_soon_threadsafe
    import trio  # the only other backend anyio runs on

    return trio.lowlevel.current_trio_token().run_sync_soon


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop running the current task, or ``None`` (trio, trio guest mode)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return None
    return None if task is None else task.get_loop()
