"""The storage worker under a failing store (issue 15, defects 5 and 6), without a server.

``FlakyStore`` is the file backend with a switch: while ``down`` every call fails, the way
the configured ``failure`` says (a typed ``StorageUnavailableError``, as a backend maps its
transport errors, or an unforeseen ``RuntimeError`` out of a backend's client).  The worker
must count every failed call (``StorageWorkerStats.errors`` and
``urc_storage_errors_total{backend,op}``), back off, retry its backups once the store is
back, and never let a failure reach a caller or the service.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import torch
from cache_harness import pins
from storage_harness import L3Stack
from test_service_ownership import CancelTaskOnApply

from hicache.config import StorageConfig
from hicache.storage.errors import StorageUnavailableError
from hicache.storage.file import FileStorage
from hicache.storage.keys import PageKey
from hicache.storage.stats import StorageOp
from hicache.storage_worker import RetryPolicy
from urc import ComponentType, RadixKey
from urc.service import ServiceState
from urc.service._commands import Call

FULL = ComponentType.FULL
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


@asynccontextmanager
async def running(store: FlakyStore) -> AsyncIterator[L3Stack]:
    stack = L3Stack(store, host_tokens=512, retry=FAST_RETRY)
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
        assert s.storage_errors(StorageOp.EXISTS) >= 3  # a backup asks what is stored first
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
        assert s.storage_errors() == float(s.worker.stats.errors)


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
        assert s.worker.stats.errors == 1 and s.storage_errors(StorageOp.GET) == 1
        assert s.worker.stats.prefetch_misses == 1


@pytest.mark.asyncio
async def test_a_natively_cancelled_prefetch_unpins_the_host_node_it_starts_from(
    tmp_path: Path,
) -> None:
    """``Task.cancel()`` right after the actor host-locked the node where the key's host
    copies end: the caller never gets that pin, the service's ``undo`` drops it."""
    hook = CancelTaskOnApply(Call)
    store = FileStorage(tmp_path / "pages")
    s = L3Stack(store, host_tokens=512, retry=FAST_RETRY, trace=hook)
    async with store, s.svc:
        with anyio.fail_after(30):
            await s.put(tokens_of(16))
            await s.settle()
            await s.svc.evict(1 << 20)  # device copies go, host copies stay
            task = asyncio.ensure_future(s.worker.prefetch(s.svc, RadixKey(tokens_of(32))))
            hook.victim = task
            with pytest.raises(asyncio.CancelledError):
                await task
            assert hook.fired == 1
            assert await s.svc.call(pins) == 0
            await s.svc.sanity_check()
    s.cache.check_pools({FULL: 0}, {FULL: 0})


# ---------------------------------------------------------------------- issue 33, defect 4
async def host_backups_landed(stack: L3Stack) -> None:
    """Wait until every host backup was committed (so its storage write is queued)."""
    with anyio.fail_after(10):
        while True:
            await anyio.wait_all_tasks_blocked()
            if not await stack.svc.call(lambda c: bool(c.pending_backups or c.backups_in_flight)):
                return


@pytest.mark.parametrize("how", ["flush", "close"])
@pytest.mark.asyncio
async def test_flushing_queued_writes_to_a_dead_store_is_bounded_and_counted(
    tmp_path: Path, how: str
) -> None:
    """24 queued writes, the store down, the default retry policy (each write retried with
    its own back-off: minutes): once the store is known to be down the queue fails fast, and
    ``close()`` returns within its flush timeout, counting every write it dropped."""
    store = FlakyStore(tmp_path / "pages", StorageUnavailableError)
    stack = L3Stack(store, host_tokens=512, storage_config=StorageConfig(flush_timeout_s=20.0))
    async with store, stack.svc:
        store.down = True
        for i in range(24):
            await stack.put(tokens_of(4, 1000 * i))
        await host_backups_landed(stack)
        with anyio.fail_after(10):  # the default RetryPolicy alone would take ~4 minutes
            dropped = await getattr(stack.worker, how)()
        stats = stack.worker.stats
        assert stats.pages_written == 0 and dropped == stats.dropped_writes >= 1
        assert stats.errors >= RetryPolicy().down_after
        if how == "close":  # closed: a later write is refused and counted
            await stack.put(tokens_of(4, 99_000))
            await anyio.wait_all_tasks_blocked()
            await stack.svc.call(lambda c: None)
        assert stack.svc.state is ServiceState.RUNNING
        await stack.svc.sanity_check()
    stack.cache.sanity_check()


@pytest.mark.asyncio
async def test_a_flush_deadline_drops_what_is_still_queued(tmp_path: Path) -> None:
    """A store that is slow rather than down: the flush returns at its deadline and counts
    the writes it gave up on."""
    store = FlakyStore(tmp_path / "pages", StorageUnavailableError)
    stack = L3Stack(store, host_tokens=512, retry=RetryPolicy(initial_s=1.0, max_s=1.0))
    async with store, stack.svc:
        store.down = True
        for i in range(8):
            await stack.put(tokens_of(4, 1000 * i))
        await host_backups_landed(stack)
        with anyio.fail_after(10):
            dropped = await stack.worker.flush(timeout_s=0.2)
        assert dropped >= 1 and stack.worker.stats.dropped_writes >= dropped
        store.down = False
    stack.cache.sanity_check()
