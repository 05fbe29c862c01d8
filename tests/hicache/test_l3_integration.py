"""The L3 storage tier inside the service: backup to storage, prefetch back, faults.

Every scenario runs the real stack: ``AsyncUnifiedRadixCache`` with the ``HiCacheController``
(device <-> host) and the ``StorageWorker`` (host <-> store), on the file backend, one Valkey
node and a 3-node Valkey cluster.  Every test ends with ``sanity_check``, device + host pool
conservation and no pin left behind.
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from cache_harness import pins
from storage_harness import L3Stack
from valkey_server import (
    ValkeyCluster,
    ValkeyNode,
    find_server_binary,
    running_cluster,
    running_node,
)

from hicache.config import HiCacheConfig, PrefetchStopPolicy, StorageBackupPolicy, StorageConfig
from hicache.host_layout import HostLayout
from hicache.host_tier import attach_hicache
from hicache.storage.base import StorageBackend
from hicache.storage.file import FileStorage
from hicache.storage.keys import PageKey
from hicache.storage_worker import HostPageLayout, StorageWorker
from hicache.storage_worker.jobs import path_of, path_tokens
from urc import CacheConfig, ComponentType, ConfigError, KVShape, RadixKey, build_cache
from urc.cache import UnifiedRadixCache
from urc.node import Tier
from urc.service._observer import TransferKind

FULL = ComponentType.FULL
PS = 4
BINARY = find_server_binary()
needs_valkey = pytest.mark.skipif(BINARY is None, reason="no valkey-server binary")
pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------- backends
@pytest.fixture(scope="module")
def node() -> Iterator[ValkeyNode]:
    if BINARY is None:
        pytest.skip("no valkey-server binary")
    with running_node(Path(BINARY)) as server:
        yield server


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    if BINARY is None:
        pytest.skip("no valkey-server binary")
    with running_cluster(Path(BINARY)) as servers:
        yield servers


def valkey(addresses: Sequence[tuple[str, int]], cluster: bool, prefix: str) -> StorageBackend:
    from hicache.storage.valkey import ValkeyConfig, ValkeyStorage

    return ValkeyStorage(
        ValkeyConfig(addresses=tuple(addresses), cluster=cluster, key_prefix=prefix)
    )


StoreFactory = Callable[[], StorageBackend]


@pytest.fixture(
    params=[
        "file",
        pytest.param("valkey", marks=needs_valkey),
        pytest.param("cluster", marks=needs_valkey),
    ]
)
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """A factory of backends that share one store (a directory, or a key prefix)."""
    prefix = f"l3{secrets.token_hex(4)}:"
    if request.param == "file":
        return lambda: FileStorage(tmp_path / "pages")
    if request.param == "valkey":
        server: ValkeyNode = request.getfixturevalue("node")
        return lambda: valkey([server.address], False, prefix)
    servers: ValkeyCluster = request.getfixturevalue("cluster")
    return lambda: valkey(servers.addresses, True, prefix)


# ---------------------------------------------------------------------- a cache stack
class Recorder:
    def __init__(self) -> None:
        self.transfers: list[tuple[TransferKind, int]] = []

    def on_command(self, *args: Any) -> None:
        pass

    def on_batch(self, *args: Any) -> None:
        pass

    def on_transfer(self, kind: TransferKind, tokens: int, nbytes: int, seconds: float) -> None:
        self.transfers.append((kind, tokens))


class Stack(L3Stack):
    """The storage harness's stack with a transfer recorder, plus pool scribbling and byte
    reads for the round-trip checks."""

    def __init__(
        self,
        store: StorageBackend,
        config: StorageConfig,
        host_tokens: int,
        host_layout: HostLayout | None = None,
    ) -> None:
        self.recorder = Recorder()
        super().__init__(
            store,
            host_tokens=host_tokens,
            storage_config=config,
            observer=self.recorder,
            host_layout=host_layout,
        )

    async def drop_device_and_host(self) -> None:
        """Evict everything from device and host, and scribble over both pools."""
        await super().drop_device_and_host()

        def scribble(cache: UnifiedRadixCache) -> None:
            self.kv.fill_(7.0)
            for buf, _ in self.tier.pools[FULL].host_buffers:
                buf.fill_(7.0)

        await self.svc.call(scribble)

    async def device_bytes(self, tokens: list[int], ns: tuple[str, ...] | None = None) -> Any:
        m = await self.svc.match(RadixKey(tokens, ns))
        return m.prefix_len, self.kv[:, :, m.device_indices].clone()

    async def check(self) -> None:
        await self.svc.sanity_check()

        assert await self.svc.call(pins) == 0


@asynccontextmanager
async def running(
    store: StorageBackend,
    config: StorageConfig | None = None,
    host_tokens: int = 512,
    host_layout: HostLayout | None = None,
) -> AsyncIterator[Stack]:
    stack = Stack(store, config or StorageConfig(), host_tokens, host_layout)
    async with store, stack.svc:
        with anyio.fail_after(45):
            yield stack
            await stack.settle()
            await stack.check()
    stack.cache.sanity_check()
    stack.cache.check_pools({FULL: 0}, {FULL: 0})


def tokens_of(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


# ---------------------------------------------------------------------- round trips
@pytest.mark.asyncio
async def test_round_trip_device_host_storage_and_back_is_byte_exact(
    make_store: StoreFactory,
) -> None:
    tokens = tokens_of(40)
    async with running(make_store()) as s:
        original = await s.put(tokens)
        await s.settle()
        assert s.worker.stats.pages_written == 10
        await s.drop_device_and_host()
        m = await s.svc.match(RadixKey(tokens))
        assert m.prefix_len == 0 and m.host_hit_length == 0
        assert await s.worker.fetch(s.svc, RadixKey(tokens)) == 40
        hit, data = await s.device_bytes(tokens)
        assert hit == 40 and torch.equal(data, original)
        stats = await s.svc.stats()
        assert stats.hit_tokens[Tier.STORAGE] == 40
        kinds = {k for k, _ in s.recorder.transfers}
        assert {TransferKind.STORAGE_WRITE, TransferKind.STORAGE_READ} <= kinds


@pytest.mark.asyncio
async def test_prefetch_continues_a_partial_host_hit(make_store: StoreFactory) -> None:
    base, tail = tokens_of(16), tokens_of(16, 1000)
    async with running(make_store()) as s:
        first = await s.put(base)
        second = await s.put(base + tail)
        await s.settle()
        await s.drop_device_and_host()
        # Bring only the first half back (from storage), then ask for the whole key.
        assert await s.worker.fetch(s.svc, RadixKey(base)) == 16
        assert await s.worker.prefetch(s.svc, RadixKey(base + tail)) == 16
        m = await s.svc.match(RadixKey(base + tail))
        assert m.prefix_len == 16 and m.host_hit_length == 16
        await s.controller.load_back(s.svc, RadixKey(base + tail))
        hit, data = await s.device_bytes(base + tail)
        assert hit == 32
        assert torch.equal(data[:, :, :16], first)
        assert torch.equal(data[:, :, 16:], second[:, :, 16:])


@pytest.mark.asyncio
async def test_on_host_eviction_policy_writes_evicted_pages(make_store: StoreFactory) -> None:
    config = StorageConfig(backup_policy=StorageBackupPolicy.ON_HOST_EVICTION)
    tokens = tokens_of(24)
    async with running(make_store(), config) as s:
        original = await s.put(tokens)
        await s.settle()
        assert s.worker.stats.pages_written == 0  # nothing left host memory yet
        await s.drop_device_and_host()
        assert s.worker.stats.pages_written == 6
        assert await s.worker.fetch(s.svc, RadixKey(tokens)) == 24
        hit, data = await s.device_bytes(tokens)
        assert hit == 24 and torch.equal(data, original)


@pytest.mark.asyncio
async def test_namespaces_never_read_each_others_pages(make_store: StoreFactory) -> None:
    tokens = tokens_of(16)
    async with running(make_store()) as s:
        a = await s.put(tokens, ("tenant", "a"))
        await s.settle()
        await s.drop_device_and_host()
        assert await s.worker.fetch(s.svc, RadixKey(tokens, ("tenant", "b"))) == 0
        assert await s.worker.fetch(s.svc, RadixKey(tokens)) == 0
        assert await s.worker.fetch(s.svc, RadixKey(tokens, ("tenant", "a"))) == 16
        hit, data = await s.device_bytes(tokens, ("tenant", "a"))
        assert hit == 16 and torch.equal(data, a)
        assert (await s.device_bytes(tokens, ("tenant", "b")))[0] == 0


@pytest.mark.asyncio
async def test_off_policy_writes_nothing(tmp_path: Path) -> None:
    config = StorageConfig(backup_policy=StorageBackupPolicy.OFF)
    async with running(FileStorage(tmp_path), config) as s:
        await s.put(tokens_of(16))
        await s.settle()
        await s.drop_device_and_host()
        assert await s.worker.fetch(s.svc, RadixKey(tokens_of(16))) == 0
        assert s.worker.stats.pages_written == 0 and s.worker.stats.prefetch_misses == 1


# ---------------------------------------------------------------------- two servers
@needs_valkey
@pytest.mark.asyncio
async def test_two_instances_share_one_cluster(cluster: ValkeyCluster) -> None:
    prefix = f"two{secrets.token_hex(4)}:"
    tokens = tokens_of(32, 500)
    async with running(valkey(cluster.addresses, True, prefix)) as first:
        original = await first.put(tokens)
        await first.settle()
        async with running(valkey(cluster.addresses, True, prefix)) as second:
            assert (await second.device_bytes(tokens))[0] == 0
            assert await second.worker.fetch(second.svc, RadixKey(tokens)) == 32
            hit, data = await second.device_bytes(tokens)
            assert hit == 32 and torch.equal(data, original)
            assert (await second.svc.stats()).hit_tokens[Tier.STORAGE] == 32


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("writer", "reader"),
    [(a, b) for a in HostLayout for b in HostLayout if a is not b],
    ids=lambda v: v.value,
)
async def test_replicas_with_different_host_layouts_read_each_others_pages(
    tmp_path: Path, writer: HostLayout, reader: HostLayout
) -> None:
    """A page's bytes in L3 do not depend on the host layout (PAGE_FIRST order)."""
    tokens = tokens_of(32, 900)
    async with running(FileStorage(tmp_path), host_layout=writer) as first:
        original = await first.put(tokens)
        await first.settle()
    async with running(FileStorage(tmp_path), host_layout=reader) as second:
        assert second.tier.pools[FULL].layout is reader
        assert await second.worker.fetch(second.svc, RadixKey(tokens)) == 32
        hit, data = await second.device_bytes(tokens)
        assert hit == 32 and torch.equal(data, original)


# ---------------------------------------------------------------------- faults
@needs_valkey
@pytest.mark.asyncio
async def test_a_killed_server_means_misses_and_recovery_when_it_returns(
    tmp_path: Path,
) -> None:
    assert BINARY is not None
    with running_node(Path(BINARY)) as server:
        async with running(valkey([server.address], False, "k:")) as s:
            await s.put(tokens_of(16))
            await s.settle()
            server.kill()
            await s.drop_device_and_host()
            # Writes and reads fail; the cache keeps serving (misses, recomputation).
            assert await s.worker.fetch(s.svc, RadixKey(tokens_of(16))) == 0
            again = await s.put(tokens_of(16, 100))
            await s.settle()
            assert (await s.device_bytes(tokens_of(16, 100)))[0] == 16
            await s.check()
            server.start()  # empty again: new writes must land and be found
            await s.put(tokens_of(16, 100))  # already cached: nothing new to write
            fresh = await s.put(tokens_of(16, 200))
            await s.settle()
            await s.drop_device_and_host()
            assert await s.worker.fetch(s.svc, RadixKey(tokens_of(16, 200))) == 16
            hit, data = await s.device_bytes(tokens_of(16, 200))
            assert hit == 16 and torch.equal(data, fresh)
            assert (await s.device_bytes(tokens_of(16, 100)))[0] == 0
            del again
            assert s.worker.stats.prefetch_misses >= 1


@pytest.mark.asyncio
async def test_a_corrupted_page_file_stops_the_prefetch_before_it(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    tokens = tokens_of(32)
    async with running(store) as s:
        original = await s.put(tokens)
        await s.settle()
        await s.drop_device_and_host()
        from hicache.storage.keys import StorageComponent, page_keys, parse_page_key

        keys = page_keys(tokens, PS, StorageComponent.FULL)
        path = store.path_of(parse_page_key(keys[3]))
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        assert await s.worker.fetch(s.svc, RadixKey(tokens)) == 12
        hit, data = await s.device_bytes(tokens)
        assert hit == 12 and torch.equal(data, original[:, :, :12])
        assert store.stats().corrupt == 1


@pytest.mark.asyncio
async def test_a_full_disk_stores_fewer_pages_and_serves_only_those(tmp_path: Path) -> None:
    probe = Stack(FileStorage(tmp_path / "probe"), StorageConfig(), 64)
    page_bytes = HostPageLayout(probe.tier.pools[FULL]).page_bytes
    store = FileStorage(tmp_path / "tiny", capacity_bytes=3 * (page_bytes + 64))
    tokens = tokens_of(32)
    async with running(store) as s:
        original = await s.put(tokens)
        await s.settle()
        assert s.worker.stats.pages_written == 3
        await s.drop_device_and_host()
        assert await s.worker.fetch(s.svc, RadixKey(tokens)) == 12
        hit, data = await s.device_bytes(tokens)
        assert hit == 12 and torch.equal(data, original[:, :, :12])


class SlowStore(FileStorage):
    """Serves ``fast_gets`` get calls, then never answers (a store that hangs)."""

    def __init__(self, root: Path, fast_gets: int) -> None:
        super().__init__(root, op_timeout_s=None)
        self.fast_gets = fast_gets
        self.hanging = anyio.Event()

    async def _get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        if self.fast_gets > 0:
            self.fast_gets -= 1
            return await super()._get(keys, buffers)
        self.hanging.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


@pytest.mark.asyncio
async def test_a_slow_store_hits_the_prefetch_timeout(tmp_path: Path) -> None:
    config = StorageConfig(
        prefetch_policy=PrefetchStopPolicy.TIMEOUT,
        timeout_base_s=0.05,
        timeout_per_page_s=0.005,
        batch_pages=2,
    )
    store = SlowStore(tmp_path, fast_gets=0)
    tokens = tokens_of(32)
    async with running(store, config) as s:
        original = await s.put(tokens)
        await s.settle()
        await s.drop_device_and_host()
        assert await s.worker.fetch(s.svc, RadixKey(tokens)) == 0
        assert s.worker.stats.prefetch_timeouts == 1 and s.worker.stats.prefetch_misses == 1
        await s.check()
        store.fast_gets = 1  # the first batch arrives, then the store hangs again
        assert await s.worker.fetch(s.svc, RadixKey(tokens)) == 8
        assert s.worker.stats.prefetch_timeouts == 2
        hit, data = await s.device_bytes(tokens)
        assert hit == 8 and torch.equal(data, original[:, :, :8])


@pytest.mark.asyncio
async def test_best_effort_takes_what_arrived_when_told_to_stop(tmp_path: Path) -> None:
    config = StorageConfig(prefetch_policy=PrefetchStopPolicy.BEST_EFFORT, batch_pages=2)
    store = SlowStore(tmp_path, fast_gets=2)
    tokens = tokens_of(32)
    async with running(store, config) as s:
        original = await s.put(tokens)
        await s.settle()
        await s.drop_device_and_host()
        stop = anyio.Event()
        got = 0

        async def fetch() -> None:
            nonlocal got
            got = await s.worker.fetch(s.svc, RadixKey(tokens), stop)

        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch)
            await store.hanging.wait()
            stop.set()
        assert got == 16 and s.worker.stats.prefetch_timeouts == 0
        hit, data = await s.device_bytes(tokens)
        assert hit == 16 and torch.equal(data, original[:, :, :16])


@pytest.mark.asyncio
async def test_a_cancelled_prefetch_leaks_no_pin_and_no_slot(tmp_path: Path) -> None:
    config = StorageConfig(prefetch_policy=PrefetchStopPolicy.WAIT_COMPLETE, batch_pages=2)
    store = SlowStore(tmp_path, fast_gets=1)
    base, tail = tokens_of(16), tokens_of(16, 900)
    async with running(store, config) as s:
        await s.put(base)
        await s.put(base + tail)
        await s.settle()
        await s.svc.evict(1 << 20)
        await s.svc.call(lambda c: c.evict_host(16))  # the tail leaves host memory
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.worker.prefetch, s.svc, RadixKey(base + tail))
            await store.hanging.wait()
            tg.cancel_scope.cancel()
        await s.check()
        m = await s.svc.match(RadixKey(base + tail))
        assert m.host_hit_length == 16


# ---------------------------------------------------------------------- core support
def test_insert_host_adopts_device_nodes_frees_duplicates_and_adds_a_leaf() -> None:
    cache = build_cache(
        CacheConfig(page_size=PS, kv_size=256, kv_shape=KVShape(2, 2, 4, torch.float32))
    )
    tier = attach_hicache(cache, HiCacheConfig(host_tokens=256))
    from urc import InsertParams, MatchPrefixParams

    value = cache.token_to_kv_pool_allocator.alloc(16)
    assert value is not None
    cache.insert(InsertParams(key=RadixKey(tokens_of(16)), value=value))
    cache.write_backup(
        cache.match_prefix(MatchPrefixParams(RadixKey(tokens_of(8)))).last_device_node
    )
    host = tier.host_alloc(FULL, 24)
    assert host is not None
    # [0, 8) is on host already (duplicates), [8, 16) device-only (adopted), [16, 24) new.
    assert cache.insert_host(RadixKey(tokens_of(24)), host[:24], 0) == 8
    cache.sanity_check()
    cache.check_pools({FULL: 0}, {FULL: 0})
    m = cache.match_prefix(MatchPrefixParams(RadixKey(tokens_of(24))))
    assert m.device_indices.shape[0] == 16 and m.host_hit_length == 8
    # A broken host chain above ``start`` frees everything.
    more = tier.host_alloc(FULL, 8)
    assert more is not None
    assert cache.insert_host(RadixKey(tokens_of(40, 5000)), more, 32) == 0
    cache.check_pools({FULL: 0}, {FULL: 0})


def test_the_worker_rejects_eagle_bigram_keys(tmp_path: Path) -> None:
    cache = build_cache(
        CacheConfig(
            page_size=PS, kv_size=256, is_eagle=True, kv_shape=KVShape(2, 2, 4, torch.float32)
        )
    )
    tier = attach_hicache(cache, HiCacheConfig(host_tokens=256))
    with pytest.raises(ConfigError):
        StorageWorker(cache, tier, FileStorage(tmp_path))


def test_a_write_jobs_tokens_are_its_paths_keys_in_one_packed_array() -> None:
    cache = build_cache(
        CacheConfig(page_size=PS, kv_size=256, kv_shape=KVShape(2, 2, 4, torch.float32))
    )
    from urc import InsertParams, MatchPrefixParams

    for tokens in (tokens_of(8), tokens_of(24), tokens_of(8) + tokens_of(12, 700)):
        value = cache.token_to_kv_pool_allocator.alloc(len(tokens))
        assert value is not None
        cache.insert(InsertParams(key=RadixKey(tokens), value=value))
    leaf = cache.match_prefix(MatchPrefixParams(RadixKey(tokens_of(24)))).last_device_node
    path = path_of(leaf)
    assert len(path) == 2  # split at 8 by the third key
    packed = path_tokens(path)
    assert isinstance(packed, array) and packed.typecode == "q"
    assert list(packed) == tokens_of(24)
