"""``KVEventPublisher``: the service's KV events on ZMQ, in SGLang 0.5.23's wire format.

A background worker of the service (``AsyncUnifiedRadixCache(..., workers=[publisher])``;
asyncio only: it uses pyzmq's asyncio sockets).  On start it binds (or connects) a PUB socket
and, when configured, the replay ROUTER socket, and turns the cache's KV events on
(``cache.enable_kv_events``) with a notify hook.  The hook runs inside the actor and only
schedules a drain (``loop.call_soon``), which runs once the actor yields, at the end of its
batch: the batch's events become one ``EventBatch`` in a bounded queue -- or, when the queue
is full, are dropped and counted (:class:`KVPublisherStats`).  The actor never waits for the
publisher; the publisher's task encodes and sends (a PUB send never blocks: ZMQ drops at the
high-water mark) and keeps the last ``buffer_steps`` batches for replay.  At close the events
still queued are sent, the sockets closed and the cache's events turned off.

Wire format: :mod:`urc.service._kv_wire`.  Needs the ``events`` extra (pyzmq, msgspec).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from urc.errors import ConfigError, InvalidInputError
from urc.kv_events import KVEvent
from urc.service._kv_wire import END_SEQ, batch_to_wire, seq_bytes

__all__ = ["KVEventPublisher", "KVEventsConfig", "KVPublisherStats"]


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where and how KV events are published (SGLang's ``KVEventsConfig`` fields).

    ``endpoint``: the PUB address, bound when ``bind`` (``tcp://127.0.0.1:5557``,
    ``tcp://*:5557``; port 0 picks a free one: see :attr:`KVEventPublisher.endpoint`), else
    connected to.  ``replay_endpoint``: the ROUTER address for replay requests (bound), or
    None.  ``topic``: the first frame of every message.  ``buffer_steps``: batches kept for
    replay.  ``max_queued``: batches waiting to be sent; a batch beyond that is dropped and
    counted.  ``hwm``: the PUB socket's send high-water mark.  ``attn_dp_rank``: the rank
    stamped on every batch."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    max_queued: int = 10_000
    hwm: int = 100_000
    bind: bool = True
    attn_dp_rank: int = 0

    def __post_init__(self) -> None:
        if self.buffer_steps < 0 or self.max_queued < 1 or self.hwm < 0:
            raise ConfigError(
                f"buffer_steps >= 0, max_queued >= 1, hwm >= 0 needed: {self.buffer_steps}, "
                f"{self.max_queued}, {self.hwm}"
            )
        if "://" not in self.endpoint:
            raise ConfigError(f"endpoint must be a ZMQ address (tcp://...): {self.endpoint!r}")


@dataclass(frozen=True, slots=True)
class KVPublisherStats:
    """What a publisher did so far: batches and events sent and dropped (its queue was
    full), replay requests answered."""

    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0
    events_dropped: int = 0
    replay_requests: int = 0


class KVEventPublisher:
    """Publishes a service's KV events (see the module docstring); one service at a time."""

    def __init__(self, config: KVEventsConfig | None = None) -> None:
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as exc:  # pragma: no cover - the extra is installed in CI
            raise ConfigError(
                "KV event publishing needs pyzmq and msgspec: pip install "
                "'unified-radix-cache[events]'"
            ) from exc
        self.config = config if config is not None else KVEventsConfig()
        self._queue: deque[tuple[float, list[KVEvent]]] = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        self._seq = 0
        self._scheduled = False
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cache: Any = None
        self._stats = [0, 0, 0, 0, 0]
        self.endpoint: str | None = None  #: the PUB socket's address once started
        self.replay_endpoint: str | None = None  #: the ROUTER's address once started
        #: Set once the sockets are bound and the cache's events are on.
        self.started = asyncio.Event()
        self._sent = asyncio.Event()  # set after each batch sent (see wait_published)

    @property
    def stats(self) -> KVPublisherStats:
        return KVPublisherStats(*self._stats)

    @property
    def queued(self) -> int:
        """Batches waiting to be sent."""
        return len(self._queue)

    async def wait_published(self, batches: int) -> None:
        """Return once ``batches`` batches in all have been sent (waits on the sender, never
        polls; bound it with a deadline)."""
        while self._stats[0] < batches:
            self._sent.clear()
            await self._sent.wait()

    async def wait_drained(self) -> None:
        """Return once every queued batch has been sent (bound it with a deadline)."""
        while self._queue:
            self._sent.clear()
            await self._sent.wait()

    # ------------------------------------------------------------------ the actor's side
    def _notify(self) -> None:
        """The recorder's hook (inside the actor): drain once the actor yields."""
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._collect)

    def _collect(self) -> None:
        self._scheduled = False
        cache = self._cache
        if cache is None:
            return
        events = cache.take_events()
        if events:
            self.offer(events)

    def offer(self, events: list[KVEvent]) -> bool:
        """Queue ``events`` as one batch for sending (the publisher drains the cache this way
        itself; a caller may add batches of its own).  Never waits: with ``max_queued``
        batches queued the batch is dropped, counted in :attr:`stats`, and False returned."""
        s = self._stats
        if len(self._queue) >= self.config.max_queued:
            s[2] += 1
            s[3] += len(events)
            return False
        self._queue.append((time.time(), events))
        if self._wake is not None:
            self._wake.set()
        return True

    # ------------------------------------------------------------------ the worker
    async def run(self, svc: Any) -> None:
        """The worker body (the service starts it): publish until cancelled."""
        import msgspec
        import zmq
        import zmq.asyncio

        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise InvalidInputError("KVEventPublisher runs on asyncio only") from None
        if self._cache is not None:
            raise InvalidInputError("this KVEventPublisher already runs for a service")
        cfg = self.config
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        replay = None
        replay_task: asyncio.Task[None] | None = None
        encode = msgspec.msgpack.Encoder().encode
        topic = cfg.topic.encode("utf-8")
        self._wake = wake = asyncio.Event()
        cache = svc.cache
        try:
            if cfg.bind:
                pub.bind(cfg.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(cfg.endpoint)
                self.endpoint = cfg.endpoint
            if cfg.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(cfg.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
                replay_task = asyncio.ensure_future(self._serve_replay(replay, topic))
            self._cache = cache
            cache.enable_kv_events(self._notify)
            self.started.set()
            if self._queue:  # batches offered before the start
                wake.set()
            while True:
                await wake.wait()
                wake.clear()
                await self._send_queued(pub, topic, encode)
        finally:
            # Closing: what the cache recorded and we hold goes out now (non-blocking sends).
            with contextlib.suppress(Exception):
                self._collect()
                self._send_queued_nowait(pub, topic, encode)
            cache.disable_kv_events()
            self._cache = None
            if replay_task is not None:
                replay_task.cancel()  # no await here: the worker's scope is being cancelled
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            ctx.term()

    def _next(self, topic: bytes, encode: Any) -> tuple[bytes, bytes, bytes]:
        ts, events = self._queue.popleft()
        payload: bytes = encode(batch_to_wire(ts, events, self.config.attn_dp_rank))
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        s = self._stats
        s[0] += 1
        s[1] += len(events)
        return topic, seq_bytes(seq), payload

    async def _send_queued(self, pub: Any, topic: bytes, encode: Any) -> None:
        while self._queue:
            await pub.send_multipart(self._next(topic, encode))
            self._sent.set()

    def _send_queued_nowait(self, pub: Any, topic: bytes, encode: Any) -> None:
        import zmq

        while self._queue:
            pub.send_multipart(self._next(topic, encode), flags=zmq.NOBLOCK)

    async def _serve_replay(self, replay: Any, topic: bytes) -> None:
        """Answer replay requests: ``[identity, b"", start_seq]`` -> every buffered batch
        from ``start_seq`` on, then the end marker."""
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                continue  # SGLang logs and ignores a malformed request
            ident, _, start = frames
            self._stats[4] += 1
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await replay.send_multipart((ident, b"", topic, seq_bytes(seq), payload))
            await replay.send_multipart((ident, b"", b"", END_SEQ, b""))
