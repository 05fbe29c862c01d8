"""``WorkerContext``: what the writer and the prefetcher of one storage worker share."""

from __future__ import annotations

from dataclasses import dataclass

from hicache.config import StorageConfig
from hicache.host_tier import HostMemoryTier
from hicache.storage_worker.calls import StoreCalls
from hicache.storage_worker.layout import PageLayouts
from hicache.storage_worker.retry import RetryPolicy
from hicache.storage_worker.stats import StorageWorkerStats
from urc.service import ServiceObserver

__all__ = ["WorkerContext"]


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """The host tier, its page layouts, the counted store calls, the configuration, the
    retry policy, the counters and the transfer observer of one worker."""

    tier: HostMemoryTier
    layouts: PageLayouts
    calls: StoreCalls
    config: StorageConfig
    retry: RetryPolicy
    stats: StorageWorkerStats
    observer: ServiceObserver | None
