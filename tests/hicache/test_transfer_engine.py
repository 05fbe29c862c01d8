"""Transfers wait for their copies: with an engine that defers every copy until its
completion is waited on (``deferred_engine``), a backup commits host copies and a load-back
unpins its host slots only after the bytes moved, and the round trip stays byte-exact.

Without the waits (or with copies that only queue), a committed host copy or a loaded
device slot holds stale bytes: these tests then fail on the bytes.
"""

from __future__ import annotations

import anyio
import pytest
import torch
from deferred_engine import DeferredEngine
from hicache_harness import FULL, SET_IDS, SETS, check, insert, make, match, seq
from transfer_harness import round_trip

import hicache
from hicache import HiCacheConfig
from hicache.host_layout import HostLayout
from hicache.host_pool import HostPool
from hicache.transfer_engine import (
    DONE,
    HostTransferEngine,
    Lane,
    ThreadTransferEngine,
    engine_for,
)
from urc import CacheConfig, ComponentType, RadixKey, build_cache
from urc.host import transfers as host_transfers
from urc.pools.kv_pool import KVPool, KVShape
from urc.service import AsyncUnifiedRadixCache

ALL_SETS = [(FULL,), *SETS]
ALL_IDS = ["full", *SET_IDS]


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda v: v.value)
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("comps", ALL_SETS, ids=ALL_IDS)
def test_round_trip_with_deferred_copies_is_byte_exact(
    comps: tuple[ComponentType, ...], ps: int, layout: HostLayout
) -> None:
    engine = DeferredEngine()
    cache = make(comps, ps, engine=engine, layout=layout)
    for before, after in round_trip(cache, ps):
        after.assert_equal(before)
    assert engine.submitted and engine.pending() == 0
    assert {d.lane for d in engine.submitted} == {Lane.WRITE, Lane.LOAD}


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda v: v.value)
@pytest.mark.parametrize("comps", ALL_SETS, ids=ALL_IDS)
def test_a_backup_commits_its_host_copies_only_after_they_landed(
    comps: tuple[ComponentType, ...], layout: HostLayout
) -> None:
    ps = 4
    engine = DeferredEngine()
    cache = make(comps, ps, engine=engine, layout=layout)
    tokens = seq(0, 4, ps)
    assert insert(cache, tokens)
    node = match(cache, tokens).last_device_node
    ticket = host_transfers.start_backup(cache, node)
    assert ticket is not None
    tier = cache.host_tier
    assert tier is not None
    host_transfers.copy_backup(tier, ticket)
    assert engine.pending() == 0  # copy_backup returns once every copy has landed
    host_transfers.finish_backup(cache, ticket)
    check(cache)
    kv = cache.pools.kv_pool.kv  # type: ignore[union-attr]
    cd = node.data[FULL]
    assert cd is not None and cd.value is not None and cd.host_value is not None
    pool = tier.pools[FULL]  # type: ignore[attr-defined]
    assert torch.equal(_host_slots(pool, cd.host_value), kv[:, :, cd.value])


def _host_slots(pool: HostPool, idx: torch.Tensor) -> torch.Tensor:
    """Host KV slots ``idx`` as ``[2, layers, len(idx), heads, dim]`` (the device's order)."""
    host = pool.host_buffers[0][0]
    if pool.layout is HostLayout.PAGE_FIRST:  # [2, slots, layers, heads, dim]
        return host[:, idx].transpose(1, 2)
    return host[:, :, idx]  # LAYER_FIRST: [2, layers, slots, heads, dim]


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda v: v.value)
@pytest.mark.parametrize("ps", [1, 4])
def test_a_host_pool_copy_moves_no_byte_before_its_completion_is_waited_on(
    ps: int, layout: HostLayout
) -> None:
    engine = DeferredEngine()
    kv = KVPool(16 * ps, KVShape(3, 2, 4, torch.float32))
    kv.kv.normal_()
    pool = HostPool(kv.slot_buffers(), 8 * ps, ps, engine=engine, layout=layout)
    host_idx = pool.allocator.alloc(4 * ps)
    assert host_idx is not None
    dev_idx = torch.arange(8 * ps, 12 * ps)
    host = pool.host_buffers[0][0]
    host.zero_()
    done = pool.backup(dev_idx, host_idx)
    assert not done.done() and int(host.count_nonzero()) == 0
    done.wait()
    assert done.done()
    assert torch.equal(_host_slots(pool, host_idx), kv.kv[:, :, dev_idx])
    back = torch.arange(0, 4 * ps)
    load = pool.load(host_idx, back)
    assert not torch.equal(kv.kv[:, :, back], kv.kv[:, :, dev_idx])
    load.wait()
    assert torch.equal(kv.kv[:, :, back], kv.kv[:, :, dev_idx])


def test_the_host_engine_copies_at_submission() -> None:
    engine = engine_for(torch.device("cpu"))
    assert isinstance(engine, HostTransferEngine)
    moved: list[int] = []
    done = engine.submit(Lane.WRITE, lambda: moved.append(1))
    assert moved == [1] and done is DONE and done.done()
    done.wait()
    done.wait_stream()


@pytest.mark.asyncio
@pytest.mark.parametrize("copy_in_thread", [True, False])
async def test_the_service_waits_for_deferred_copies(copy_in_thread: bool) -> None:
    engine = DeferredEngine()
    cache = build_cache(
        CacheConfig(page_size=4, kv_size=64, kv_shape=KVShape(2, 2, 4, torch.float32))
    )
    hc = hicache.attach(
        cache, HiCacheConfig(host_tokens=256), engine=engine, copy_in_thread=copy_in_thread
    )
    key = RadixKey(list(range(32)))
    async with AsyncUnifiedRadixCache(cache, workers=hc.workers) as svc:
        with anyio.fail_after(20):
            value = await svc.alloc(32)
            kv = cache.pools.kv_pool
            assert kv is not None
            kv.kv[:, :, value] = torch.randn(kv.kv[:, :, value].shape)
            original = kv.kv[:, :, value].clone()
            await svc.insert(key, value)
            while hc.controller.backed_up_tokens < 32:  # the background backup commits
                await anyio.wait_all_tasks_blocked()
                await anyio.sleep(0)
            await svc.evict(64)
            kv.kv.zero_()
            assert await hc.controller.load_back(svc, key) == 32
            m = await svc.match(key)
            assert torch.equal(kv.kv[:, :, m.device_indices], original)
            await svc.sanity_check()
    assert engine.submitted and engine.pending() == 0


# ---------------------------------------------------------------------- ThreadTransferEngine
def test_thread_engine_runs_each_lanes_work_off_the_caller_in_submission_order() -> None:
    import threading

    engine = ThreadTransferEngine()
    try:
        order: list[int] = []
        threads: set[int] = set()
        gate = threading.Event()

        def work(i: int) -> None:
            gate.wait(10)
            threads.add(threading.get_ident())
            order.append(i)

        done = [engine.submit(Lane.WRITE, lambda i=i: work(i)) for i in range(5)]
        assert not any(d.done() for d in done)  # the caller did not run them
        gate.set()
        for d in done:
            d.wait()
        assert order == [0, 1, 2, 3, 4] and all(d.done() for d in done)
        assert threading.get_ident() not in threads
    finally:
        engine.close()


def test_thread_engine_completion_raises_the_works_exception() -> None:
    engine = ThreadTransferEngine()
    try:

        def boom() -> None:
            raise RuntimeError("copy failed")

        done = engine.submit(Lane.LOAD, boom)
        with pytest.raises(RuntimeError, match="copy failed"):
            done.wait()
    finally:
        engine.close()
