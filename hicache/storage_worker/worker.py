"""``StorageWorker``: the L3 storage tier's background worker (see :mod:`hicache.storage_worker`).

It puts the pieces of this package together: the store calls (:class:`StoreCalls`), the
writes (:class:`BackupWriter`, its background loop) and the reads (:class:`Prefetcher`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
from urc.errors import ConfigError
from urc.key import RadixKey
from urc.service import ServiceObserver

if TYPE_CHECKING:
    from hicache.controller import HiCacheController
    from urc.service import AsyncUnifiedRadixCache

__all__ = ["StorageWorker"]


class StorageWorker:
    """Backup to and prefetch from an L3 store for one cache (see the package docstring).

    Build it after :func:`~hicache.host_tier.attach_hicache` (or let :func:`hicache.attach` build
    it); ``controller`` (optional) is used by :meth:`fetch` to load prefetched pages on to
    device.  Raises :class:`~urc.errors.ConfigError` for EAGLE bigram keys, for a
    component the storage tier cannot store, and, under SGLang's key scheme
    (``StorageConfig.key_scheme``), for a cache with components other than Full or a KV
    layout SGLang's page payload cannot express.
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
            sglang = (self.config.sglang_naming, SGLangPagePayload(self.layouts.full))
        calls = StoreCalls(storage, self.stats, self.retry, cache.page_size, observer, sglang)
        ctx = WorkerContext(
            tier, self.layouts, calls, self.config, self.retry, self.stats, observer
        )
        self.writer = BackupWriter(ctx)
        self.prefetcher = Prefetcher(ctx)
        if self.config.backup_policy is not StorageBackupPolicy.OFF:
            cache.subscribe(self.writer)  # its tier events queue the backups

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
        :meth:`~hicache.storage_worker.prefetch.Prefetcher.prefetch`."""
        return await self.prefetcher.prefetch(svc, key, stop)
