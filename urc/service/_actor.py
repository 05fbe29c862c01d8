"""The actor: the one task that owns the tree.  It takes calls off the stream and applies
them in order, a batch at a time, through the :class:`~urc.service._executor.CommandExecutor`; at
close it drains the stream and releases what callers still hold; if anything but a typed
error escapes a command it fails the service (every queued and later call gets
:class:`~urc.errors.ServiceFailedError`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from time import perf_counter
from typing import Any

from anyio import CancelScope, ClosedResourceError, EndOfStream, WouldBlock
from anyio.lowlevel import checkpoint

from urc.errors import ServiceClosedError, URCError
from urc.service._base import ServiceBase, ServiceState
from urc.service._call import ServiceCall

__all__ = ["Actor"]

logger = logging.getLogger("urc.service")


class Actor(ServiceBase):
    """The actor loop and its shutdown and failure paths (a mixin of the service)."""

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
                    call: ServiceCall | None = None
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

    def _apply(self, call: ServiceCall) -> None:
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

    def _apply_hooked(self, call: ServiceCall) -> None:
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

    def _deliver(self, call: ServiceCall, result: Any, error: BaseException | None) -> None:
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
            self._apply_hooked(ServiceCall(cmd, perf_counter(), None))

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
