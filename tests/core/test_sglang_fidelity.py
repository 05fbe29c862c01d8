"""SGLang ``UnifiedRadixCache`` (0.5.23) rules that decide eviction order, one test per rule.

Written from the semantics (SGLang's ``unified_radix_cache.py`` and its components), table-
driven over page sizes; every mutating step is followed by ``sanity_check`` and pool
conservation (the harnesses do it).  The differential check against SGLang itself lives in
the development tree (``../shared/sglang/diff_vs_sglang.py``), not here.
"""

from __future__ import annotations

import pytest
from cache_harness import Harness, seq
from mamba_harness import check, comp, insert_state, make, match
from swa_harness import SWAHarness

from urc import (
    CacheConfig,
    EvictParams,
    InsertParams,
    RadixKey,
    TreeNode,
    build_cache,
)
from urc.host_protocol import WritePolicy

PAGE_SIZES = [1, 4, 16]


def _path(cache_root: TreeNode, node: TreeNode) -> list[TreeNode]:
    out = []
    while node is not cache_root:
        out.append(node)
        assert node.parent is not None
        node = node.parent
    return out[::-1]


def pages(ps: int, *xs: int) -> list[int]:
    return [x * 100 + j for x in xs for j in range(ps)]


def _node(nodes: object, key: list[int]) -> TreeNode:
    """The node whose edge is ``key`` (found without a match: no stamps)."""
    return next(n for n in nodes if list(n.key) == key)  # type: ignore[attr-defined]


def _stamps(h: Harness) -> list[int]:
    return [n.last_access_time for n in h.cache.iter_nodes()]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_every_stamp_is_a_fresh_tick_of_one_counter(ps: int) -> None:
    h = Harness(page_size=ps, kv_size=64 * ps)
    a, b, c = seq(0, 4, ps), seq(1000, 2, ps), seq(2000, 3, ps)
    h.insert(a)
    h.insert(a[: 2 * ps] + b)  # splits a
    h.insert(c)
    h.match(a)
    stamps = _stamps(h)
    assert len(set(stamps)) == len(stamps), f"tied access times: {sorted(stamps)}"
    assert all(isinstance(t, int) for t in stamps)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_split_stamps_upper_then_lower_so_the_untouched_tail_counts_as_recent(ps: int) -> None:
    h = Harness(page_size=ps, kv_size=64 * ps)
    x, z, y = seq(0, 4, ps), seq(1000, 2, ps), seq(2000, 2, ps)
    h.insert(x)
    h.insert(z)  # z is newer than all of x ...
    h.insert(x[: 2 * ps] + y)  # ... until this split re-stamps x's tail below the split point
    nodes = h.cache.iter_nodes()
    upper, tail, z_node = _node(nodes, x[: 2 * ps]), _node(nodes, x[2 * ps :]), _node(nodes, z)
    assert z_node.last_access_time < upper.last_access_time < tail.last_access_time
    # z is now the least recently used leaf: it goes first.
    assert h.cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == len(z)
    h.check()
    assert h.match_len(z) == 0
    assert h.match_len(x) == len(x) and h.match_len(x[: 2 * ps] + y) == len(x[: 2 * ps] + y)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_split_during_match_stamps_the_lower_part_then_the_best_path(ps: int) -> None:
    h = Harness(page_size=ps, kv_size=64 * ps)
    x, z = seq(0, 4, ps), seq(1000, 2, ps)
    h.insert(x)
    h.insert(z)
    upper = h.match(x[: 2 * ps]).last_device_node  # splits x; the upper part is the best
    (lower,) = upper.children.values()
    z_node = _node(h.cache.iter_nodes(), z)
    assert z_node.last_access_time < lower.last_access_time < upper.last_access_time


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_stamps_only_the_best_path_not_nodes_walked_past_it(ps: int) -> None:
    cache = make(ps)
    a, b, c = pages(ps, 1, 2), pages(ps, 3, 4), pages(ps, 5)
    insert_state(cache, a)  # a has a Mamba state ...
    insert_state(cache, a + b, state=False)  # ... its extension b does not
    insert_state(cache, c)  # c is newer than b
    r = match(cache, a + b)
    check(cache)
    assert r.device_indices.shape[0] == len(a)  # the best match is a (b has no state)
    nodes = cache.iter_nodes()
    b_node, c_node = _node(nodes, b), _node(nodes, c)
    assert b_node.last_access_time < c_node.last_access_time  # b walked past, not stamped
    assert r.last_device_node.last_access_time > c_node.last_access_time
    # So b is the least recently used leaf and goes first.
    cache.evict(EvictParams(num_tokens=1))
    check(cache)
    assert b_node.deleted and not c_node.deleted


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_stamps_increase_down_the_matched_path(ps: int) -> None:
    h = Harness(page_size=ps, kv_size=64 * ps)
    x = seq(0, 6, ps)
    for n in (2, 4, 6):
        h.insert(x[: n * ps])
    m = h.match(x)
    times = [n.last_access_time for n in _path(h.cache.root, m.last_device_node)]
    assert len(times) == 3 and times == sorted(times) and len(set(times)) == 3
    assert times[-1] == max(_stamps(h))


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_split_leaves_the_lower_part_in_its_place_in_the_mamba_lru(ps: int) -> None:
    # A split is no use of the state (0.5.23; 0.5.16 moved the lower part to the MRU end).
    cache = make(ps)
    ab, c = pages(ps, 1, 2), pages(ps, 3)
    insert_state(cache, ab)
    insert_state(cache, c)  # Mamba LRU: ab, c
    m = match(cache, pages(ps, 1))  # splits ab; the upper part has no state: no hit
    check(cache)
    assert m.device_indices.shape[0] == 0
    b_node = _node(cache.iter_nodes(), pages(ps, 2))
    c_node = _node(cache.iter_nodes(), c)
    assert comp(cache).lru.ids() == [b_node.id, c_node.id]
    assert cache.evict(EvictParams(mamba_num=1)).mamba_num_evicted == 1
    check(cache)
    assert b_node.deleted and not c_node.deleted  # b's state was the least recently used


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_split_puts_the_upper_part_just_before_the_lower_part_in_the_swa_lru(ps: int) -> None:
    # window = 2 pages; p (2 pages) and q (2 pages) are leaves, p the older.
    h = SWAHarness(ps, 2 * ps)
    p, q = h.seq(0, 2), h.seq(10_000, 2)
    h.insert(p)
    h.insert(q)  # SWA LRU: p, q
    p_low = h.node(p)
    h.match(p[:ps])  # splits p: the upper page is refreshed, the lower keeps its place
    p_up = p_low.parent
    assert p_up is not None and p_up is not h.cache.root and p_up.key_len == ps
    q_node = h.node(q)
    assert h.swa.lru.ids() == [p_low.id, q_node.id, p_up.id]
    # The least recently used SWA node is p's lower page (a leaf: it goes whole), not q.
    assert h.evict(swa=1) == (ps, ps)
    assert p_low.deleted and not q_node.deleted
    assert h.match(q)[0] == len(q)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_an_insert_split_outside_the_refreshed_window_stays_in_the_old_place(ps: int) -> None:
    # window = 1 page: an insert refreshes 2 pages above its end, so the node it split (far
    # above a 3-page leaf) is not refreshed: both parts stay where p was in the SWA LRU.
    h = SWAHarness(ps, ps)
    p, q = h.seq(0, 3), h.seq(10_000, 1)
    h.insert(p)  # p_up (2 pages) | p_low (1 page: the leaf is capped to one window)
    h.insert(q)  # SWA LRU: p_up, p_low, q
    p_low = h.node(p)
    p_up = p_low.parent
    assert p_up is not None and p_up.parent is h.cache.root and p_up.key_len == 2 * ps
    r = p[:ps] + h.seq(20_000, 3)
    h.insert(r)  # splits p_up into u1 | u2; r's new leaf is capped: leaf_up | leaf
    leaf = h.node(r)
    leaf_up = leaf.parent
    u1 = p_up.parent  # p_up kept the lower part (u2)
    assert leaf_up is not None and u1 is not None and leaf_up.parent is u1
    order = [u1.id, p_up.id, p_low.id, h.node(q).id, leaf_up.id, leaf.id]
    assert h.swa.lru.ids() == order
    # The least recently used SWA node is the internal u1: only its SWA goes.
    assert h.evict(swa=1) == (0, ps)
    assert h.swa_of(u1) is None and not p_low.deleted


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_swa_refresh_covers_one_window_plus_a_page(ps: int) -> None:
    # window = 2 pages; p (1 page) + leaf l (2 pages = one window), q unrelated.
    h = SWAHarness(ps, 2 * ps)
    p_l = h.seq(0, 3)
    q = h.seq(10_000, 1)
    h.insert(p_l)  # the leaf is capped to one window: p | l
    h.insert(q)  # SWA LRU: p, l, q
    h.match(p_l)  # refreshes l and (window + page) p: LRU q, p, l
    leaf = h.node(p_l)
    assert leaf.key_len == 2 * ps and leaf.parent is not h.cache.root
    # The least recently used SWA node is now q (a leaf: it goes whole), not p.
    assert h.evict(swa=1) == (ps, ps)
    assert h.match(q)[0] == 0
    assert h.match(p_l)[0] == len(p_l)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_mamba_state_inserted_onto_a_split_node_restamps_it(ps: int) -> None:
    cache = make(ps)
    a, b, c = pages(ps, 1), pages(ps, 2), pages(ps, 3)
    insert_state(cache, a + b)
    insert_state(cache, c)
    insert_state(cache, a)  # split: upper a, then lower b; the state on a re-stamps it
    nodes = cache.iter_nodes()
    upper, lower, c_node = _node(nodes, a), _node(nodes, b), _node(nodes, c)
    assert c_node.last_access_time < lower.last_access_time < upper.last_access_time
    # (Onto a node that already has a state the re-stamp follows the walk's own stamp of
    # the same node, with nothing in between: no observable difference.)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_hits_count_on_insert_not_on_match(ps: int) -> None:
    h = Harness(page_size=ps, kv_size=64 * ps)
    x = seq(0, 2, ps)
    h.insert(x)
    node = h.match(x).last_device_node
    for _ in range(3):
        h.match(x)
    assert node.hit_count == 1  # the insert that created it
    h.insert(x)
    assert node.hit_count == 2
    value = h.new_value(len(x))
    h.cache.insert(InsertParams(key=RadixKey(x), value=value, chunked=True))
    h.held -= len(x)
    h.check()
    assert node.hit_count == 2  # a chunked insert is not a hit


def test_write_back_counts_no_hits() -> None:
    from hicache.config import HiCacheConfig
    from hicache.host_tier import attach_hicache

    cache = build_cache(CacheConfig(kv_size=64))
    attach_hicache(cache, HiCacheConfig(write_policy=WritePolicy.WRITE_BACK, host_ratio=2.0))
    alloc = cache.token_to_kv_pool_allocator
    for _ in range(2):
        v = alloc.alloc(4)
        assert v is not None
        cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=v))
    (node,) = cache.iter_nodes()
    assert node.hit_count == 0
    cache.sanity_check()
    cache.check_pools()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lfu_ranks_by_insert_hits(ps: int) -> None:
    from urc.eviction_policy import EvictionPolicy

    h = Harness(page_size=ps, kv_size=64 * ps, eviction_policy=EvictionPolicy.LFU)
    a, b = seq(0, 1, ps), seq(1000, 1, ps)
    h.insert(a)
    h.insert(a)  # a: 2 hits
    h.insert(b)  # b: 1 hit
    for _ in range(5):
        h.match(b)  # matches are not hits: b stays the least frequently used
    h.cache.evict(EvictParams(num_tokens=1))
    h.check()
    assert h.match_len(b) == 0 and h.match_len(a) == len(a)


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("caller_freed", [True, False])
def test_swa_slots_freed_by_the_caller_before_insert_give_the_same_state(
    ps: int, caller_freed: bool
) -> None:
    h = SWAHarness(ps, 2 * ps)
    tokens = h.seq(0, 6)
    b = 3 * ps
    swa_free = h.alloc.swa_available_size()
    r, _ = h.insert(tokens, swa_evicted_seqlen=b, free_out_of_window=caller_freed)
    assert r.prefix_len == 0
    upper = h.node(tokens[:b])
    assert h.swa_of(upper) is None  # below the boundary: a tombstone either way
    # Either way the request's SWA slots below b are free exactly once and the leaf holds
    # SWA for the rest.
    assert h.alloc.swa_available_size() == swa_free - (len(tokens) - b)
    assert h.match(tokens)[0] == len(tokens)
