"""KV events of the core: off by default; on, a router rebuilding the tree from the events
alone sees exactly the pages the tree holds, per medium, after every step (inserts, splits,
evictions, backups, load-backs, host evictions and inserts, resets), across component sets
and page sizes."""

from __future__ import annotations

import pytest
import torch
from hicache_harness import InFlight, check, insert, make
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_events_harness import CPU, GPU, RouterView, tree_pages

from urc import (
    CacheConfig,
    ComponentType,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    build_cache,
)
from urc.host_protocol import WritePolicy
from urc.kv_events import BlockRemoved, BlockStored, hash_to_int64, page_digests

FULL = ComponentType.FULL
SWA = ComponentType.SWA
MAMBA = ComponentType.MAMBA
COMPONENT_SETS = [(FULL,), (FULL, SWA), (FULL, MAMBA)]
SET_IDS = ["full", "swa", "mamba"]
PAGES = [1, 4, 16]


def _seq(branch: int, pages: int, ps: int) -> list[int]:
    """``pages`` pages: two shared with every branch, the rest the branch's own."""
    shared = list(range(1, 2 * ps + 1))
    own = [1000 * (branch + 1) + i for i in range(max(0, pages - 2) * ps)]
    return (shared + own)[: pages * ps]


def _assert_view(cache, router: RouterView) -> None:  # type: ignore[no-untyped-def]
    router.apply(cache.take_events())
    assert router.pages == tree_pages(cache)


def test_events_are_off_by_default_and_nothing_is_hashed() -> None:
    cache = build_cache(CacheConfig(components=(FULL,), page_size=4, kv_size=256))
    value = cache.token_to_kv_pool_allocator.alloc(16)
    cache.insert(InsertParams(key=RadixKey(list(range(16))), value=value))
    cache.evict(EvictParams(num_tokens=16))
    cache.reset()
    assert cache.kv_events is None
    assert cache.take_events() == []
    assert all(n.hash_value is None for n in cache.iter_nodes())


@pytest.mark.parametrize("ps", PAGES)
def test_one_block_stored_per_page_chained_from_the_root_and_merged(ps: int) -> None:
    cache = build_cache(CacheConfig(components=(FULL,), page_size=ps, kv_size=64 * ps))
    cache.enable_kv_events()
    alloc = cache.token_to_kv_pool_allocator
    a = _seq(0, 4, ps)
    cache.insert(InsertParams(key=RadixKey(a), value=alloc.alloc(len(a))))
    b = _seq(1, 3, ps)  # splits a's node after two pages
    cache.insert(InsertParams(key=RadixKey(b), value=alloc.alloc(len(b))))
    first, second = cache.take_events()
    digests = page_digests(a, None, ps)
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == [hash_to_int64(d) for d in digests]
    assert first.parent_block_hash is None and first.token_ids == a
    assert first.block_size == ps and first.medium is GPU
    # b's own page continues a's second page: one event, chained to it.
    assert second.parent_block_hash == first.block_hashes[1]
    assert second.block_hashes == [hash_to_int64(page_digests(b, None, ps)[2])]
    cache.evict(EvictParams(num_tokens=64 * ps))
    (removed,) = cache.take_events()  # three leaves and the shared node: one merged event
    assert isinstance(removed, BlockRemoved) and removed.medium is GPU
    assert sorted(removed.block_hashes) == sorted(set(first.block_hashes + second.block_hashes))


@pytest.mark.parametrize("ps", PAGES)
@pytest.mark.parametrize("comps", COMPONENT_SETS, ids=SET_IDS)
@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK])
def test_write_back_load_back_and_host_eviction_move_pages_between_mediums(
    ps: int, comps: tuple[ComponentType, ...], policy: WritePolicy
) -> None:
    cache = make(comps, ps, policy, kv_pages=16, host_pages=32)
    router = RouterView()
    cache.enable_kv_events()
    seqs = [_seq(b, 5, ps) for b in range(3)]
    for s in seqs:
        assert insert(cache, s)
        _assert_view(cache, router)
    leaf = cache.match_prefix(MatchPrefixParams(RadixKey(seqs[0]))).last_device_node
    cache.write_backup(leaf)
    _assert_view(cache, router)
    assert router.pages[CPU], "a backup publishes host pages"
    cache.evict(EvictParams(num_tokens=16 * ps, swa_num_tokens=16 * ps, mamba_num=16))
    check(cache)
    _assert_view(cache, router)
    host_node = cache.match_prefix(MatchPrefixParams(RadixKey(seqs[0]))).last_host_node
    if cache.load_back(host_node):
        _assert_view(cache, router)
    cache.evict(EvictParams(num_tokens=16 * ps, swa_num_tokens=16 * ps, mamba_num=16))
    cache.evict_host(32 * ps)
    check(cache)
    _assert_view(cache, router)
    cache.reset()
    _assert_view(cache, router)
    assert router.pages == {GPU: set(), CPU: set()}


@pytest.mark.parametrize("ps", [1, 4])
def test_host_insert_publishes_the_host_pages_it_places(ps: int) -> None:
    cache = make((FULL, SWA), ps, WritePolicy.WRITE_THROUGH, kv_pages=16, host_pages=32)
    tier = cache.host_tier
    assert tier is not None
    router = RouterView()
    cache.enable_kv_events()
    s = _seq(0, 4, ps)
    assert insert(cache, s)
    shared = cache.match_prefix(MatchPrefixParams(RadixKey(s[: 2 * ps])))
    cache.write_backup(shared.last_device_node)
    _assert_view(cache, router)
    host = tier.host_alloc(FULL, 6 * ps)
    assert host is not None
    longer = [*s, *range(7000, 7000 + 2 * ps)]
    assert cache.insert_host(RadixKey(longer), host, 0) == 2 * ps
    _assert_view(cache, router)
    assert len(router.pages[CPU]) == 6


OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "evict", "backup", "load", "evict_host", "reset"]),
        st.integers(0, 5),
        st.integers(1, 6),
    ),
    min_size=1,
    max_size=25,
)


@pytest.mark.parametrize("comps", COMPONENT_SETS, ids=SET_IDS)
@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, ps=st.sampled_from([1, 4]))
def test_a_router_rebuilds_exactly_the_tree_from_the_events(
    comps: tuple[ComponentType, ...], policy: WritePolicy, ops: list[tuple[str, int, int]], ps: int
) -> None:
    cache = make(comps, ps, policy, kv_pages=24, host_pages=24)
    router = RouterView()
    cache.enable_kv_events()
    flight = InFlight()
    for op, branch, n in ops:
        tokens = _seq(branch, n + 1, ps)
        if op == "insert":
            insert(cache, tokens, flight=flight)
        elif op == "evict":
            cache.evict(EvictParams(num_tokens=n * ps, swa_num_tokens=n * ps, mamba_num=n))
        elif op == "backup":
            m = cache.match_prefix(MatchPrefixParams(RadixKey(tokens)))
            if m.last_device_node.parent is not None:
                cache.write_backup(m.last_device_node)
        elif op == "load":
            m = cache.match_prefix(MatchPrefixParams(RadixKey(tokens)))
            cache.load_back(m.last_host_node)
        elif op == "evict_host":
            cache.evict_host(n * ps)
        else:
            cache.reset()
        check(cache, flight)
        _assert_view(cache, router)


def test_events_turned_on_late_hash_nodes_inserted_before() -> None:
    cache = build_cache(CacheConfig(components=(FULL,), page_size=2, kv_size=64))
    alloc = cache.token_to_kv_pool_allocator
    a = list(range(1, 9))
    cache.insert(InsertParams(key=RadixKey(a), value=alloc.alloc(8)))
    cache.enable_kv_events()
    b = [*a[:4], 50, 51]
    cache.insert(InsertParams(key=RadixKey(b), value=alloc.alloc(6)))
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == hash_to_int64(page_digests(a, None, 2)[1])
    assert stored.block_hashes == [hash_to_int64(page_digests(b, None, 2)[2])]
    assert torch.equal(torch.tensor(stored.token_ids), torch.tensor([50, 51]))
