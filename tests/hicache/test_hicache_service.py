"""HiCache through the async service: background backup, host eviction, load-back, soak.

The controller runs as a background worker of the service; every test ends with the cache's
invariants and device + host pool conservation.
"""

from __future__ import annotations

import asyncio
import random

import anyio
import pytest
import torch
from test_service_ownership import CancelTaskOnApply

from hicache.config import HiCacheConfig
from hicache.controller import HiCacheController
from hicache.host_tier import attach_hicache
from urc import (
    CacheConfig,
    ComponentType,
    InvalidLockError,
    KVShape,
    OutOfMemoryError,
    RadixKey,
    build_cache,
)
from urc.host_protocol import WritePolicy
from urc.service import AsyncUnifiedRadixCache
from urc.service._commands import StartLoadBack

FULL = ComponentType.FULL
PS = 4


def _setup(
    device_tokens: int, host_tokens: int | None, policy: WritePolicy = WritePolicy.WRITE_THROUGH
) -> tuple[AsyncUnifiedRadixCache, HiCacheController | None]:
    cache = build_cache(
        CacheConfig(page_size=PS, kv_size=device_tokens, kv_shape=KVShape(2, 2, 4, torch.float32))
    )
    if host_tokens is None:
        return AsyncUnifiedRadixCache(cache), None
    config = HiCacheConfig(write_policy=policy, host_tokens=host_tokens)
    tier = attach_hicache(cache, config)
    controller = HiCacheController(cache, tier, config)
    return AsyncUnifiedRadixCache(cache, workers=[controller]), controller


async def _request(
    svc: AsyncUnifiedRadixCache, controller: HiCacheController | None, tokens: list[int]
) -> tuple[int, int]:
    """One request: load host hits back, match with a lock, fill the tail, insert, release.

    Returns (query tokens, hit tokens); a request that finds no memory is a miss.
    """
    key = RadixKey(tokens)
    if controller is not None:
        await controller.load_back(svc, key)
    m = await svc.match(key, lock=True)
    assert m.lease is not None
    try:
        missing = len(tokens) - m.prefix_len
        if missing:
            try:
                own = await svc.alloc(missing)
            except OutOfMemoryError:
                return len(tokens), m.prefix_len
            value = torch.cat([m.device_indices, own])
            await svc.insert(key, value, prev_prefix_len=m.prefix_len)
    finally:
        await m.lease.release()
    return len(tokens), m.prefix_len


async def _quiesce(svc: AsyncUnifiedRadixCache) -> None:
    """Wait until no backup is due or in flight (their reserved host slots are committed)."""
    while True:
        await anyio.wait_all_tasks_blocked()
        busy = await svc.call(lambda c: bool(c.pending_backups or c.backups_in_flight))
        if not busy:
            return


def _working_set(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1 << 20) for _ in range(length // 2)]
    return [shared + [rng.randrange(1 << 20) for _ in range(length // 2)] for _ in range(n)]


async def _soak(
    device: int,
    host: int | None,
    clients: int,
    ops: int,
    policy: WritePolicy = WritePolicy.WRITE_THROUGH,
) -> float:
    svc, controller = _setup(device, host, policy)
    keys = _working_set(40, 32, seed=1)  # 40 x 32 tokens, half shared: ~5x device memory
    query = hit = 0
    async with svc:

        async def client(seed: int) -> None:
            nonlocal query, hit
            rng = random.Random(seed)
            for _ in range(ops):
                # Skewed popularity: a hot subset plus a long tail.
                k = keys[min(int(rng.expovariate(1 / 10)), len(keys) - 1)]
                q, h = await _request(svc, controller, k)
                query += q
                hit += h

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for c in range(clients):
                    tg.start_soon(client, c)
            await _quiesce(svc)
        await svc.sanity_check()
    cache = svc._cache
    cache.sanity_check()
    cache.check_pools({FULL: 0}, {FULL: 0})
    return hit / query


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK])
async def test_soak_with_host_tier_conserves_pools_and_beats_device_only(
    policy: WritePolicy,
) -> None:
    device, host = 256, 640  # working set ~ 5x device, ~2x host
    with_host = await _soak(device, host, clients=6, ops=50, policy=policy)  # checks pools
    device_only = await _soak(device, None, clients=6, ops=50)
    print(f"hit rate ({policy.name}): device+host {with_host:.3f}, device only {device_only:.3f}")
    if policy is WritePolicy.WRITE_BACK:
        # Evictions back up synchronously, in the actor: the gain is deterministic.
        assert with_host > device_only
    # Under write-through the backups are thread copies racing the evictions: the gain is
    # usually ~0.1 (0.83-0.92 vs 0.77) but has been seen to vanish when the copies lagged,
    # so only the conservation checks inside ``_soak`` are asserted there.


@pytest.mark.asyncio
async def test_background_backup_commits_host_copies_and_load_back_restores_bytes() -> None:
    svc, controller = _setup(64, 256)
    assert controller is not None
    tokens = list(range(32))
    async with svc:
        with anyio.fail_after(20):
            value = await svc.alloc(32)
            kv = svc._cache.pools.kv_pool
            assert kv is not None
            kv.kv[:, :, value] = torch.randn(kv.kv[:, :, value].shape)
            original = kv.kv[:, :, value].clone()
            await svc.insert(RadixKey(tokens), value)
            # The backup worker copies in the background; wait until it committed.
            await _quiesce(svc)  # the backup worker copies in the background
            assert controller.backed_up_tokens == 32
            await svc.evict(64)
            m = await svc.match(RadixKey(tokens))
            assert m.prefix_len == 0 and m.host_hit_length == 32
            kv.kv.zero_()
            assert await controller.load_back(svc, RadixKey(tokens)) == 32
            m = await svc.match(RadixKey(tokens))
            assert m.prefix_len == 32
            assert torch.equal(kv.kv[:, :, m.device_indices], original)
            await svc.sanity_check()
    svc._cache.check_pools({FULL: 0}, {FULL: 0})


@pytest.mark.asyncio
async def test_host_eviction_worker_keeps_usage_under_the_high_watermark() -> None:
    svc, controller = _setup(64, 128)
    assert controller is not None
    tier = svc._cache.host_tier
    assert tier is not None
    async with svc:
        with anyio.fail_after(30):
            for i in range(12):
                await _request(svc, controller, [i * 1000 + t for t in range(16)])
                await anyio.wait_all_tasks_blocked()
            await _quiesce(svc)
            await anyio.wait_all_tasks_blocked()
            assert tier.usage() <= controller.config.high_watermark
            await svc.sanity_check()
    svc._cache.check_pools({FULL: 0}, {FULL: 0})


@pytest.mark.asyncio
async def test_cancelled_load_back_leaks_no_pin_and_no_slot() -> None:
    svc, controller = _setup(64, 256)
    assert controller is not None
    async with svc:
        with anyio.fail_after(20):
            for i in range(4):
                await _request(svc, controller, [i * 100 + t for t in range(16)])
            await _quiesce(svc)
            await svc.evict(64)
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(
                        controller.load_back, svc, RadixKey([i * 100 + t for t in range(16)])
                    )
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()
            await _quiesce(svc)
            await svc.sanity_check()
    cache = svc._cache
    cache.sanity_check()
    cache.check_pools({FULL: 0}, {FULL: 0})
    assert all(cd is None or cd.host_lock_ref == 0 for n in cache.iter_nodes() for cd in n.data)


@pytest.mark.asyncio
async def test_natively_cancelled_load_back_gives_its_reservation_back() -> None:
    """``Task.cancel()`` of a load-back right after the actor reserved its device slots and
    pinned the host copies (the controller's ``StartLoadBack`` command): the caller never
    gets the ticket, the service gives it back (aborted: slots freed, pins dropped), and the
    node can still be loaded back later."""
    cache = build_cache(
        CacheConfig(page_size=PS, kv_size=64, kv_shape=KVShape(2, 2, 4, torch.float32))
    )
    config = HiCacheConfig(host_tokens=256)
    controller = HiCacheController(cache, attach_hicache(cache, config), config)
    hook = CancelTaskOnApply(StartLoadBack)
    tokens = list(range(16))
    async with AsyncUnifiedRadixCache(cache, workers=[controller], trace=hook) as svc:
        with anyio.fail_after(20):
            await _request(svc, controller, tokens)
            await _quiesce(svc)
            await svc.evict(64)
            free_before = cache.token_to_kv_pool_allocator.available_size()
            task = asyncio.ensure_future(controller.load_back(svc, RadixKey(tokens)))
            hook.victim = task
            with pytest.raises(asyncio.CancelledError):
                await task
            assert hook.fired == 1
            await svc.sanity_check({FULL: 0})
            assert cache.token_to_kv_pool_allocator.available_size() == free_before
            assert all(
                cd is None or cd.host_lock_ref == 0 for n in cache.iter_nodes() for cd in n.data
            )
            assert await controller.load_back(svc, RadixKey(tokens)) == 16
    cache.check_pools({FULL: 0}, {FULL: 0})


@pytest.mark.asyncio
async def test_lock_of_a_node_demoted_to_host_since_the_match_is_refused() -> None:
    """A handle whose node was evicted to host after the match: ``lock`` raises
    ``InvalidLockError`` (a lease there would protect nothing on device, and host eviction
    could delete its node under it)."""
    svc, controller = _setup(64, 256)
    assert controller is not None
    tokens = list(range(16))
    async with svc:
        with anyio.fail_after(20):
            await _request(svc, controller, tokens)
            await _quiesce(svc)
            handle = (await svc.match(RadixKey(tokens))).node
            await svc.evict(64)
            assert (await svc.match(RadixKey(tokens))).host_hit_length == 16
            with pytest.raises(InvalidLockError):
                await svc.lock(handle)
            await svc.call(lambda c: c.evict_host(1 << 20))  # the node is deleted
            assert svc.leases_held == 0
            await svc.sanity_check({FULL: 0})
    svc._cache.check_pools({FULL: 0}, {FULL: 0})
