"""The KV-event publisher's replay ROUTER: answers ``[identity, b"", start_seq]`` requests from
the publisher's buffer without stalling the event loop it shares with the actor.

A ROUTER send never waits (a peer that does not read has its messages dropped, or with
``ROUTER_MANDATORY`` refused), so a replay that sends the whole buffer in one go never
yields: a few hundred requests from a client that never reads once froze the service's
loop for seconds.  Here every bound is explicit:

* size: a request frame larger than ``_MAX_FRAME`` bytes disconnects its peer inside
  libzmq (``MAXMSGSIZE``: the frame is never buffered); a request whose start frame is not
  8 bytes is ignored, as SGLang ignores a malformed one;
* per client: one replay in progress per identity (a repeat while it runs is refused and
  counted), at most ``max_clients`` in progress;
* time: batches go out ``slice_batches`` at a time, one slice per round (the clients take
  turns), with the loop yielding after each round; a client whose queue stays full (it is
  not reading) past ``stall_s`` loses its replay (counted), one that has gone loses it at
  once.

Stats are written into the publisher's counter list (indices in :data:`STAT_INDEX`).
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections import OrderedDict, deque
from typing import Any

from urc.service._kv_wire import END_SEQ, seq_bytes

__all__ = ["ReplayServer"]

_MAX_FRAME = 1024  # the largest request frame accepted (a start frame has 8 bytes)
_DRAIN_PER_ROUND = 256  # requests read between two rounds of sends


class ReplayServer:
    """Serves replay requests on ``sock`` (a bound asyncio ROUTER) from ``buffer`` (the
    publisher's ``(seq, payload)`` deque, consecutive sequences, oldest first).

    ``stats``: the publisher's counter list; index ``requests``, ``refused`` and ``abandoned``
    are incremented here (requests read; requests refused: a repeat or too many clients;
    replays dropped because their client stopped reading or left)."""

    def __init__(
        self,
        sock: Any,
        buffer: deque[tuple[int, bytes]],
        topic: bytes,
        stats: list[int],
        index: tuple[int, int, int],
        *,
        slice_batches: int = 64,
        max_clients: int = 64,
        stall_s: float = 5.0,
    ) -> None:
        import zmq

        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock = sock
        # The same socket, synchronous: NOBLOCK sends and receives without a future each.
        self._raw: Any = zmq.Socket.shadow(sock.underlying)
        self._buffer = buffer
        self._topic = topic
        self._stats = stats
        self._i_requests, self._i_refused, self._i_abandoned = index
        self._slice = slice_batches
        self._max_clients = max_clients
        self._stall_s = stall_s
        # identity -> [next sequence to send, when its queue was first found full (or 0.0)]
        self._pending: OrderedDict[bytes, list[float]] = OrderedDict()

    @property
    def in_progress(self) -> int:
        """Replays being sent now."""
        return len(self._pending)

    async def run(self) -> None:
        """Serve until cancelled."""
        import zmq

        sock = self._sock
        while True:
            if not self._pending:
                await sock.poll(flags=zmq.POLLIN)
            self._read_requests()
            # One slice per round, for the first client (in turn) that can take one: a round
            # costs at most ``slice_batches`` sends whatever the number of clients.
            progressed = False
            for ident in list(self._pending):
                if self._send_slice(ident):
                    if ident in self._pending:
                        self._pending.move_to_end(ident)
                    progressed = True
                    break
            if self._pending and not progressed:
                # Every client's queue is full: wait for a request or a little time.
                await sock.poll(timeout=10, flags=zmq.POLLIN)
            else:
                await asyncio.sleep(0)  # one round at a time: the actor runs in between

    def _read_requests(self) -> None:
        import zmq

        raw = self._raw
        stats = self._stats
        pending = self._pending
        for _ in range(_DRAIN_PER_ROUND):
            try:
                frames = raw.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # SGLang logs and ignores a malformed request
            ident, _, start = frames
            stats[self._i_requests] += 1
            if ident in pending or len(pending) >= self._max_clients:
                stats[self._i_refused] += 1
                continue
            pending[ident] = [int.from_bytes(start, "big"), 0.0]

    def _send_slice(self, ident: bytes) -> bool:
        """Send up to a slice of ``ident``'s replay (and its end marker when done); returns
        whether anything was sent."""
        import zmq

        entry = self._pending[ident]
        buffer = self._buffer
        raw = self._raw
        topic = self._topic
        first = int(entry[0])
        start = 0 if not buffer else max(0, first - buffer[0][0])
        sent = 0
        try:
            for i in range(start, min(len(buffer), start + self._slice)):
                seq, payload = buffer[i]
                raw.send_multipart((ident, b"", topic, seq_bytes(seq), payload), zmq.NOBLOCK)
                entry[0] = seq + 1
                sent += 1
            if start + sent >= len(buffer):
                raw.send_multipart((ident, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
                del self._pending[ident]
                return True
        except zmq.Again:
            now = time.monotonic()
            if sent:
                entry[1] = 0.0
            elif entry[1] == 0.0:
                entry[1] = now
            elif now - entry[1] > self._stall_s:
                self._abandon(ident)
            return sent > 0
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self._abandon(ident)  # the client has gone
            return sent > 0
        entry[1] = 0.0
        return sent > 0

    def _abandon(self, ident: bytes) -> None:
        del self._pending[ident]
        self._stats[self._i_abandoned] += 1
