"""The storage worker under a failing store (issue 15, defects 5 and 6), without a server.

``FlakyStore`` is the file backend with a switch: while ``down`` every call fails, the way
the configured ``failure`` says (a typed ``StorageUnavailableError``, as a backend maps its
transport errors, or an unforeseen ``RuntimeError`` out of a backend's client).  The worker
must count every failed call (``StorageWorkerStats.errors`` and
``urc_storage_errors_total{backend,op}``), back off, retry its backups once the store is
back, and never let a failure reach a caller or the service.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import torch
from cache_harness import pins
from prometheus_client import CollectorRegistry

from hicache.config import HiCacheConfig, StorageConfig
from hicache.controller import HiCacheController
from hicache.storage.errors import StorageUnavailableError
from hicache.storage.file import FileStorage
from hicache.storage.keys import PageKey
from hicache.storage.stats import StorageOp
from hicache.storage_worker import RetryPolicy, StorageWorker
from hicache.tier import attach_hicache
from metrics import CacheMetrics
from urc import CacheConfig, ComponentType, KVShape, RadixKey, build_cache
from urc.cache import UnifiedRadixCache
from urc.service import AsyncUnifiedRadixCache, ServiceState
from urc.tiers import WritePolicy

FULL = ComponentType.FULL
PS = 4
FAST_RETRY = RetryPolicy(initial_s=0.01, max_s=0.05, max_attempts=50)
pytestmark = pytest.mark.timeout(60)


class FlakyStore(FileStorage):
    """A file store that fails every call while ``down`` (with ``failure``)."""

    def __init__(self, root: Path, failure: type[Exception]) -> None:
        super().__init__(root)
        self.failure = failure
        self.down = False
        self.failed_calls = 0
        self.failed_three_times = anyio.Event()

    def _trip(self) -> None:
        if self.down:
            self.failed_calls += 1
            if self.failed_calls >= 3:
                self.failed_three_times.set()
            raise self.failure("the store is down")

    async def _exists(self, keys: Sequence[PageKey]) -> int:
        self._trip()
        return await super()._exists(keys)

    async def _get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        self._trip()
        return await super()._get(keys, buffers)

    async def _put(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        self._trip()
        return await super()._put(keys, buffers)


class Stack:
    def __init__(self, store: FlakyStore) -> None:
        self.cache: UnifiedRadixCache = build_cache(
            CacheConfig(page_size=PS, kv_size=256, kv_shape=KVShape(2, 2, 4, torch.float32))
        )
        hconfig = HiCacheConfig(write_policy=WritePolicy.WRITE_THROUGH, host_tokens=512)
        self.tier = attach_hicache(self.cache, hconfig)
        self.controller = HiCacheController(self.cache, self.tier, hconfig)
        self.registry = CollectorRegistry()
        self.metrics = CacheMetrics(self.registry)
        self.worker = StorageWorker(
            self.cache,
            self.tier,
            store,
            StorageConfig(),
            controller=self.controller,
            observer=self.metrics,
            retry=FAST_RETRY,
        )
        self.store = store
        self.svc = AsyncUnifiedRadixCache(self.cache, workers=[self.controller, self.worker])

    @property
    def kv(self) -> torch.Tensor:
        pool = self.cache.pools.kv_pool
        assert pool is not None
        return pool.kv

    async def put(self, tokens: list[int]) -> torch.Tensor:
        value = await self.svc.alloc(len(tokens))
        data = torch.randn(self.kv[:, :, value].shape)

        def write(cache: UnifiedRadixCache) -> None:
            self.kv[:, :, value] = data

        await self.svc.call(write)
        await self.svc.insert(RadixKey(tokens), value)
        return data

    async def settle(self) -> None:
        while True:
            await anyio.wait_all_tasks_blocked()
            busy = await self.svc.call(lambda c: bool(c.pending_backups or c.backups_in_flight))
            if not busy:
                break
        await self.worker.flush()

    async def drop_device_and_host(self) -> None:
        await self.svc.evict(1 << 20)
        await self.svc.call(lambda c: c.evict_host(1 << 20))
        await self.worker.flush()

    def errors(self, op: StorageOp) -> float:
        value = self.registry.get_sample_value(
            "urc_storage_errors_total", {"backend": "file", "op": op.value}
        )
        return value or 0.0


@asynccontextmanager
async def running(store: FlakyStore) -> AsyncIterator[Stack]:
    stack = Stack(store)
    async with store, stack.svc:
        with anyio.fail_after(45):
            yield stack
            await stack.settle()
            assert stack.svc.state is ServiceState.RUNNING
            assert stack.svc.background_failures == ()
            await stack.svc.sanity_check()
            assert await stack.svc.call(pins) == 0
    stack.cache.sanity_check()
    stack.cache.check_pools({FULL: 0}, {FULL: 0})


def tokens_of(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


@pytest.mark.parametrize("failure", [StorageUnavailableError, RuntimeError])
@pytest.mark.asyncio
async def test_an_outage_is_counted_retried_and_never_fails_the_service(
    tmp_path: Path, failure: type[Exception]
) -> None:
    """During an outage the worker counts every failed call (stats and metrics, by
    operation), fetches read as misses, backups are retried; once the store is back the
    retried backup lands and is fetched back byte-exact."""
    store = FlakyStore(tmp_path / "pages", failure)
    async with running(store) as s:
        store.down = True
        original = await s.put(tokens_of(16))
        # The backup's write fails, and is retried (with backoff) while the store is down.
        await store.failed_three_times.wait()
        assert s.worker.stats.retried_writes >= 2
        assert s.worker.stats.errors >= 3
        assert s.errors(StorageOp.EXISTS) >= 3  # a backup asks what is stored first
        # A prefetch during the outage is a miss (the store failing, or the worker backing
        # off), never an exception.
        assert await s.worker.fetch(s.svc, RadixKey(tokens_of(16, 500))) == 0
        assert s.svc.state is ServiceState.RUNNING
        # Back up: the retried backup is written; the pages come back exact.
        store.down = False
        await s.settle()
        errors = s.worker.stats.errors
        assert s.worker.stats.pages_written == 4
        await s.drop_device_and_host()
        assert await s.worker.fetch(s.svc, RadixKey(tokens_of(16))) == 16
        assert s.worker.stats.errors == errors
        m = await s.svc.match(RadixKey(tokens_of(16)))
        assert m.prefix_len == 16 and torch.equal(s.kv[:, :, m.device_indices], original)
        assert s.errors(StorageOp.EXISTS) + s.errors(StorageOp.GET) + s.errors(
            StorageOp.PUT
        ) == float(s.worker.stats.errors)


@pytest.mark.asyncio
async def test_a_failing_get_mid_prefetch_frees_the_reserved_host_slots(tmp_path: Path) -> None:
    """The store fails between the ``exists`` and the ``get`` of a prefetch: a miss, the
    host slots it reserved are freed and the anchor unpinned (checked by ``running``)."""
    store = FlakyStore(tmp_path / "pages", RuntimeError)
    async with running(store) as s:
        await s.put(tokens_of(32))
        await s.settle()
        await s.drop_device_and_host()
        real_get = store._get

        async def failing_get(keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
            store.down = True
            try:
                return await real_get(keys, buffers)
            finally:
                store.down = False

        store._get = failing_get  # type: ignore[method-assign]
        assert await s.worker.prefetch(s.svc, RadixKey(tokens_of(32))) == 0
        assert s.worker.stats.errors == 1 and s.errors(StorageOp.GET) == 1
        assert s.worker.stats.prefetch_misses == 1
