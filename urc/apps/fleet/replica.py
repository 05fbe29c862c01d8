"""One replica of the fleet: urc's async service over its own cache, device (and optional
host) tier, L3 worker on the shared store, and KV-event publisher on its own loopback
endpoint.

A replica serves requests with ``urc replay``'s serving loop (match, load back from host,
prefetch from L3, chunked prefill, cache the prompt: :mod:`urc.apps.replay.driver`), one
request at a time: the fleet is a cache simulation, and one request in flight per replica
makes each request's hits (what the replica actually had) exact, so the router's prediction
can be checked request by request.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import anyio
from tqdm import tqdm

import hicache
from hicache.config import HiCacheConfig, StorageConfig
from hicache.storage.base import StorageBackend
from hicache.storage_worker import StorageWorker
from urc.apps.fleet.subscriber import replica_topic
from urc.apps.replay.config import ReplayConfig

# The replay's serving loop, reused as it stands (one request's path through the service).
from urc.apps.replay.driver import _ServingLoop
from urc.apps.workloads import TraceRequest
from urc.cache import UnifiedRadixCache, build_cache
from urc.node import ComponentType, Tier
from urc.service import (
    AsyncUnifiedRadixCache,
    BackgroundWorker,
    KVEventPublisher,
    KVEventsConfig,
    LoadBackPolicy,
)

__all__ = ["Replica", "ReplicaSizes", "open_replica"]

_POLL_S = 0.001
_STALLED_POLLS = 100  # 0.1 s without a backup's progress: give up waiting for it


@dataclass(frozen=True, slots=True)
class ReplicaSizes:
    """A replica's tiers in cache tokens: ``device``, ``host`` (0: none), and the longest
    request (sizes the request rows)."""

    device: int
    host: int
    max_request_tokens: int


class Replica:
    """A running replica (build it with :func:`open_replica`).  ``serve`` one request at a
    time; ``requests`` / ``prompt_tokens`` count what it was given."""

    def __init__(
        self,
        index: int,
        cache: UnifiedRadixCache,
        svc: AsyncUnifiedRadixCache,
        publisher: KVEventPublisher,
        loop: _ServingLoop,
        storage: StorageWorker | None,
        host_tokens: int,
    ) -> None:
        self.index = index
        self.cache = cache
        self.svc = svc
        self.publisher = publisher
        self.storage = storage
        self.host_tokens = host_tokens
        self._loop = loop
        self.slot = anyio.Semaphore(1)
        self._serving = anyio.Semaphore(1)
        self.requests = 0
        self.prompt_tokens = 0

    @property
    def hits(self) -> dict[Tier, int]:
        """Prompt tokens served from each tier so far."""
        return self._loop.hits

    @property
    def rejected(self) -> int:
        return self._loop.rejected

    async def serve(self, tr: TraceRequest, *, settle: bool = False) -> tuple[int, int]:
        """Serve ``tr`` (the caller holds :attr:`slot`; it is released here).  With
        ``settle`` the replica's queued L3 writes land before the slot is released, so its
        next request (and a session's next turn, wherever it goes) sees them: a write-through
        lands in milliseconds, well inside a real trace's gaps, which the replay compresses
        away.  Returns the prompt tokens it found on this replica (device + host) and in L3."""
        hits = self._loop.hits
        before = (hits[Tier.DEVICE] + hits[Tier.HOST], hits[Tier.STORAGE])
        self.requests += 1
        self.prompt_tokens += tr.input_length
        try:
            await self._serving.acquire()  # released by the serving loop
            await self._loop._serve(tr, self._serving)
            if settle and self.storage is not None:
                await self._settle(self.storage)
        finally:
            self.slot.release()
        return (
            hits[Tier.DEVICE] + hits[Tier.HOST] - before[0],
            hits[Tier.STORAGE] - before[1],
        )

    async def _settle(self, storage: StorageWorker) -> None:
        """Wait for the host backups the request started (an L3 write is queued when its
        host copy commits), then for every queued L3 write.  A backup that makes no progress
        while nothing copies (a host tier full of pinned pages) is not waited for."""
        cache, controller = self.cache, self._loop.controller
        assert controller is not None, "an L3 worker comes with a host tier"
        stalled, last = 0, (-1, -1)
        while cache.pending_backups or cache.backups_in_flight or controller.in_flight:
            now = (len(cache.pending_backups), controller.backed_up_tokens)
            stalled = stalled + 1 if now == last and not controller.in_flight else 0
            if stalled > _STALLED_POLLS:
                break
            last = now
            await anyio.sleep(_POLL_S)  # the backup loop runs meanwhile
        await storage.flush(math.inf)

    async def flush(self) -> None:
        """Let queued L3 writes land."""
        if self.storage is not None:
            await self.storage.flush()

    def check(self) -> str | None:
        """The core's invariants after the run (``None``: all hold)."""
        cache = self.cache
        try:
            cache.sanity_check()
            cache.check_pools()
            assert cache.protected_size() == 0, f"{cache.protected_size()} tokens still locked"
        except AssertionError as exc:
            return f"replica {self.index}: {exc or repr(exc)}"
        return None


@asynccontextmanager
async def open_replica(
    index: int,
    config: ReplayConfig,
    sizes: ReplicaSizes,
    store: StorageBackend | None,
    storage_config: StorageConfig | None = None,
) -> AsyncIterator[Replica]:
    """Start replica ``index`` (its service, workers and publisher on 127.0.0.1, free
    ports); stop it on exit (the service closes: background work drained, pins released,
    the publisher's sockets closed).  ``config`` carries the serving loop's knobs and the
    cache's (page size, chunking, write policy, eviction policy); ``store`` needs a host
    tier (``sizes.host > 0``).  Raises :class:`~urc.errors.ConfigError` for sizes that
    cannot be built."""
    cache = build_cache(config.cache_config(sizes.device, sizes.max_request_tokens))
    controller = storage = None
    workers: tuple[BackgroundWorker, ...] = ()
    host = 0
    if sizes.host > 0:
        hc = hicache.attach(
            cache,
            HiCacheConfig(write_policy=config.write_policy, host_ratio=sizes.host / sizes.device),
            store,
            storage_config=storage_config,
            copy_in_thread=config.realtime,
        )
        host = hc.tier.host_capacity(ComponentType.FULL)
        controller, storage, workers = hc.controller, hc.storage, tuple(hc.workers)
    publisher = KVEventPublisher(
        KVEventsConfig(
            endpoint="tcp://127.0.0.1:0",
            replay_endpoint="tcp://127.0.0.1:0",
            topic=replica_topic(index),
        )
    )
    bar = tqdm(disable=True)
    async with AsyncExitStack() as stack:
        svc = AsyncUnifiedRadixCache(
            cache,
            workers=(*workers, publisher),
            load_back=LoadBackPolicy(copy_in_thread=config.realtime),
        )
        await stack.enter_async_context(svc)
        await publisher.started.wait()
        loop = _ServingLoop(config, svc, controller, storage, sizes.device, bar)
        yield Replica(index, cache, svc, publisher, loop, storage, host)
