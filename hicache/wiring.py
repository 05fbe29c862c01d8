"""``hicache.attach`` (defined here, exported by ``hicache``): give a cache its host tier,
and optionally an L3 store, in one call.

::

    hc = hicache.attach(cache, HiCacheConfig(host_ratio=2.0), storage=FileStorage(path))
    async with AsyncUnifiedRadixCache(cache, workers=hc.workers) as svc:
        await hc.controller.load_back(svc, key)   # or hc.storage.fetch(svc, key)

It builds the host pools that mirror every device pool of the cache, attaches them with the
config's write policy, builds the :class:`~hicache.controller.HiCacheController` (backups,
host eviction, load-backs) and, given a store, the
:class:`~hicache.storage_worker.StorageWorker` (L3 backups and prefetches); both subscribe to
the cache's tier events.  The service runs them as background workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.config import HiCacheConfig, StorageConfig
from hicache.controller import HiCacheController
from hicache.host_tier import HostMemoryTier, attach_hicache
from hicache.storage.base import StorageBackend
from hicache.storage_worker import RetryPolicy, StorageWorker
from hicache.transfer_engine import TransferEngine
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError
from urc.service import ServiceObserver

__all__ = ["HiCache", "attach"]


@dataclass(frozen=True, slots=True)
class HiCache:
    """What :func:`attach` built for one cache: the host ``tier``, its ``controller`` and,
    with a store, the ``storage`` worker."""

    tier: HostMemoryTier
    controller: HiCacheController
    storage: StorageWorker | None = None

    @property
    def workers(self) -> tuple[HiCacheController | StorageWorker, ...]:
        """The background workers to pass to the service (``workers=``)."""
        if self.storage is None:
            return (self.controller,)
        return (self.controller, self.storage)


def attach(
    cache: UnifiedRadixCache,
    config: HiCacheConfig,
    storage: StorageBackend | None = None,
    *,
    storage_config: StorageConfig | None = None,
    observer: ServiceObserver | None = None,
    retry: RetryPolicy | None = None,
    copy_in_thread: bool = True,
    engine: TransferEngine | None = None,
) -> HiCache:
    """Attach a host tier sized by ``config`` to ``cache`` and build its workers.

    ``storage``: an L3 store (opened by the caller, who also closes it after the service);
    ``storage_config`` and ``retry`` configure its worker.  ``observer`` (e.g. a
    ``metrics.CacheMetrics``) gets the transfers and storage errors; ``copy_in_thread``: see
    :class:`~hicache.controller.HiCacheController`; ``engine``: where the host tier's copies
    run (default: :func:`~hicache.transfer_engine.engine_for` the pools' device).  Call it
    once per cache, before the service starts (an L3 store can also come later, or go:
    :func:`hicache.attach_storage`, :func:`hicache.detach_storage`).  Raises
    :class:`~urc.errors.ConfigError` when the cache already has a host tier, or a pool cannot
    be mirrored or stored.
    """
    if cache.host_tier is not None:
        raise ConfigError("the cache already has a host tier")
    tier = attach_hicache(cache, config, engine)
    controller = HiCacheController(
        cache, tier, config, observer=observer, copy_in_thread=copy_in_thread
    )
    worker = None
    if storage is not None:
        worker = StorageWorker(
            cache,
            tier,
            storage,
            storage_config,
            controller=controller,
            observer=observer,
            retry=retry,
        )
    return HiCache(tier, controller, worker)
