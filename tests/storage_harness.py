"""A cache stack for storage fault tests: service + HiCache controller + storage worker.

Full only, page size 4, a 256-token device pool with real KV bytes, write-through host
backup, the worker reporting to a Prometheus exporter on its own registry (so the
``urc_storage_errors_total`` counter can be read back).
"""

from __future__ import annotations

import anyio
import torch
from prometheus_client import CollectorRegistry

import hicache
from hicache.config import HiCacheConfig, StorageConfig
from hicache.host_layout import HostLayout
from hicache.storage.base import StorageBackend
from hicache.storage.stats import StorageOp
from hicache.storage_worker import RetryPolicy
from metrics import CacheMetrics
from urc import CacheConfig, KVShape, RadixKey, build_cache
from urc.cache import UnifiedRadixCache
from urc.host_protocol import WritePolicy
from urc.service import AsyncUnifiedRadixCache, TraceHook
from urc.service._observer import ServiceObserver

PS = 4


async def put_random_kv(
    svc: AsyncUnifiedRadixCache,
    kv: torch.Tensor,
    tokens: list[int],
    ns: tuple[str, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Allocate slots through ``svc``, write random KV bytes (of ``dtype``) into ``kv`` at
    them, and insert ``tokens`` (in namespace ``ns``) there; returns those bytes."""
    value = await svc.alloc(len(tokens))
    data = torch.randn(kv[:, :, value].shape)
    if dtype is not None:
        data = data.to(dtype)

    def write(cache: UnifiedRadixCache) -> None:
        kv[:, :, value] = data

    await svc.call(write)
    await svc.insert(RadixKey(tokens, ns), value)
    return data


async def wait_host_backups(svc: AsyncUnifiedRadixCache) -> None:
    """Wait until ``svc`` has no host backup pending or in flight."""
    while True:
        await anyio.wait_all_tasks_blocked()
        if not await svc.call(lambda c: bool(c.pending_backups or c.backups_in_flight)):
            return


class L3Stack:
    """The stack over ``store``; ``svc`` is not entered yet (``trace``: its trace hook;
    ``host_layout``: the host pool's layout, default the device's)."""

    def __init__(
        self,
        store: StorageBackend,
        *,
        host_tokens: int,
        retry: RetryPolicy | None = None,
        trace: TraceHook | None = None,
        storage_config: StorageConfig | None = None,
        observer: ServiceObserver | None = None,
        host_layout: HostLayout | None = None,
    ) -> None:
        self.cache: UnifiedRadixCache = build_cache(
            CacheConfig(page_size=PS, kv_size=256, kv_shape=KVShape(2, 2, 4, torch.float32))
        )
        hconfig = HiCacheConfig(
            write_policy=WritePolicy.WRITE_THROUGH, host_tokens=host_tokens, host_layout=host_layout
        )
        self.registry = CollectorRegistry()
        hc = hicache.attach(
            self.cache,
            hconfig,
            store,
            storage_config=storage_config,
            observer=observer if observer is not None else CacheMetrics(self.registry),
            retry=retry,
        )
        assert hc.storage is not None
        self.tier, self.controller, self.worker = hc.tier, hc.controller, hc.storage
        self.store = store
        self.svc = AsyncUnifiedRadixCache(self.cache, workers=hc.workers, trace=trace)

    @property
    def kv(self) -> torch.Tensor:
        pool = self.cache.pools.kv_pool
        assert pool is not None
        return pool.kv

    async def put(self, tokens: list[int], ns: tuple[str, ...] | None = None) -> torch.Tensor:
        """Insert ``tokens`` (in namespace ``ns``) with random KV bytes; returns those bytes."""
        return await put_random_kv(self.svc, self.kv, tokens, ns)

    async def settle(self) -> None:
        """Wait until host backups are committed and every storage write finished."""
        await wait_host_backups(self.svc)
        await self.worker.flush()

    async def drop_device_and_host(self) -> None:
        """Evict everything from device and host."""
        await self.svc.evict(1 << 20)
        await self.svc.call(lambda c: c.evict_host(1 << 20))
        await self.worker.flush()

    def storage_errors(self, op: StorageOp | None = None) -> float:
        """``urc_storage_errors_total`` of this stack's backend: of ``op``, or of all."""
        ops = list(StorageOp) if op is None else [op]
        return sum(
            self.registry.get_sample_value(
                "urc_storage_errors_total", {"backend": self.store.name, "op": o.value}
            )
            or 0.0
            for o in ops
        )
