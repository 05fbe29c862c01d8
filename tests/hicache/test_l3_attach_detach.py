"""Attach and detach the L3 store on a live service (sglang issue 32817 for the unified tree).

``hicache.attach_storage`` / ``hicache.detach_storage`` (through ``svc.attach_worker`` /
``svc.detach_worker`` and the ``AttachWorker`` / ``DetachWorker`` commands), and the
synchronous ``StorageWorker.attach`` / ``detach``: backups and prefetches in flight finish
or are given back, no pin leaks (``host_lock_ref``, device locks), pools are conserved, and
hit rates resume after a new attach over the same store.  Every test ends with
``sanity_check``, pool conservation and no pin left behind.
"""

from __future__ import annotations

import asyncio
import gc
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch
from cache_harness import pins
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_harness import put_random_kv, wait_host_backups
from test_service_ownership import CancelTaskOnApply

import hicache
from hicache import HiCache, HiCacheConfig
from hicache.config import PrefetchStopPolicy, StorageConfig
from hicache.storage.file import FileStorage
from hicache.storage.keys import PageKey
from hicache.storage_worker import RetryPolicy, StorageWorker
from urc import CacheConfig, ComponentType, InsertParams, KVShape, RadixKey, build_cache
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError, InvalidInputError
from urc.host_protocol import WritePolicy
from urc.params import MatchPrefixParams
from urc.service import AsyncUnifiedRadixCache, ServiceState
from urc.service._commands import AttachWorker

FULL = ComponentType.FULL
PAGE_SIZES = [1, 4, 16]
FAST_RETRY = RetryPolicy(initial_s=0.01, max_s=0.05, max_attempts=50)
pytestmark = pytest.mark.timeout(60)


class GatedStore(FileStorage):
    """The file store whose reads (``gate_reads``) or writes (``gate_writes``) wait for
    ``gate`` to open: a store slow enough for a detach to find work in flight."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = anyio.Event()
        self.gate.set()
        self.gate_reads = False
        self.gate_writes = False
        self.waiting = 0

    def close_gate(self) -> None:
        self.gate = anyio.Event()

    async def _wait(self) -> None:
        self.waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1

    async def _get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        if self.gate_reads:
            await self._wait()
        return await super()._get(keys, buffers)

    async def _put(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        if self.gate_writes:
            await self._wait()
        return await super()._put(keys, buffers)


class Stack:
    """A service over a Full cache with a write-through host tier and no L3 store yet."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.cache: UnifiedRadixCache = build_cache(
            CacheConfig(page_size=page_size, kv_size=256, kv_shape=KVShape(2, 2, 4, torch.float32))
        )
        self.hc: HiCache = hicache.attach(
            self.cache, HiCacheConfig(write_policy=WritePolicy.WRITE_THROUGH, host_tokens=512)
        )
        self.svc = AsyncUnifiedRadixCache(self.cache, workers=self.hc.workers)

    @property
    def worker(self) -> StorageWorker:
        assert self.hc.storage is not None
        return self.hc.storage

    @property
    def kv(self) -> torch.Tensor:
        pool = self.cache.pools.kv_pool
        assert pool is not None
        return pool.kv

    async def attach(
        self, store: FileStorage, config: StorageConfig | None = None
    ) -> StorageWorker:
        self.hc = await hicache.attach_storage(
            self.svc, self.hc, store, storage_config=config, retry=FAST_RETRY
        )
        return self.worker

    async def detach(self, timeout_s: float | None = None) -> StorageWorker:
        worker = self.worker
        self.hc = await hicache.detach_storage(self.svc, self.hc, timeout_s)
        return worker

    async def put(self, tokens: list[int]) -> torch.Tensor:
        """Insert ``tokens`` with random KV bytes; returns those bytes."""
        return await put_random_kv(self.svc, self.kv, tokens)

    async def settle(self) -> None:
        """Host backups committed, and the attached worker's writes finished."""
        await wait_host_backups(self.svc)
        if self.hc.storage is not None:
            await self.hc.storage.flush()

    async def drop_device_and_host(self) -> None:
        await self.svc.evict(1 << 20)
        await self.svc.call(lambda c: c.evict_host(1 << 20))

    async def check(self) -> None:
        """No leak: invariants, pool conservation, no pin, the service healthy."""
        assert self.svc.state is ServiceState.RUNNING
        assert self.svc.background_failures == ()
        await self.svc.sanity_check()
        assert await self.svc.call(pins) == 0

    def check_closed(self) -> None:
        self.cache.sanity_check()
        self.cache.check_pools({FULL: 0}, {FULL: 0})


def tokens_of(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.asyncio
async def test_an_attach_on_a_live_service_backs_up_and_serves_hits(
    tmp_path: Path, ps: int
) -> None:
    """No store at start; attached while serving: later host backups are written to it,
    and a prefix evicted from device and host comes back from it byte-exact.  Detached:
    the same prefix is a miss (the store is no longer asked); attached again (a new
    worker over the same store): the hit is back."""
    s = Stack(ps)
    store = FileStorage(tmp_path / "pages")
    async with store, s.svc:
        with anyio.fail_after(30):
            before = tokens_of(16, 100)
            await s.put(before)  # backed up to host with no store attached: never written
            await s.settle()
            assert s.cache.tier_events == (s.hc.controller,)
            worker = await s.attach(store)
            assert worker.attached and worker.writer in s.cache.tier_events
            after = tokens_of(32, 1000)
            original = await s.put(after)
            await s.settle()
            assert worker.stats.pages_written == 32 // ps
            await s.drop_device_and_host()
            assert await worker.fetch(s.svc, RadixKey(before)) == 0
            assert await worker.fetch(s.svc, RadixKey(after)) == 32
            m = await s.svc.match(RadixKey(after))
            assert m.prefix_len == 32 and torch.equal(s.kv[:, :, m.device_indices], original)
            await s.check()

            await s.detach()
            assert not worker.attached and worker.writer not in s.cache.tier_events
            await s.drop_device_and_host()
            assert await worker.prefetch(s.svc, RadixKey(after)) == 0  # detached: a miss
            await s.check()

            again = await s.attach(store)
            assert again is not worker
            assert await again.fetch(s.svc, RadixKey(after)) == 32
            m = await s.svc.match(RadixKey(after))
            assert m.prefix_len == 32 and torch.equal(s.kv[:, :, m.device_indices], original)
            await s.check()
    s.check_closed()


@pytest.mark.asyncio
async def test_a_detach_gives_back_a_prefetch_stuck_in_the_store(tmp_path: Path) -> None:
    """A prefetch waits on a store that does not answer, holding reserved host slots and a
    host lock on the node where the key's host copies end; a detach past its deadline
    cancels it: a miss for its caller, the slots freed, the pin released.  (The prefetch
    waits for every page: only the detach can end it.)"""
    s = Stack(4)
    store = GatedStore(tmp_path / "pages")
    async with store, s.svc:
        with anyio.fail_after(30):
            worker = await s.attach(
                store, StorageConfig(prefetch_policy=PrefetchStopPolicy.WAIT_COMPLETE)
            )
            await s.put(tokens_of(16))
            await s.put(tokens_of(32))  # a second node, below the first
            await s.settle()
            await s.svc.evict(1 << 20)  # device copies go; host copies stay ...
            # ... and the lower node's host copy goes too (the store still has it).
            await s.svc.call(lambda c: c.evict_host(16))
            host_free = s.hc.tier.host_available(FULL)
            store.gate_reads = True
            store.close_gate()
            got: list[int] = []
            async with anyio.create_task_group() as tg:

                async def fetch() -> None:
                    got.append(await worker.prefetch(s.svc, RadixKey(tokens_of(32))))

                tg.start_soon(fetch)
                while store.waiting == 0:
                    await anyio.wait_all_tasks_blocked()
                assert await s.svc.call(pins) == 1  # the anchor's host lock
                assert s.hc.tier.host_available(FULL) < host_free  # reserved slots
                await s.detach(timeout_s=0.1)
            assert got == [0]
            assert worker.stats.cancelled_prefetches == 1
            assert s.hc.tier.host_available(FULL) == host_free
            await s.check()
            store.gate.set()
    s.check_closed()


@pytest.mark.parametrize("gated", [False, True], ids=["flushed", "dropped"])
@pytest.mark.asyncio
async def test_a_detach_flushes_queued_backups_then_takes_no_more(
    tmp_path: Path, gated: bool
) -> None:
    """Backups queued when the detach starts are written (a store that answers) or, past
    the deadline, dropped and counted (a store that hangs: the write in flight is cancelled
    and its host locks released); afterwards new host backups reach no worker."""
    s = Stack(4)
    store = GatedStore(tmp_path / "pages")
    async with store, s.svc:
        with anyio.fail_after(30):
            worker = await s.attach(store)
            if gated:
                store.gate_writes = True
                store.close_gate()
            for i in range(6):
                await s.put(tokens_of(8, 1000 * i))
            while True:  # every host backup committed (so its storage write is queued)
                await anyio.wait_all_tasks_blocked()
                if not await s.svc.call(lambda c: bool(c.pending_backups or c.backups_in_flight)):
                    break
            await s.detach(timeout_s=0.2)
            stats = worker.stats
            if gated:
                assert stats.pages_written == 0 and stats.dropped_writes >= 1
            else:
                assert stats.pages_written == 12 and stats.dropped_writes == 0
            dropped = stats.dropped_writes
            await s.put(tokens_of(8, 99_000))
            await s.settle()
            assert worker.stats.dropped_writes == dropped  # unsubscribed: never queued
            await s.check()
            store.gate.set()
    s.check_closed()


@pytest.mark.asyncio
async def test_attach_and_detach_while_traffic_runs_leak_nothing(tmp_path: Path) -> None:
    """Four clients insert and fetch while the store is detached and attached again three
    times: no client sees an error, no pin or slot leaks, and once attached for good the
    prefixes written meanwhile come back from the store."""
    s = Stack(4)
    store = FileStorage(tmp_path / "pages")
    rounds = 12
    async with store, s.svc:
        with anyio.fail_after(45):
            await s.attach(store)
            written: list[list[int]] = []

            async def client(c: int) -> None:
                for r in range(rounds):
                    tokens = tokens_of(16, 10_000 * c + 100 * r)
                    await s.put(tokens)
                    written.append(tokens)
                    worker = s.hc.storage
                    if worker is not None:
                        await worker.fetch(s.svc, RadixKey(tokens_of(16, 10_000 * c)))
                    await anyio.sleep(0)

            async with anyio.create_task_group() as tg:
                for c in range(4):
                    tg.start_soon(client, c)
                for _ in range(3):
                    await anyio.wait_all_tasks_blocked()
                    await s.detach(timeout_s=1.0)
                    await anyio.sleep(0)
                    await s.attach(store)
            await s.settle()
            await s.check()
            # Write everything again through the final worker, then read it all back.
            for tokens in written:
                await s.put(tokens)  # already cached: no new backup, the host copy stays
            await s.settle()
            await s.drop_device_and_host()
            last = tokens_of(16, 10_000 * 3 + 100 * (rounds - 1))
            assert await s.worker.fetch(s.svc, RadixKey(last)) == 16
            await s.check()
    s.check_closed()


@pytest.mark.asyncio
async def test_an_attach_whose_caller_is_cancelled_natively_is_undone(tmp_path: Path) -> None:
    """``Task.cancel()`` right after the actor applied ``AttachWorker``: the caller never
    starts the worker, and the service detaches it again (its give-back), so no worker
    hears the cache's events without running."""
    hook = CancelTaskOnApply(AttachWorker)
    cache = build_cache(CacheConfig(page_size=4, kv_size=256))
    hc = hicache.attach(cache, HiCacheConfig(host_tokens=512))
    store = FileStorage(tmp_path / "pages")
    async with store, AsyncUnifiedRadixCache(cache, workers=hc.workers, trace=hook) as svc:
        with anyio.fail_after(30):
            worker = StorageWorker(cache, hc.tier, store, attached=False)
            task = asyncio.ensure_future(svc.attach_worker(worker))
            hook.victim = task
            with pytest.raises(asyncio.CancelledError):
                await task
            assert hook.fired == 1
            await svc.sanity_check()
            assert worker.writer not in cache.tier_events and not worker.attached
    cache.sanity_check()


@pytest.mark.asyncio
async def test_attach_and_detach_refuse_bad_calls_without_changing_anything(
    tmp_path: Path,
) -> None:
    """A second attach, a detach of a worker never attached, something that is no worker,
    and a detached worker attached again: typed errors, the service unchanged."""
    s = Stack(4)
    store = FileStorage(tmp_path / "pages")
    async with store, s.svc:
        with anyio.fail_after(30):
            worker = await s.attach(store)
            with pytest.raises(ConfigError):
                await hicache.attach_storage(s.svc, s.hc, store)
            with pytest.raises(InvalidInputError):
                await s.svc.attach_worker(worker)
            with pytest.raises(InvalidInputError):
                await s.svc.attach_worker(object())  # type: ignore[arg-type]
            stranger = StorageWorker(s.cache, s.hc.tier, store, attached=False)
            with pytest.raises(InvalidInputError):
                await s.svc.detach_worker(stranger)
            await s.detach()
            with pytest.raises(ConfigError):
                await hicache.detach_storage(s.svc, s.hc)
            with pytest.raises(ConfigError):
                await s.svc.attach_worker(worker)  # detached: build a new one
            assert s.cache.tier_events == (s.hc.controller,)
            await s.check()
    s.check_closed()


@pytest.mark.asyncio
async def test_an_attach_through_an_older_handle_is_refused(tmp_path: Path) -> None:
    """Issue 50 item 9: the ``HiCache`` handle from before an attach has no storage, so an
    attach through it used to add a second storage worker to the cache silently."""
    s = Stack(4)
    store = FileStorage(tmp_path / "pages")
    other = FileStorage(tmp_path / "other")
    async with store, other, s.svc:
        with anyio.fail_after(30):
            old = s.hc
            worker = await s.attach(store)
            with pytest.raises(ConfigError, match="another storage worker"):
                await hicache.attach_storage(s.svc, old, other)
            assert s.cache.tier_events == (s.hc.controller, worker.writer)
            await s.detach()
            again = await hicache.attach_storage(s.svc, old, other)  # none attached now: fine
            assert again.storage is not None and again.storage.attached
            s.hc = again
            await s.detach()
            await s.check()
    s.check_closed()


def test_a_cache_with_a_storage_worker_attached_is_freed_once_unreferenced(
    tmp_path: Path,
) -> None:
    """The one-worker-per-cache registry held its workers strongly, and a worker holds its
    cache: every cache that ever had a storage worker attached stayed alive with its pools
    (the unit suite grew past 12 GB).  Dropped by its owner, the cache is freed."""

    def attached_cache() -> weakref.ref[UnifiedRadixCache]:
        cache = build_cache(CacheConfig(page_size=4, kv_size=256))
        hc = hicache.attach(cache, HiCacheConfig(write_policy=WritePolicy.WRITE_THROUGH))
        StorageWorker(cache, hc.tier, FileStorage(tmp_path / "pages"), attached=False).attach(cache)
        return weakref.ref(cache)

    refs = [attached_cache() for _ in range(3)]
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_the_synchronous_api_attaches_and_detaches_without_a_service(tmp_path: Path) -> None:
    """``StorageWorker.attach`` / ``detach`` on a cache no service owns: attached, host
    backups queue writes; detached, the queue is dropped and counted, later backups reach
    nothing, prefetches are misses; a worker busy with pins refuses to detach."""
    cache = build_cache(CacheConfig(page_size=4, kv_size=256))
    hc = hicache.attach(cache, HiCacheConfig(write_policy=WritePolicy.WRITE_THROUGH))
    worker = StorageWorker(cache, hc.tier, FileStorage(tmp_path / "pages"), attached=False)
    assert not worker.attached and worker.writer not in cache.tier_events
    worker.attach(cache)
    worker.attach(cache)  # attached already: nothing changes
    assert cache.tier_events == (hc.controller, worker.writer)
    value = cache.token_to_kv_pool_allocator.alloc(8)
    assert value is not None
    cache.insert(InsertParams(key=RadixKey(tokens_of(8)), value=value))
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens_of(8)))).last_device_node
    assert cache.write_backup(node) > 0  # host copy committed: a storage write queued
    worker.writer.pinning = 1  # a write-through job holding host locks
    with pytest.raises(InvalidInputError):
        worker.detach(cache)
    assert worker.attached
    worker.writer.pinning = 0
    worker.detach(cache)
    assert worker.stats.dropped_writes == 1 and cache.tier_events == (hc.controller,)
    with pytest.raises(ConfigError):
        worker.attach(cache)
    other = build_cache(CacheConfig(page_size=4, kv_size=256))
    with pytest.raises(ConfigError):
        StorageWorker(other, hc.tier, FileStorage(tmp_path / "other"), attached=False).attach(cache)
    assert pins(cache) == 0
    cache.sanity_check()


_step = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 5)),
    st.tuples(st.just("fetch"), st.integers(0, 5)),
    st.tuples(st.just("fetch_during_detach"), st.integers(0, 5)),
    st.tuples(st.just("detach"), st.just(0)),
    st.tuples(st.just("attach"), st.just(0)),
    st.tuples(st.just("evict"), st.just(0)),
)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ps=st.sampled_from([1, 4]), steps=st.lists(_step, min_size=4, max_size=16))
def test_random_attach_detach_sequences_keep_invariants(
    ps: int, steps: list[tuple[str, int]]
) -> None:
    """Inserts, fetches (some racing a detach), detaches, attaches and evictions in any
    order: after every step the tree's invariants hold and no pin is left; in the end,
    attached, every prefix backed up comes back from the store."""

    def key(i: int) -> list[int]:  # six prefixes sharing their first 8 tokens
        return tokens_of(8) + tokens_of(8, 1000 * (i + 1))

    async def body(root: Path) -> None:
        s = Stack(ps)
        store = FileStorage(root)
        async with store, s.svc:
            with anyio.fail_after(30):
                await s.attach(store)
                for op, i in steps:
                    worker = s.hc.storage
                    if op == "put":
                        await s.put(key(i))
                    elif op == "fetch" and worker is not None:
                        assert 0 <= await worker.fetch(s.svc, RadixKey(key(i))) <= 16
                    elif op == "fetch_during_detach" and worker is not None:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(worker.fetch, s.svc, RadixKey(key(i)))
                            await s.detach(timeout_s=0.05)
                    elif op == "detach" and worker is not None:
                        await s.detach(timeout_s=1.0)
                    elif op == "attach" and worker is None:
                        await s.attach(store)
                    elif op == "evict":
                        await s.drop_device_and_host()
                    await s.settle()
                    await s.check()
                if s.hc.storage is None:
                    await s.attach(store)
                # Host copies made while detached are written when backed up again.
                await s.drop_device_and_host()
                for i in range(6):
                    await s.put(key(i))
                await s.settle()
                await s.drop_device_and_host()
                for i in range(6):
                    assert await s.worker.prefetch(s.svc, RadixKey(key(i))) > 0
                await s.check()
        s.check_closed()

    with tempfile.TemporaryDirectory(prefix="urc-l3-attach-") as tmp:
        anyio.run(body, Path(tmp))
