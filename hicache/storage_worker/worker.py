"""``StorageWorker``: the L3 storage tier's background worker (see :mod:`hicache.storage_worker`).

It puts the pieces of this package together: the store calls (:class:`StoreCalls`), the
writes (:class:`BackupWriter`, its background loop) and the reads (:class:`Prefetcher`).

Attach and detach on a live service (an :class:`~urc.service.AttachableWorker`): build the
worker with ``attached=False`` and ``await svc.attach_worker(worker)`` (the actor subscribes
it to the cache's events, then its write loop starts); ``await svc.detach_worker(worker)``
drains it (:meth:`StorageWorker.drain`: no new prefetch or backup is taken, queued backups
are flushed, prefetches in flight finish -- or, past the deadline, are cancelled, which
frees their host slots and releases their pins), stops its write loop and unsubscribes it.
``hicache.attach_storage`` / ``hicache.detach_storage`` do this for a :class:`~hicache.HiCache`.
Without a service, :meth:`StorageWorker.attach` / :meth:`StorageWorker.detach` are the
synchronous API.  A detached worker is not attached again: build a new one over the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary, ref

import anyio

from hicache.config import StorageBackupPolicy, StorageConfig
from hicache.host_tier import HostMemoryTier
from hicache.storage.base import StorageBackend
from hicache.storage.keys import KeyScheme
from hicache.storage_worker.backup import BackupWriter
from hicache.storage_worker.calls import StoreCalls
from hicache.storage_worker.context import WorkerContext
from hicache.storage_worker.layout import PageLayouts
from hicache.storage_worker.prefetch import Prefetcher
from hicache.storage_worker.retry import RetryPolicy
from hicache.storage_worker.sglang_pages import SGLangPagePayload
from hicache.storage_worker.stats import StorageWorkerStats
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError, InvalidInputError
from urc.key import RadixKey
from urc.service import ServiceObserver

if TYPE_CHECKING:
    from hicache.controller import HiCacheController
    from urc.service import AsyncUnifiedRadixCache

__all__ = ["StorageWorker"]

# The storage worker attached to each cache (one at most; see StorageWorker.attach).  Weak
# both ways: a worker holds its cache, so a strong value would keep every cache that ever
# had a worker attached (and its pools) alive for the life of the process.
_ATTACHED: WeakKeyDictionary[UnifiedRadixCache, ref[StorageWorker]] = WeakKeyDictionary()


def _attached(cache: UnifiedRadixCache) -> StorageWorker | None:
    r = _ATTACHED.get(cache)
    return None if r is None else r()


class StorageWorker:
    """Backup to and prefetch from an L3 store for one cache (see the package docstring).

    Build it after :func:`~hicache.host_tier.attach_hicache` (or let :func:`hicache.attach` build
    it); ``controller`` (optional) is used by :meth:`fetch` to load prefetched pages on to
    device.  ``attached=False``: not subscribed to the cache's events yet (a live attach:
    ``svc.attach_worker`` does it inside the actor).  Raises
    :class:`~urc.errors.ConfigError` for EAGLE bigram keys, for a component the storage
    tier cannot store, and, under SGLang's key scheme (``StorageConfig.key_scheme``), for a
    cache with components other than Full or a KV layout SGLang's page payload cannot
    express.
    """

    def __init__(
        self,
        cache: UnifiedRadixCache,
        tier: HostMemoryTier,
        storage: StorageBackend,
        config: StorageConfig | None = None,
        *,
        controller: HiCacheController | None = None,
        observer: ServiceObserver | None = None,
        retry: RetryPolicy | None = None,
        attached: bool = True,
    ) -> None:
        if cache.is_eagle:
            raise ConfigError("the storage tier does not support EAGLE bigram keys")
        self.cache = cache
        self.tier = tier
        self.storage = storage
        self.config = config or StorageConfig()
        self.controller = controller
        self.observer = observer
        self.retry = retry or RetryPolicy()
        self.layouts = PageLayouts(cache, tier)
        self.page_size = cache.page_size
        self.stats = StorageWorkerStats()
        sglang = None
        if self.config.key_scheme is KeyScheme.SGLANG:
            if self.layouts.aux:
                names = ", ".join(ct.name for ct in self.layouts.aux)
                raise ConfigError(f"SGLang's key scheme stores Full pages only, not {names}")
            payload = SGLangPagePayload(self.layouts.full)
            sglang = (self.config.sglang_naming, None if payload.identity else payload)
        calls = StoreCalls(storage, self.stats, self.retry, cache.page_size, observer, sglang)
        ctx = WorkerContext(
            tier, self.layouts, calls, self.config, self.retry, self.stats, observer
        )
        self.writer = BackupWriter(ctx)
        self.prefetcher = Prefetcher(ctx)
        self._subscribed = False
        self._detached = False
        self._draining = False
        # Prefetches in flight (each in a scope a detach can cancel); set when none is.
        # (Created in the event loop: this constructor may run outside one.)
        self._prefetches: set[anyio.CancelScope] = set()
        self._no_prefetch: anyio.Event | None = None
        if attached:
            self.attach(cache)

    # ------------------------------------------------------------------ attach / detach
    @property
    def attached(self) -> bool:
        """Whether the worker hears the cache's events and takes work."""
        return self._subscribed and not self._draining

    def attach(self, cache: UnifiedRadixCache) -> None:
        """Subscribe the writer to ``cache``'s tier events (inside the actor, or on a cache
        no service owns); a no-op when attached.  Raises :class:`~urc.errors.ConfigError`
        for another cache than the worker's, a worker that was detached, or a cache that has
        another storage worker attached (one cache, one L3 worker: e.g. ``attach_storage``
        through a ``HiCache`` handle older than the one that attached the first)."""
        if cache is not self.cache:
            raise ConfigError("a storage worker attaches to the cache it was built for")
        if self._detached:
            raise ConfigError("a detached storage worker is not attached again: build a new one")
        if self._subscribed:
            return
        other = _attached(cache)
        if other is not None and other is not self:
            raise ConfigError(
                "the cache has another storage worker attached (an older HiCache handle?): "
                "detach it first"
            )
        if self.config.backup_policy is not StorageBackupPolicy.OFF:
            cache.subscribe(self.writer)  # its tier events queue the backups
        self._subscribed = True
        _ATTACHED[cache] = ref(self)

    def detach(self, cache: UnifiedRadixCache) -> None:
        """Unsubscribe from ``cache``, drop (and count) the queued backups and take no more
        work; later prefetches are misses.  Raises :class:`~urc.errors.InvalidInputError`,
        changing nothing, while a prefetch or a backup is in flight (they hold pins: drain
        first, as ``svc.detach_worker`` does), and :class:`~urc.errors.ConfigError` for
        another cache."""
        if cache is not self.cache:
            raise ConfigError("a storage worker detaches from the cache it was built for")
        if self._prefetches or self.writer.pinning:
            raise InvalidInputError(
                f"the storage worker is busy ({len(self._prefetches)} prefetches, "
                f"{self.writer.pinning} backups in flight): drain it first"
            )
        cache.unsubscribe(self.writer)
        self.writer.drop_queued()
        if _attached(cache) is self:
            del _ATTACHED[cache]
        self._subscribed = False
        self._draining = True
        self._detached = True

    async def drain(self, svc: AsyncUnifiedRadixCache, timeout_s: float | None = None) -> None:
        """Stop taking work (a new prefetch is a miss, a new backup is dropped and counted),
        flush the queued backups and wait for the prefetches in flight, all within
        ``timeout_s`` (default ``StorageConfig.flush_timeout_s``).  Backups still queued at
        the deadline are dropped (counted in ``dropped_writes``); prefetches still running
        are cancelled (counted in ``cancelled_prefetches``): each frees the host slots it
        reserved and releases its pin on the way out, and returns what it inserted (0 if
        nothing).  Returns when every prefetch has ended."""
        self._draining = True
        timeout = self.config.flush_timeout_s if timeout_s is None else timeout_s
        deadline = anyio.current_time() + timeout
        await self.writer.close(timeout)
        with anyio.move_on_at(deadline):
            await self._prefetches_ended()
        for scope in list(self._prefetches):
            scope.cancel()
            self.stats.cancelled_prefetches += 1
        with anyio.CancelScope(shield=True):
            await self._prefetches_ended()

    async def _prefetches_ended(self) -> None:
        if self._prefetches:
            assert self._no_prefetch is not None
            await self._no_prefetch.wait()

    async def run(self, svc: AsyncUnifiedRadixCache) -> None:
        """Write queued backups until cancelled (by the service's close)."""
        await self.writer.run(svc)

    async def flush(self, timeout_s: float | None = None) -> int:
        """Wait until every queued backup was written or dropped, at most ``timeout_s``
        (default ``StorageConfig.flush_timeout_s``; a store known to be down fails the
        queued writes at once); returns how many were dropped (see
        :meth:`~hicache.storage_worker.backup.BackupWriter.flush`)."""
        return await self.writer.flush(timeout_s)

    async def close(self, timeout_s: float | None = None) -> int:
        """Flush as :meth:`flush` does, then take no more writes (each later one is dropped
        and counted); returns how many the flush dropped.  Call it before closing the
        service: the service's close cancels the worker without flushing."""
        return await self.writer.close(timeout_s)

    async def fetch(
        self, svc: AsyncUnifiedRadixCache, key: RadixKey, stop: anyio.Event | None = None
    ) -> int:
        """:meth:`prefetch` ``key`` into host, then (with a controller) load its host part
        back to device; returns the tokens that came from storage."""
        got = await self.prefetch(svc, key, stop)
        if self.controller is not None:
            await self.controller.load_back(svc, key)
        return got

    async def prefetch(
        self, svc: AsyncUnifiedRadixCache, key: RadixKey, stop: anyio.Event | None = None
    ) -> int:
        """Bring the pages of ``key`` that are in storage but not on host into host memory,
        as host-only nodes; returns the tokens inserted (0: a miss).  See
        :meth:`~hicache.storage_worker.prefetch.Prefetcher.prefetch`.  A detached or draining
        worker reads every prefetch as a miss; a drain may cancel this one (a miss, its
        host slots and pin given back)."""
        if not self.attached:
            self.stats.prefetches += 1
            self.stats.prefetch_misses += 1
            return 0
        scope = anyio.CancelScope()
        if not self._prefetches:
            self._no_prefetch = anyio.Event()
        self._prefetches.add(scope)
        try:
            with scope:
                return await self.prefetcher.prefetch(svc, key, stop)
            return 0  # cancelled by a drain: what it reserved was given back
        finally:
            self._prefetches.discard(scope)
            if not self._prefetches and self._no_prefetch is not None:
                self._no_prefetch.set()
