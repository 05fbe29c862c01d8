"""One bad caller never corrupts the cache (issue 33, defects 1, 2 and 6).

Every public entry point that takes slot indices refuses repeats and slots the caller does
not hold -- free ones, tree-owned ones -- with a typed error and nothing changed, in both
twins (the compiled page bookkeeping and its numpy reference); ``sanity_check()`` counts the
tree-owned slots against what the tree holds; the synchronous core refuses a lock on a
host-only node.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from cache_harness import components_of
from hicache_harness import demote_all, leaves
from hicache_harness import make as make_hicache

from urc import (
    CacheConfig,
    ComponentType,
    DoubleFreeError,
    EvictParams,
    InsertParams,
    InvalidIndicesError,
    InvalidLockError,
    RadixKey,
    UnifiedRadixCache,
    build_cache,
)
from urc.errors import TreeOwnedSlotError
from urc.fastpath import WalkImpl
from urc.pools.pageops import native_pages_available
from urc.specs import SlidingWindowSpec

FULL, SWA = ComponentType.FULL, ComponentType.SWA
IMPLS = [
    WalkImpl.PYTHON,
    pytest.param(
        WalkImpl.NATIVE,
        marks=pytest.mark.skipif(not native_pages_available(), reason="_pages not built"),
    ),
]
SETS = [(FULL,), (FULL, SWA)]


def make(comps: tuple[ComponentType, ...], ps: int, impl: WalkImpl) -> UnifiedRadixCache:
    return build_cache(
        CacheConfig(
            components=components_of(comps, SlidingWindowSpec(4 * ps, 64 * ps)),
            page_size=ps,
            kv_size=64 * ps,
            walk_impl=impl,
        )
    )


def pool_state(cache: UnifiedRadixCache) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was (queued frees merged first)."""
    a: Any = cache.token_to_kv_pool_allocator
    a.flush()
    out: tuple[Any, ...] = (
        a._state.tobytes(),
        a._ext_lo[: a._next].tobytes(),
        a._ext_len[: a._next].tobytes(),
        a.available_size(),
        cache.evictable_size(),
        cache.protected_size(),
    )
    if hasattr(a, "swa_pages"):
        out += (a._map.tobytes(), a.swa_pages.state.tobytes(), a.swa_available_size())
    return out


def check(cache: UnifiedRadixCache, held: int, swa_held: int | None = None) -> None:
    """Invariants, and conservation with ``held`` Full slots (and ``swa_held`` SWA slots,
    default the same: fresh allocations map SWA) outside the tree."""
    cache.sanity_check()
    swa = held if swa_held is None else swa_held
    cache.check_pools({c.component_type: swa for c in cache.components} | {FULL: held})


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("comps", SETS, ids=["full", "full_swa"])
def test_a_free_that_names_a_slot_twice_is_refused_and_changes_nothing(
    comps: tuple[ComponentType, ...], ps: int, impl: WalkImpl
) -> None:
    cache = make(comps, ps, impl)
    alloc = cache.token_to_kv_pool_allocator
    x = alloc.alloc(8 * ps)
    assert x is not None
    before = pool_state(cache)
    with pytest.raises(DoubleFreeError, match="twice"):
        alloc.free(torch.cat([x[: 8 * ps], x[4 * ps : 8 * ps]]))
    assert pool_state(cache) == before
    check(cache, 8 * ps)
    # The next single-page allocations are all distinct pages.
    got = [alloc.alloc(ps) for _ in range(4)]
    pages = {int(t[0]) // ps for t in got if t is not None}
    assert len(pages) == 4 and not pages & {int(v) // ps for v in x}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("comps", SETS, ids=["full", "full_swa"])
def test_an_insert_whose_value_names_a_slot_twice_is_refused_and_changes_nothing(
    comps: tuple[ComponentType, ...], ps: int, impl: WalkImpl
) -> None:
    cache = make(comps, ps, impl)
    alloc = cache.token_to_kv_pool_allocator
    s = alloc.alloc(ps)
    assert s is not None
    before = pool_state(cache)
    with pytest.raises(InvalidIndicesError, match="twice"):
        cache.insert(InsertParams(key=RadixKey(list(range(2 * ps))), value=torch.cat([s, s])))
    assert pool_state(cache) == before and cache.num_nodes == 0
    check(cache, ps)
    alloc.free(s)
    cache.evict(EvictParams(num_tokens=10**6, swa_num_tokens=10**6))
    check(cache, 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("comps", SETS, ids=["full", "full_swa"])
def test_freeing_a_slot_the_tree_owns_is_refused_and_never_reallocated(
    comps: tuple[ComponentType, ...], ps: int, impl: WalkImpl
) -> None:
    cache = make(comps, ps, impl)
    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.alloc(8 * ps)
    assert slots is not None
    cache.insert(InsertParams(key=RadixKey(list(range(8 * ps))), value=slots))
    check(cache, 0)
    mine = alloc.alloc(ps)
    assert mine is not None
    before = pool_state(cache)
    with pytest.raises(TreeOwnedSlotError):
        alloc.free(slots[5 * ps : 6 * ps])
    with pytest.raises(TreeOwnedSlotError):  # one bad page among the caller's own
        alloc.free(torch.cat([mine, slots[2 * ps : 3 * ps]]))
    assert pool_state(cache) == before
    alloc.free(mine)
    check(cache, 0)
    rest = alloc.alloc(alloc.available_size())
    assert rest is not None and not set(rest.tolist()) & set(slots.tolist())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ps", [1, 4])
def test_freeing_the_swa_side_of_tree_owned_or_repeated_slots_is_refused(
    ps: int, impl: WalkImpl
) -> None:
    cache = make((FULL, SWA), ps, impl)
    alloc: Any = cache.token_to_kv_pool_allocator
    slots = alloc.alloc(4 * ps)
    mine = alloc.alloc(2 * ps)
    cache.insert(InsertParams(key=RadixKey(list(range(4 * ps))), value=slots))
    before = pool_state(cache)
    with pytest.raises(TreeOwnedSlotError):
        alloc.free_swa(slots[:ps])
    with pytest.raises(DoubleFreeError):
        alloc.free_swa(torch.cat([mine, mine[:ps]]))
    assert pool_state(cache) == before
    assert alloc.free_swa(mine) == 2 * ps  # the caller's own: fine
    check(cache, 2 * ps, 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ps", [1, 4])
def test_inserting_slots_the_tree_owns_as_a_new_value_is_refused(ps: int, impl: WalkImpl) -> None:
    cache = make((FULL,), ps, impl)
    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.alloc(4 * ps)
    assert slots is not None
    cache.insert(InsertParams(key=RadixKey(list(range(4 * ps))), value=slots))
    before = pool_state(cache)
    with pytest.raises(TreeOwnedSlotError):
        cache.insert(InsertParams(key=RadixKey(list(range(100, 100 + 4 * ps))), value=slots))
    assert pool_state(cache) == before and cache.num_nodes == 1
    check(cache, 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ps", [1, 4])
def test_an_insert_keeps_the_tail_the_callers_and_adopts_the_rest(ps: int, impl: WalkImpl) -> None:
    """The unaligned tail is handed back (the caller frees it), a refused validation gives
    everything back, and the duplicates are freed."""
    cache = make((FULL,), ps, impl)
    alloc = cache.token_to_kv_pool_allocator
    n = 3 * ps + (ps - 1 if ps > 1 else 0)
    v = alloc.alloc(n)
    assert v is not None
    cache.insert(InsertParams(key=RadixKey(list(range(n))), value=v))
    alloc.free(v[3 * ps :])  # the tail stays the caller's
    check(cache, 0)
    dup = alloc.alloc(3 * ps)
    assert dup is not None
    res = cache.insert(InsertParams(key=RadixKey(list(range(3 * ps))), value=dup))
    assert res.prefix_len == 3 * ps
    check(cache, 0)  # the duplicates were freed
    with pytest.raises(DoubleFreeError):
        alloc.free(dup)


@pytest.mark.parametrize("impl", IMPLS)
def test_sanity_check_counts_the_slots_the_tree_owns(impl: WalkImpl) -> None:
    cache = make((FULL,), 4, impl)
    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.alloc(16)
    assert slots is not None
    cache.insert(InsertParams(key=RadixKey(list(range(16))), value=slots))
    cache.sanity_check()
    alloc.free_owned(slots[4:8])  # behind the tree's back: its fast path trusts the caller
    with pytest.raises(AssertionError, match="tree-owned"):
        cache.sanity_check()


@pytest.mark.parametrize("ps", [1, 4])
def test_the_core_refuses_a_lock_on_a_host_only_node(ps: int) -> None:
    cache = make_hicache((FULL,), ps)
    alloc = cache.token_to_kv_pool_allocator
    v = alloc.alloc(4 * ps)
    cache.insert(InsertParams(key=RadixKey(list(range(4 * ps))), value=v))
    demote_all(cache)
    (leaf,) = leaves(cache)
    assert leaf.evicted
    before = (cache.protected_size(), [cd.lock_ref for cd in leaf.data if cd is not None])
    with pytest.raises(InvalidLockError, match="not on device"):
        cache.inc_lock_ref(leaf)
    assert (cache.protected_size(), [cd.lock_ref for cd in leaf.data if cd is not None]) == before
    cache.sanity_check()
    assert np.all(cache.token_to_kv_pool_allocator._state == 0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("comps", SETS, ids=["full", "full_swa"])
@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ("tree", TreeOwnedSlotError, "owned by the tree"),
        ("free", InvalidIndicesError, "not allocated"),
        ("repeat_new", InvalidIndicesError, "twice"),
        ("repeat_dup", InvalidIndicesError, "twice"),
        ("above", InvalidIndicesError, "outside"),
    ],
)
def test_a_bad_slot_among_the_duplicates_of_cached_tokens_is_refused_and_changes_nothing(
    comps: tuple[ComponentType, ...],
    ps: int,
    impl: WalkImpl,
    bad: str,
    error: type[Exception],
    match: str,
) -> None:
    """The caller's slots for tokens the tree already caches are freed by the insert (at
    page 1 in one checked pass, after every other check): a bad one there is refused with
    the error a bad new slot gets, nothing changed, and the good value still goes in."""
    cache = make(comps, ps, impl)
    alloc: Any = cache.token_to_kv_pool_allocator
    cached = alloc.alloc(4 * ps)
    cache.insert(InsertParams(key=RadixKey(list(range(4 * ps))), value=cached))
    mine = alloc.alloc(8 * ps)
    assert mine is not None
    free_page = int(np.flatnonzero(alloc._state == 0)[0]) * ps
    page = {
        "tree": cached[ps : 2 * ps],
        "free": torch.arange(free_page, free_page + ps),
        "repeat_new": mine[5 * ps : 6 * ps],
        "repeat_dup": mine[:ps],
        "above": torch.arange(alloc.size, alloc.size + ps),
    }[bad]
    value = torch.cat([mine[:ps], page, mine[2 * ps :]])  # the second page is bad
    key = RadixKey(list(range(4 * ps)) + list(range(500, 500 + 4 * ps)))
    before = pool_state(cache)
    with pytest.raises(error, match=match):
        cache.insert(InsertParams(key=key, value=value))
    assert pool_state(cache) == before and cache.num_nodes == 1
    check(cache, 8 * ps)
    res = cache.insert(InsertParams(key=key, value=mine))
    assert res.prefix_len == 4 * ps
    check(cache, 0)  # the duplicates were freed, the rest adopted
