"""``KVEventPublisher``: the service's KV events on ZMQ, in SGLang 0.5.23's wire format.

A background worker of the service (``AsyncUnifiedRadixCache(..., workers=[publisher])``;
asyncio only: it uses pyzmq's asyncio sockets).  On start it binds (or connects) a PUB socket
and, when configured, the replay ROUTER socket, and turns the cache's KV events on
(``cache.enable_kv_events``) with a notify hook.  The hook runs inside the actor and only
schedules a drain (``loop.call_soon``), which runs once the actor yields, at the end of its
batch: the batch's events become one ``EventBatch`` in a bounded queue -- or, when the queue
is full, are dropped and counted (:class:`KVPublisherStats`).  The actor never waits for the
publisher; the publisher's task encodes and sends (a PUB send never blocks: ZMQ drops at the
high-water mark) and keeps the last ``buffer_steps`` batches for replay, yielding every
``_SEND_SLICE`` batches so that a burst never holds the loop the actor shares.  Replay
requests are served by :class:`~urc.service._kv_replay.ReplayServer` (bounded in frame size,
per client and per round of the loop).  At close the events still queued are sent, the
sockets closed and the cache's events turned off.

The PUB socket binds ``tcp://127.0.0.1:5557`` by default, like the metrics server and the
CLI: publishing to other hosts is an explicit ``tcp://*:PORT`` (or an interface address).

Wire format: :mod:`urc.service._kv_wire`.  Needs the ``events`` extra (pyzmq, msgspec).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from urc.errors import ConfigError, InvalidInputError
from urc.kv_events import KVEvent
from urc.service._kv_replay import ReplayServer
from urc.service._kv_wire import batch_to_wire, seq_bytes

__all__ = ["KVEventPublisher", "KVEventsConfig", "KVPublisherStats"]

_SEND_SLICE = 64  # batches sent between two yields to the loop


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where and how KV events are published (SGLang's ``KVEventsConfig`` fields).

    ``endpoint``: the PUB address, bound when ``bind`` (default ``tcp://127.0.0.1:5557``,
    loopback only; ``tcp://*:5557`` for every interface; port 0 picks a free one: see
    :attr:`KVEventPublisher.endpoint`), else connected to. ``replay_endpoint``: the ROUTER
    address for replay requests (bound), or None. ``topic``: the first frame of every
    message. ``buffer_steps``: batches kept for replay. ``max_queued``: batches waiting to
    be sent; a batch beyond that is dropped and counted. ``hwm``: the PUB socket's send
    high-water mark. ``attn_dp_rank``: the rank stamped on every batch.
    ``replay_max_clients``: replays sent at once (a request beyond is refused and counted);
    ``replay_stall_s``: how long a replay waits on a client that does not read before it is
    abandoned (counted)."""

    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    max_queued: int = 10_000
    hwm: int = 100_000
    bind: bool = True
    attn_dp_rank: int = 0
    replay_max_clients: int = 64
    replay_stall_s: float = 5.0

    def __post_init__(self) -> None:
        if self.replay_max_clients < 1 or not self.replay_stall_s > 0:
            raise ConfigError(
                f"replay_max_clients >= 1 and replay_stall_s > 0 needed: "
                f"{self.replay_max_clients}, {self.replay_stall_s}"
            )
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
    full: nobody got them; or a subscriber's queue was at the high-water mark: that
    subscriber missed them, the others got them), replay requests read, refused (a repeat
    from a client whose replay is still being sent, or too many clients at once) and
    replays abandoned (the client stopped reading or left)."""

    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0
    events_dropped: int = 0
    replay_requests: int = 0
    replay_requests_refused: int = 0
    replays_abandoned: int = 0


class KVEventPublisher:
    """Publishes a service's KV events (see the module docstring); one service at a time."""

    def __init__(self, config: KVEventsConfig | None = None) -> None:
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as exc:  # pragma: no cover - the extra is installed in CI
            raise ConfigError(
                "KV event publishing needs pyzmq and msgspec: pip install -e "
                "'.[events]' from the checkout (or pip install pyzmq msgspec)"
            ) from exc
        self.config = config if config is not None else KVEventsConfig()
        self._queue: deque[tuple[float, list[KVEvent]]] = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        self._seq = 0
        self._scheduled = False
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cache: Any = None
        self._stats = [0] * len(fields(KVPublisherStats))
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
        # XPUB (a PUB to its subscribers) so that a drop at a subscriber's high-water mark
        # can be seen and counted: see _send.
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_NODROP, 1)
        raw_pub: Any = zmq.Socket.shadow(pub.underlying)  # NOBLOCK sends, no future each
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
                server = ReplayServer(
                    replay,
                    self._buffer,
                    topic,
                    self._stats,
                    (4, 5, 6),
                    max_clients=cfg.replay_max_clients,
                    stall_s=cfg.replay_stall_s,
                )
                replay.bind(cfg.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
                replay_task = asyncio.ensure_future(server.run())
            self._cache = cache
            cache.enable_kv_events(self._notify)
            self.started.set()
            if self._queue:  # batches offered before the start
                wake.set()
            while True:
                await wake.wait()
                wake.clear()
                await self._send_queued(raw_pub, topic, encode)
        finally:
            # Closing: what the cache recorded and we hold goes out now (non-blocking sends).
            with contextlib.suppress(Exception):
                self._collect()
                self._send_queued_nowait(raw_pub, topic, encode)
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

    def _send(self, pub: Any, frames: tuple[bytes, bytes, bytes], n_events: int) -> None:
        """Send one batch without waiting.  Under ``XPUB_NODROP`` a send that would drop at
        some subscriber's high-water mark fails instead: the batch is counted as dropped (that
        subscriber misses it) and sent to the others with the drop allowed."""
        import zmq

        try:
            pub.send_multipart(frames, zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        s = self._stats
        s[2] += 1
        s[3] += n_events
        pub.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            pub.send_multipart(frames, zmq.NOBLOCK)
        finally:
            pub.setsockopt(zmq.XPUB_NODROP, 1)

    @staticmethod
    def _drain_subscriptions(pub: Any) -> None:
        """Read the (un)subscribe messages an XPUB receives, so that none pile up."""
        import zmq

        with contextlib.suppress(zmq.Again):
            while True:
                pub.recv(zmq.NOBLOCK)

    async def _send_queued(self, pub: Any, topic: bytes, encode: Any) -> None:
        self._drain_subscriptions(pub)
        n = 0
        while self._queue:
            n_events = len(self._queue[0][1])
            self._send(pub, self._next(topic, encode), n_events)
            self._sent.set()
            n += 1
            if n % _SEND_SLICE == 0:
                await asyncio.sleep(0)  # a send returns at once: yield to the actor

    def _send_queued_nowait(self, pub: Any, topic: bytes, encode: Any) -> None:
        while self._queue:
            n_events = len(self._queue[0][1])
            self._send(pub, self._next(topic, encode), n_events)
