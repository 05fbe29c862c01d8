"""``attach_storage`` / ``detach_storage`` (exported by ``hicache``): give a running service's
HiCache an L3 store, or take it away, without restarting the service.

::

    hc = await hicache.attach_storage(svc, hc, store)   # hc.storage: the new worker
    ...
    hc = await hicache.detach_storage(svc, hc)          # hc.storage is None again
    await store.close()                                 # the caller's store

The worker is built unsubscribed and attached through the service
(:meth:`~urc.service.AsyncUnifiedRadixCache.attach_worker`: inside the actor it subscribes
to the cache's tier events, then its write loop starts).  A detach
(:meth:`~urc.service.AsyncUnifiedRadixCache.detach_worker`) drains it first
(:meth:`~hicache.storage_worker.StorageWorker.drain`: queued backups flushed within the
timeout, prefetches in flight finished or cancelled with their host slots and pins given
back), then stops it and unsubscribes it.  Pages already stored stay in the store: a new
worker over the same store finds them again.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hicache.config import StorageConfig
from hicache.storage.base import StorageBackend
from hicache.storage_worker import RetryPolicy, StorageWorker
from hicache.wiring import HiCache
from urc.errors import ConfigError
from urc.service import ServiceObserver

if TYPE_CHECKING:
    from urc.service import AsyncUnifiedRadixCache

__all__ = ["attach_storage", "detach_storage"]


async def attach_storage(
    svc: AsyncUnifiedRadixCache,
    hc: HiCache,
    storage: StorageBackend,
    *,
    storage_config: StorageConfig | None = None,
    observer: ServiceObserver | None = None,
    retry: RetryPolicy | None = None,
) -> HiCache:
    """Attach ``storage`` (opened by the caller) to ``hc``'s cache served by ``svc``;
    returns ``hc`` with its new ``storage`` worker (``hc`` itself is unchanged).

    Raises :class:`~urc.errors.ConfigError` when ``hc`` has a store attached already, or
    the worker cannot be built (EAGLE keys, a component the tier cannot store), and
    :class:`~urc.errors.ServiceClosedError` unless ``svc`` runs.
    """
    if hc.storage is not None:
        raise ConfigError("the HiCache has an L3 store attached already: detach it first")
    worker = StorageWorker(
        svc.cache,
        hc.tier,
        storage,
        storage_config,
        controller=hc.controller,
        observer=observer,
        retry=retry,
        attached=False,
    )
    await svc.attach_worker(worker)
    return dataclasses.replace(hc, storage=worker)


async def detach_storage(
    svc: AsyncUnifiedRadixCache, hc: HiCache, timeout_s: float | None = None
) -> HiCache:
    """Detach ``hc``'s L3 store from ``svc`` (see the module docstring; ``timeout_s``
    bounds the drain, default ``StorageConfig.flush_timeout_s``); returns ``hc`` without
    it.  The store is not closed: its owner closes it.  Raises
    :class:`~urc.errors.ConfigError` when ``hc`` has no store attached."""
    if hc.storage is None:
        raise ConfigError("the HiCache has no L3 store attached")
    await svc.detach_worker(hc.storage, timeout_s)
    return dataclasses.replace(hc, storage=None)
