"""The paired Full/SWA allocator and the SWA KV pool (``urc.pools.swa``)."""

from __future__ import annotations

import pytest
import torch

from urc import CacheConfig, ComponentType, ConfigError, DoubleFreeError, InvalidIndicesError
from urc.config import build_pools
from urc.pools.kv_pool import KVShape
from urc.pools.swa import SWAKVPool, SWATokenSlotAllocator
from urc.specs import SlidingWindowSpec

PAGE_SIZES = [1, 4, 16]


def _alloc(a: SWATokenSlotAllocator, n: int) -> torch.Tensor:
    v = a.alloc(n)
    assert v is not None
    return v


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_alloc_takes_both_sides_and_free_returns_both(ps: int) -> None:
    a = SWATokenSlotAllocator(32 * ps, 16 * ps, ps)
    assert (a.size, a.swa_size) == (32 * ps, 16 * ps)
    v = _alloc(a, 3 * ps)
    assert a.available_size() == 29 * ps
    assert a.swa_available_size() == 13 * ps
    sw = a.translate(v)
    assert sw.shape == v.shape and int(sw.min()) >= 0 and int(sw.max()) < a.swa_size
    # Page structure is preserved: offsets inside a page are the same on both sides.
    assert torch.equal(sw % ps, v % ps)
    a.check_consistency()
    a.free(v)
    assert (a.available_size(), a.swa_available_size()) == (32 * ps, 16 * ps)
    a.check_consistency()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_free_owned_returns_both_sides_once_merged(ps: int) -> None:
    a = SWATokenSlotAllocator(8 * ps, 4 * ps, ps)
    v = _alloc(a, 4 * ps)
    a.free_swa(v[: 2 * ps])  # half of it tombstoned: only the rest still maps SWA pages
    a.free_owned(v)
    assert a.available_size() == 8 * ps
    assert a.swa_available_size() == 4 * ps  # merges the queue, freeing the mapped half
    w = _alloc(a, 4 * ps)  # an SWA-bound allocation succeeds with the merged pages
    assert a.swa_mapped(w)
    a.check_consistency()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_queued_swa_and_full_frees_of_one_span_release_each_page_once(ps: int) -> None:
    a = SWATokenSlotAllocator(8 * ps, 4 * ps, ps)
    v = _alloc(a, 4 * ps)
    a.free_swa_owned(v[: 2 * ps])  # tombstoned: queued
    assert not a.swa_mapped(v[: 2 * ps])  # any map read sees the merged state
    assert a.swa_available_size() == 2 * ps
    a.free_swa_owned(v[2 * ps :])  # the rest tombstoned, then the whole span deleted
    a.free_owned(v)
    a.check_consistency()
    assert (a.available_size(), a.swa_available_size()) == (8 * ps, 4 * ps)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_unaligned_alloc_takes_whole_pages(ps: int) -> None:
    a = SWATokenSlotAllocator(8 * ps, 8 * ps, ps)
    v = _alloc(a, ps + 1) if ps > 1 else _alloc(a, 2)
    pages = 2
    assert a.available_size() == (8 - pages) * ps
    assert a.swa_available_size() == (8 - pages) * ps
    a.free(v)
    assert a.swa_available_size() == 8 * ps
    a.check_consistency()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_free_swa_clears_the_map_so_a_reused_page_is_never_freed(ps: int) -> None:
    """SGLang PR #27586: a stale map entry must not free an SWA page handed to another span."""
    a = SWATokenSlotAllocator(8 * ps, 2 * ps, ps)
    x = _alloc(a, 2 * ps)
    assert a.free_swa(x) == 2 * ps
    assert a.swa_available_size() == 2 * ps
    assert a.available_size() == 6 * ps  # Full side untouched
    assert bool((a.translate(x) == -1).all())
    y = _alloc(a, 2 * ps)  # reuses the SWA pages x had
    assert a.swa_available_size() == 0
    a.free(x)  # frees x's Full pages only
    assert a.swa_available_size() == 0
    assert a.swa_mapped(y)
    assert a.free_swa(x[:0]) == 0
    a.check_consistency()
    a.free(y)
    assert (a.available_size(), a.swa_available_size()) == (8 * ps, 2 * ps)
    a.check_consistency()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_free_swa_twice_frees_nothing_the_second_time(ps: int) -> None:
    a = SWATokenSlotAllocator(8 * ps, 8 * ps, ps)
    x = _alloc(a, 4 * ps)
    assert a.free_swa(x[: 2 * ps]) == 2 * ps
    assert a.free_swa(x[: 2 * ps]) == 0
    assert a.num_swa_mapped(x) == 2 * ps
    assert not a.swa_mapped(x) and a.swa_mapped(x[2 * ps :])
    a.free(x)  # mixed span: only the still-mapped half frees SWA pages
    assert (a.available_size(), a.swa_available_size()) == (8 * ps, 8 * ps)
    a.check_consistency()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_move_swa_hands_pages_to_another_span(ps: int) -> None:
    a = SWATokenSlotAllocator(8 * ps, 8 * ps, ps)
    old = _alloc(a, 2 * ps)
    a.free_swa(old)
    fresh = _alloc(a, 2 * ps)
    fresh_swa = a.translate(fresh)
    a.move_swa(old, fresh)
    assert torch.equal(a.translate(old), fresh_swa)
    assert bool((a.translate(fresh) == -1).all())
    a.free(fresh)  # Full only
    assert a.swa_available_size() == 6 * ps
    a.check_consistency()
    a.free(old)
    assert (a.available_size(), a.swa_available_size()) == (8 * ps, 8 * ps)


def test_translate_of_padding_is_padding() -> None:
    for ps in PAGE_SIZES:
        a = SWATokenSlotAllocator(4 * ps, 4 * ps, ps)
        _alloc(a, ps)
        assert a.translate(torch.tensor([-1], dtype=torch.int64)).tolist() == [-1]


def test_alloc_fails_without_taking_anything_when_swa_is_short() -> None:
    a = SWATokenSlotAllocator(16, 4, 1)
    assert a.alloc(5) is None
    assert (a.available_size(), a.swa_available_size()) == (16, 4)
    v = _alloc(a, 4)
    assert a.alloc(1) is None
    assert a.available_size() == 12
    a.free(v)
    a.check_consistency()


def test_bad_frees_raise_and_change_nothing() -> None:
    a = SWATokenSlotAllocator(8, 8, 1)
    v = _alloc(a, 2)
    a.free(v)
    with pytest.raises(DoubleFreeError):
        a.free(v)
    with pytest.raises(InvalidIndicesError):
        a.free(torch.tensor([100], dtype=torch.int64))
    with pytest.raises(InvalidIndicesError):
        a.free_swa(torch.tensor([0], dtype=torch.int32))
    assert (a.available_size(), a.swa_available_size()) == (8, 8)
    a.check_consistency()


def test_consistency_check_catches_a_leaked_swa_page() -> None:
    a = SWATokenSlotAllocator(8, 8, 1)
    v = _alloc(a, 2)
    a._map[int(v[0])] = -1  # simulate a bug: an SWA page nobody maps any more
    with pytest.raises(AssertionError, match="SWA pages allocated"):
        a.check_consistency()


def test_bad_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        SWATokenSlotAllocator(16, 0, 1)
    with pytest.raises(ConfigError):
        SWATokenSlotAllocator(16, 6, 4)
    for window in (0, -3):
        with pytest.raises(ConfigError):
            CacheConfig(components=(ComponentType.FULL, SlidingWindowSpec(window)))


@pytest.mark.parametrize("ps", [1, 4])
def test_swa_kv_pool_round_trips_through_full_indices(ps: int) -> None:
    cfg = CacheConfig(
        components=(ComponentType.FULL, SlidingWindowSpec(window=4, kv_size=8 * ps)),
        page_size=ps,
        kv_size=16 * ps,
        kv_shape=KVShape(num_layers=1, num_heads=1, head_dim=4),
    )
    pools = build_pools(cfg)
    alloc, pool = pools.token_allocator, pools.swa
    assert isinstance(alloc, SWATokenSlotAllocator)
    assert isinstance(pool, SWAKVPool)
    assert pool.kv_pool.size == 8 * ps
    v = _alloc(alloc, 2 * ps)
    data = torch.randn(2, 1, 2 * ps, 1, 4).to(torch.float16)
    pool.scatter(v, data)
    assert torch.equal(pool.gather(v), data)
    # The bytes live at the translated SWA slots.
    assert torch.equal(pool.kv_pool.gather(pool.translate(v)), data)
    pools = build_pools(cfg)
    assert isinstance(pools.token_allocator, SWATokenSlotAllocator)
    assert isinstance(pools.swa, SWAKVPool)
    assert pools.token_allocator.swa_size == 8 * ps
