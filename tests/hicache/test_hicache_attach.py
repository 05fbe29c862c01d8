"""``hicache.attach`` (one entry point for the host tier and its workers) and the tier
events a cache delivers to its subscribers (``urc.host_protocol.TierEvents``)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
from cache_harness import pins
from hicache_harness import insert, leaves

import hicache
from hicache.config import HiCacheConfig, StorageBackupPolicy, StorageConfig
from hicache.controller import HiCacheController
from hicache.host_tier import attach_hicache
from hicache.storage.file import FileStorage
from hicache.storage_worker import StorageWorker
from urc import CacheConfig, ComponentType, ConfigError, EvictParams, KVShape, RadixKey, build_cache
from urc.cache import UnifiedRadixCache
from urc.host_protocol import TierEvents, WritePolicy
from urc.node import TreeNode
from urc.service import AsyncUnifiedRadixCache
from urc.specs import SlidingWindowSpec

FULL = ComponentType.FULL
PS = 4


def small_cache(kv_size: int = 128) -> UnifiedRadixCache:
    return build_cache(
        CacheConfig(page_size=PS, kv_size=kv_size, kv_shape=KVShape(2, 2, 4, torch.float32))
    )


# ====================================================================== attach
def test_attach_builds_the_host_tier_and_its_controller() -> None:
    cache = small_cache()
    hc = hicache.attach(cache, HiCacheConfig(host_ratio=2.0))
    assert cache.host_tier is hc.tier
    assert hc.tier.host_capacity(FULL) == 2 * 128
    assert isinstance(hc.controller, HiCacheController) and hc.controller.tier is hc.tier
    assert hc.storage is None and hc.workers == (hc.controller,)
    assert cache.tier_events == (hc.controller,)


def test_attach_hooks_swa_host_hit_reporting_only_once_there_is_a_host_tier() -> None:
    # SWA's finalize_match_result reports host hits: without a host tier a match skips it.
    cache = build_cache(
        CacheConfig(
            components=(FULL, SlidingWindowSpec(window=2 * PS, kv_size=128)),
            page_size=PS,
            kv_size=128,
            kv_shape=KVShape(2, 2, 4, torch.float32),
        )
    )
    swa = cache.component(ComponentType.SWA)
    assert swa not in cache.hooks.finalize
    hicache.attach(cache, HiCacheConfig(host_ratio=2.0))
    assert swa in cache.hooks.finalize


def test_attach_refuses_a_cache_that_already_has_a_host_tier() -> None:
    cache = small_cache()
    hicache.attach(cache, HiCacheConfig())
    with pytest.raises(ConfigError):
        hicache.attach(cache, HiCacheConfig())


def test_attach_with_a_store_builds_the_storage_worker(tmp_path: Path) -> None:
    cache = small_cache()
    store = FileStorage(tmp_path)
    config = StorageConfig(backup_policy=StorageBackupPolicy.ON_HOST_EVICTION)
    hc = hicache.attach(cache, HiCacheConfig(), store, storage_config=config)
    assert isinstance(hc.storage, StorageWorker)
    assert hc.storage.storage is store and hc.storage.controller is hc.controller
    assert hc.storage.config is config
    assert hc.workers == (hc.controller, hc.storage)
    assert cache.tier_events == (hc.controller, hc.storage.writer)


@pytest.mark.asyncio
async def test_attached_workers_serve_host_and_storage_hits(tmp_path: Path) -> None:
    """The workers ``attach`` returns, run by the service: a sequence backed up to host and
    written through to the store comes back from host, then from the store."""
    cache = small_cache()
    store = FileStorage(tmp_path)
    hc = hicache.attach(cache, HiCacheConfig(host_tokens=256), store)
    assert hc.storage is not None
    tokens = RadixKey(list(range(32)))
    async with store, AsyncUnifiedRadixCache(cache, workers=hc.workers) as svc:
        with anyio.fail_after(20):
            await svc.insert(tokens, await svc.alloc(32))
            while True:  # the controller backs the node up, the worker writes it through
                await anyio.wait_all_tasks_blocked()
                if not await svc.call(lambda c: bool(c.pending_backups or c.backups_in_flight)):
                    break
            await hc.storage.flush()
            assert hc.controller.backed_up_tokens == 32
            assert hc.storage.stats.pages_written == 32 // PS
            await svc.evict(1 << 20)
            assert (await svc.match(tokens)).host_hit_length == 32
            assert await hc.controller.load_back(svc, tokens) == 32
            await svc.evict(1 << 20)
            await svc.call(lambda c: c.evict_host(1 << 20))
            assert (await svc.match(tokens)).host_hit_length == 0
            assert await hc.storage.fetch(svc, tokens) == 32
            assert (await svc.match(tokens)).prefix_len == 32
            assert await svc.call(pins) == 0
            await svc.sanity_check()
    cache.check_pools({FULL: 0}, {FULL: 0})


# ====================================================================== tier events
class Recorder(TierEvents):
    """Records every tier event, with whether the node still had its host copy."""

    def __init__(self, name: str, log: list[tuple[str, str, int | None, bool]]) -> None:
        self.name = name
        self.log = log

    def backup_due(self) -> None:
        self.log.append((self.name, "backup_due", None, False))

    def host_committed(self, node: TreeNode) -> None:
        self.log.append((self.name, "host_committed", node.id, node.backuped))

    def host_evicted(self, node: TreeNode) -> None:
        self.log.append((self.name, "host_evicted", node.id, node.backuped))


def host_cache() -> UnifiedRadixCache:
    cache = small_cache()
    attach_hicache(cache, HiCacheConfig(write_policy=WritePolicy.WRITE_THROUGH, host_tokens=256))
    return cache


def test_tier_events_reach_every_subscriber_once_in_subscription_order() -> None:
    cache = host_cache()
    log: list[tuple[str, str, int | None, bool]] = []
    a, b = Recorder("a", log), Recorder("b", log)
    cache.subscribe(a)
    cache.subscribe(b)
    cache.subscribe(a)  # already there: still delivered once
    assert cache.tier_events == (a, b)
    assert insert(cache, list(range(16)))
    (leaf,) = leaves(cache)
    assert log == [("a", "backup_due", None, False), ("b", "backup_due", None, False)]
    log.clear()
    assert cache.write_backup(leaf) == 16
    assert log == [("a", "host_committed", leaf.id, True), ("b", "host_committed", leaf.id, True)]
    log.clear()
    cache.evict(EvictParams(num_tokens=1 << 20))  # demoted: the host copy stays
    assert log == []
    assert cache.evict_host(1 << 20) == 16
    # Delivered before the host copies are freed: the handler can still read them.
    assert log == [("a", "host_evicted", leaf.id, True), ("b", "host_evicted", leaf.id, True)]


def test_an_unsubscribed_listener_gets_no_more_events() -> None:
    cache = host_cache()
    log: list[tuple[str, str, int | None, bool]] = []
    a, b = Recorder("a", log), Recorder("b", log)
    cache.subscribe(a)
    cache.subscribe(b)
    cache.unsubscribe(a)
    cache.unsubscribe(a)  # not subscribed: nothing happens
    assert cache.tier_events == (b,)
    assert insert(cache, list(range(16)))
    assert [name for name, *_ in log] == ["b"]


def test_the_base_tier_events_are_no_ops() -> None:
    """A subscriber overrides only the events it needs; the rest do nothing."""

    class OnlyCommits(TierEvents):
        def __init__(self) -> None:
            self.committed: list[int] = []

        def host_committed(self, node: TreeNode) -> None:
            self.committed.append(node.id)

    cache = host_cache()
    events = OnlyCommits()
    cache.subscribe(events)
    assert insert(cache, list(range(16)))
    (leaf,) = leaves(cache)
    assert cache.write_backup(leaf) == 16
    cache.evict(EvictParams(num_tokens=1 << 20))
    assert cache.evict_host(1 << 20) == 16
    assert events.committed == [leaf.id]
