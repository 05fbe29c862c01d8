"""The caller's side of the service: send a command, wait for room, wait for the reply,
and what a cancelled caller leaves behind (withdrawn, applied, or given back).

The rules are the cancellation table of :mod:`urc.service`; :data:`~urc.service._call.
ON_CANCEL` says which row a command is in.
"""

from __future__ import annotations

import contextlib
import logging
import math
from time import perf_counter
from typing import TypeVar, cast

from anyio import (
    BrokenResourceError,
    CancelScope,
    ClosedResourceError,
    WouldBlock,
    current_effective_deadline,
)

from urc.errors import URCError
from urc.service._anyio_private import stream_buffer_holds
from urc.service._base import ServiceBase, ServiceState
from urc.service._call import ON_CANCEL, ServiceCall
from urc.service._commands import Command, CommandKind, OnCancel, Release, Returns
from urc.service._executor import give_back

__all__ = ["Transport"]

_R = TypeVar("_R")

logger = logging.getLogger("urc.service")


class Transport(ServiceBase):
    """Sending, waiting and giving back (a mixin of the service)."""

    async def _submit(self, cmd: Returns[_R], checked: bool = False) -> _R:
        """Send ``cmd`` to the actor and return its result, of the type the command names
        (or raise its typed error)."""
        if not checked:  # ``checked``: the caller just did both checks (no await since)
            if self._state is not ServiceState.RUNNING:
                raise self._not_running_error()
            # Already cancelled: raise before sending, so nothing is applied for a caller
            # that was gone before it asked (no yield when not cancelled).
            await self._checkpoint_if_cancelled()
        reply = self._new_reply()
        call = ServiceCall(
            cast(Command, cmd), perf_counter() if self._observer is not None else 0.0, reply
        )
        on_cancel = ON_CANCEL[type(call.command)]
        # Send.  The fast path (``_post``) never yields, so nothing can happen between the
        # state check and the call entering the stream; the state is RUNNING, so the stream
        # is open.  When callers already wait for room, get in line behind them.
        deferred: BaseException | None = None  # a native cancellation held back while sending
        if self._sending or not self._post(call):
            deferred = await self._send_waiting(call, on_cancel)
        try:
            if deferred is not None:
                raise deferred
            if self._on_asyncio:
                await reply
            else:
                await reply.wait()
        except self._cancelled_exc:
            if on_cancel is not OnCancel.AWAIT:
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
        return cast(_R, call.result)

    def _post(self, call: ServiceCall) -> bool:
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

    async def _send_waiting(self, call: ServiceCall, on_cancel: OnCancel) -> BaseException | None:
        """The slow path: wait for room in the stream (``await send``), in line behind any
        caller already waiting (``_sending``), so the stream keeps send order.

        Returns a native asyncio cancellation that hit an ownership move meanwhile: the call
        was sent all the same and the caller raises it once the call was answered."""
        assert self._send is not None
        self._pending += 1
        self._sending += 1
        deferred: BaseException | None = None
        try:
            if on_cancel is OnCancel.SKIP:
                await self._send.send(call)
            elif on_cancel is OnCancel.APPLY:  # a release is sent for sure once asked for
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

    def _in_stream(self, call: ServiceCall) -> bool:
        """Whether the stream took ``call`` (answered, or buffered): asked only after a native
        cancellation interrupted ``await send``, which may hit just after the actor moved the
        call from the waiting senders into the buffer."""
        return call.done or stream_buffer_holds(self._send, call)

    async def _outlast(self, call: ServiceCall) -> bool:
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

    def _close_sending(self) -> None:
        """Close the sending side once closing and no caller still waits for room: the actor
        then drains what is queued and gets ``EndOfStream``."""
        if self._sending == 0 and self._send is not None:
            self._send.close()

    def _abandon(self, call: ServiceCall, on_cancel: OnCancel) -> None:
        """Its caller stopped waiting for ``call`` (cancelled)."""
        if call.done:
            self._discard(call)
        elif on_cancel is OnCancel.SKIP:
            call.abandoned = True  # the actor skips it
        # APPLY (a release) is applied anyway: the lease is already marked released.

    def _discard(self, call: ServiceCall) -> None:
        """The reply arrived but its caller is gone: give back what the result hands over
        (a lease, slots: :func:`~urc.service._executor.give_back`)."""
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
        if state is ServiceState.RUNNING and self._post(ServiceCall(cmd, perf_counter(), None)):
            return
        assert self._actor_done is not None
        if not self._actor_done.is_set():
            self._orphans.append(cmd)
            return
        with contextlib.suppress(URCError):  # e.g. a lease the close already released
            self._executor.apply(cmd)
