"""The router's event feed: one SUB socket on every replica's KV-event endpoint, with
recovery through each replica's replay socket when a batch goes missing.

Each replica publishes under its own topic (:func:`replica_topic`); batches carry a
per-publisher sequence number (SGLang's wire format, :mod:`urc.service._kv_wire`).  The
subscriber applies batches to that replica's :class:`~urc.apps.fleet.index.ReplicaIndex` in
sequence order.  When a batch arrives past the next expected sequence number (a PUB socket
drops at its high-water mark; a subscriber that joined late missed the first batches), it
asks the replica's ROUTER socket for everything from the missing number on, applies the
answer, and goes on: SGLang's model gateway and Dynamo recover the same way.  Duplicates
(a live batch that the replay already delivered) are skipped.

``drop`` is a fault injector for tests and demonstrations: a live batch for which
``drop(replica, seq)`` is true is discarded as if the network had lost it (replayed
batches are never dropped).  A loss at the very end of a stream shows only when a later
batch arrives; :meth:`EventSubscriber.catch_up` asks for the tail explicitly (the run's end
knows how many batches each publisher sent).

Lag: for every live batch, the wall time from the publisher stamping it (the batch's
``ts``, when the replica's actor offered it) to the router applying it.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import zmq
import zmq.asyncio

from urc.apps.fleet.index import ReplicaIndex

__all__ = ["EventSubscriber", "SubscriberStats", "replica_topic"]

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
DropFilter = Callable[[int, int], bool]


def replica_topic(replica: int) -> str:
    """The topic replica ``replica`` publishes under (fixed width: a ZMQ subscription is a
    prefix match, and ``r1`` would also match ``r10``)."""
    return f"r{replica:04d}"


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    """Batches and events applied (live and replayed), gaps seen, batches recovered by
    replay, batches the fault injector dropped, and batches no replay could return (the
    publisher's buffer no longer held them)."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    dropped: int = 0
    lost: int = 0


class EventSubscriber:
    """Feeds one :class:`ReplicaIndex` per replica from the replicas' events (see the module
    docstring).  ``endpoints[r]`` is replica ``r``'s ``(pub, replay)`` address pair.
    Run :meth:`run` as a task; it connects, then applies batches until cancelled."""

    def __init__(
        self, endpoints: Sequence[tuple[str, str]], *, drop: DropFilter | None = None
    ) -> None:
        self.endpoints = list(endpoints)
        self.indexes = [ReplicaIndex() for _ in self.endpoints]
        self.next_seq = [0] * len(self.endpoints)  #: per replica: the next sequence expected
        self.lag_s = array("d")  #: per live batch applied: publish-to-apply seconds
        self._topics = {replica_topic(r).encode(): r for r in range(len(self.endpoints))}
        self._drop = drop
        self._counts = [0, 0, 0, 0, 0, 0]
        self._decode = msgspec.msgpack.Decoder().decode
        self._ctx = zmq.asyncio.Context()
        self._dealers: dict[int, Any] = {}
        self._sub: Any = None
        self._lock = anyio.Lock()  # one replay (or catch-up) at a time
        self.connected = anyio.Event()
        self._progress = anyio.Event()  # set (and replaced) on every batch applied

    @property
    def stats(self) -> SubscriberStats:
        return SubscriberStats(*self._counts)

    def close(self) -> None:
        """Close the sockets (after :meth:`run` was cancelled)."""
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        self._ctx.term()

    async def run(self) -> None:
        """Connect to every publisher and apply batches until cancelled."""
        sub = self._sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # the router keeps up or replays; never drop here
        for pub, _ in self.endpoints:
            sub.connect(pub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.connected.set()
        while True:
            await self._receive(await sub.recv_multipart())
            # Apply everything that has arrived before yielding: the router decides on all
            # it has been told (awaiting a completed future does not yield).
            while True:
                try:
                    frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                await self._receive(frames)

    async def _receive(self, frames: list[bytes]) -> None:
        """Apply one live batch (``[topic, seq, payload]``), replaying first if it reveals
        a gap."""
        topic, seq_frame, payload = frames
        replica = self._topics.get(topic)
        if replica is None:
            return
        seq = int.from_bytes(seq_frame, "big")
        if self._drop is not None and self._drop(replica, seq):
            self._counts[4] += 1
            return
        async with self._lock:
            if seq > self.next_seq[replica]:
                self._counts[2] += 1
                await self._replay(replica)
            if seq == self.next_seq[replica]:
                ts = self._apply(replica, seq, payload)
                self.lag_s.append(time.time() - ts)

    def _apply(self, replica: int, seq: int, payload: bytes) -> float:
        ts, events, _rank = self._decode(payload)
        self.indexes[replica].apply(events)
        self.next_seq[replica] = seq + 1
        self._progress.set()
        self._progress = anyio.Event()
        self._counts[0] += 1
        self._counts[1] += len(events)
        return float(ts)

    def _dealer(self, replica: int) -> Any:
        sock = self._dealers.get(replica)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoints[replica][1])
            self._dealers[replica] = sock
        return sock

    async def _replay(self, replica: int) -> None:
        """Ask ``replica``'s ROUTER for every batch from the next expected one; apply them."""
        sock = self._dealer(replica)
        await sock.send_multipart([b"", self.next_seq[replica].to_bytes(8, "big")])
        counts = self._counts
        while True:
            frames = await sock.recv_multipart()
            _, _topic, seq_frame, payload = frames
            if seq_frame == _END_SEQ:
                return
            seq = int.from_bytes(seq_frame, "big")
            expected = self.next_seq[replica]
            if seq < expected:
                continue
            if seq > expected:  # the publisher's buffer no longer holds these
                counts[5] += seq - expected
            self._apply(replica, seq, payload)
            counts[3] += 1

    async def sync(self, publishers: Sequence[Any], quiet_s: float = 0.05) -> None:
        """Return once every batch ``publishers`` (the replicas' ``KVEventPublisher``, in
        replica order) have sent or queued so far is applied: live, or -- when the stream
        stays quiet for ``quiet_s`` while some are missing (lost) -- through the replay
        sockets.  The simulation's barrier (a router cannot know what was sent); see
        :mod:`urc.apps.fleet.run`."""
        await anyio.lowlevel.checkpoint()  # let the actors' last batches be queued
        targets = [p.stats.batches_published + p.queued for p in publishers]
        while any(have < want for have, want in zip(self.next_seq, targets, strict=True)):
            with anyio.move_on_after(quiet_s) as scope:
                await self._progress.wait()
            if scope.cancelled_caught:
                await self.catch_up(targets)

    async def catch_up(self, published: Sequence[int]) -> None:
        """Replay whatever each replica published (``published[r]`` batches in all) that
        was not applied yet: a loss at the end of a stream has no later batch to reveal it."""
        for replica, total in enumerate(published):
            async with self._lock:
                if self.next_seq[replica] < total:
                    self._counts[2] += 1
                    await self._replay(replica)
