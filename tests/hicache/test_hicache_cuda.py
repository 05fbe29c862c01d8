"""HiCache on a real CUDA device (marker ``cuda``: skipped without one; the GPU check
``python -m urc.apps.gpu_check`` runs them): byte-exact round trips with the pools on the
GPU, host pools pinned and sized exactly, and the backup and load-back paths under
``torch.cuda.set_sync_debug_mode("error")`` (a host sync raises)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hicache_harness import FULL, SET_IDS, SETS, check, insert, leaves, make, match, seq

from hicache.host_layout import HostLayout
from hicache.host_pool import HostPool
from hicache.transfer_engine import CudaTransferEngine
from urc import ComponentType, EvictParams, UnifiedRadixCache
from urc.pools.kv_pool import KVPool, KVShape

pytestmark = pytest.mark.cuda

ALL_SETS = [(FULL,), *SETS]
ALL_IDS = ["full", *SET_IDS]


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise on any synchronizing CUDA call inside the block."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


LAYOUTS = list(HostLayout)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("comps", ALL_SETS, ids=ALL_IDS)
def test_round_trip_on_cuda_is_byte_exact_without_host_syncs(
    comps: tuple[ComponentType, ...], ps: int, layout: HostLayout
) -> None:
    cache = make(comps, ps, device="cuda", layout=layout)
    tier = cache.host_tier
    assert tier is not None
    for pool in tier.pools.values():  # type: ignore[attr-defined]
        assert pool.pinned and isinstance(pool.engine, CudaTransferEngine)
        assert all(buf.is_pinned() for buf, _ in pool.host_buffers)
    a = seq(0, 8, ps)
    assert insert(cache, a)
    kv = cache.pools.kv_pool.kv  # type: ignore[union-attr]
    m = match(cache, a)
    before = kv[:, :, m.device_indices.to("cuda")].clone()
    with no_host_sync():
        for _ in range(2):  # the second pass finds every copy in place
            demote_all_quiet(cache)
    check(cache)
    kv.zero_()
    node = match(cache, a).best_match_node
    with no_host_sync():
        assert cache.load_back(node) == len(a)
    check(cache)
    m = match(cache, a)
    assert m.device_indices.shape[0] == len(a)
    assert torch.equal(kv[:, :, m.device_indices.to("cuda")], before)


def demote_all_quiet(cache: UnifiedRadixCache) -> None:
    """``demote_all`` without its checks (they may sync: run them outside the block)."""
    for leaf in leaves(cache):
        cache.write_backup(leaf)
    cache.evict(EvictParams(num_tokens=10**6))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("ps", [1, 16, 64])
def test_a_cuda_host_pool_is_pinned_exact_and_copies_without_host_syncs(
    ps: int, layout: HostLayout
) -> None:
    shape = KVShape(4, 2, 64, torch.bfloat16)
    kv = KVPool(64 * ps, shape, "cuda")
    kv.kv.normal_()
    size = 24 * ps  # not a power of two
    pool = HostPool(kv.slot_buffers(), size, ps, layout=layout)
    host = pool.host_buffers[0][0]
    assert pool.pinned and host.is_pinned()
    assert host.numel() * host.element_size() == size * shape.bytes_per_token
    host_idx = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in (5, 1, 7, 2, 3)])
    dev_idx = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in (40, 9, 10, 11, 3)])
    back = torch.arange(50 * ps, 55 * ps)
    with no_host_sync():
        pool.backup(dev_idx, host_idx).wait()
        done = pool.load(host_idx, back)
        done.wait_stream()
    assert torch.equal(kv.kv[:, :, back.cuda()], kv.kv[:, :, dev_idx.cuda()])
    expected = kv.kv[:, :, dev_idx.cuda()].cpu()
    if layout is HostLayout.PAGE_FIRST:
        assert torch.equal(host[:, host_idx].transpose(1, 2), expected)
    else:
        assert torch.equal(host[:, :, host_idx], expected)


def test_the_default_layout_on_cuda_is_page_first() -> None:
    kv = KVPool(16, KVShape(2, 2, 8, torch.float16), "cuda")
    assert HostPool(kv.slot_buffers(), 16).layout is HostLayout.PAGE_FIRST


def test_hicache_tests_exercise_both_streams() -> None:
    engine = CudaTransferEngine(torch.device("cuda"))
    assert engine.write_stream != engine.load_stream
