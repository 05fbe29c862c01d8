"""UnifiedRadixCache with the FULL component: match, insert, evict, locks, request caching.

Every test runs for page sizes 1, 4, 16 and 64; the harness runs ``sanity_check()`` and the
pool conservation check after every mutating step.
"""

from __future__ import annotations

import random
import weakref
from array import array

import pytest
import torch
from cache_harness import Harness, components_of, running_request, seq

from urc import (
    CacheConfig,
    ComponentType,
    DecLockRefParams,
    EvictionPolicy,
    EvictParams,
    InsertParams,
    InvalidLockError,
    MatchPrefixParams,
    RadixKey,
    build_cache,
)
from urc.node import PresenceData, Tier, TreeNode
from urc.specs import ComponentSpec, MambaSpec, SlidingWindowSpec

FULL = ComponentType.FULL

PAGE_SIZES = [1, 4, 16, 64]


@pytest.fixture(params=PAGE_SIZES, ids=lambda p: f"page{p}")
def h(request: pytest.FixtureRequest) -> Harness:
    return Harness(page_size=request.param, kv_size=64 * 64)


def test_insert_then_match_full_partial_foreign_and_unrelated(h: Harness) -> None:
    ps = h.page_size
    a = seq(0, 2, ps)
    assert h.insert(a).prefix_len == 0
    longer = a + seq(1000, 1, ps)
    assert h.insert(longer).prefix_len == len(a)
    assert h.match_len(longer) == len(longer)
    assert h.match_len(a) == len(a)
    assert h.match_len(a + seq(5000, 1, ps)) == len(a)
    assert h.match_len(seq(9000, 2, ps)) == 0


def test_match_returns_the_inserted_indices_in_order(h: Harness) -> None:
    ps = h.page_size
    a = seq(0, 3, ps)
    value = h.new_value(len(a))
    h.cache.insert(InsertParams(key=RadixKey(a), value=value.clone()))
    h.held -= len(a)
    h.check()
    m = h.match(a)
    assert torch.equal(m.device_indices, value)
    assert m.last_device_node is m.best_match_node is m.last_host_node


def test_two_branches_off_a_shared_prefix(h: Harness) -> None:
    ps = h.page_size
    base = seq(0, 2, ps)
    h.insert(base)
    x = base + seq(100 * ps, 2, ps)
    y = base + seq(200 * ps, 2, ps)
    assert h.insert(x).prefix_len == len(base)
    assert h.insert(y).prefix_len == len(base)
    assert h.match_len(x) == len(x)
    assert h.match_len(y) == len(y)
    assert h.match_len(base + seq(300 * ps, 1, ps)) == len(base)


def test_match_splits_mid_node_and_insert_forks_share_the_split(h: Harness) -> None:
    ps = h.page_size
    base = seq(0, 3, ps)
    h.insert(base + seq(500 * ps, 2, ps))
    m = h.match(base)
    assert m.device_indices.shape[0] == len(base)
    assert m.last_device_node.key_len == len(base)
    assert h.insert(base + seq(600 * ps, 1, ps)).prefix_len == len(base)
    assert h.insert(base + seq(700 * ps, 1, ps)).prefix_len == len(base)


def test_access_times_increase_down_the_matched_path(h: Harness) -> None:
    ps = h.page_size
    a = seq(0, 1, ps)
    b = a + seq(100 * ps, 1, ps)
    c = b + seq(200 * ps, 1, ps)
    for s in (a, b, c):
        h.insert(s)
    node = h.match(c).last_device_node
    times = []
    while node.parent is not None:
        times.append(node.last_access_time)
        node = node.parent
    assert times == sorted(times, reverse=True) and len(set(times)) == len(times)


def test_evict_frees_at_least_what_was_asked_and_never_a_locked_path(h: Harness) -> None:
    ps = h.page_size
    a = seq(0, 2, ps)
    b = seq(1000 * ps, 2, ps)
    h.insert(a)
    h.insert(b)
    assert h.cache.evictable_size() == len(a) + len(b)
    node = h.match(a).last_device_node
    receipt = h.cache.inc_lock_ref(node)
    assert receipt.delta == len(a)
    h.check()
    result = h.cache.evict(EvictParams(num_tokens=4 * ps))
    h.check()
    assert result.num_tokens_evicted == len(b)
    assert h.match_len(a) == len(a)
    assert h.match_len(b) == 0
    h.cache.dec_lock_ref(node, receipt.to_dec_params())
    h.check()
    assert h.cache.evict(EvictParams(num_tokens=2 * ps)).num_tokens_evicted >= 2 * ps
    h.check()


def test_evict_takes_least_recently_used_leaf_first(h: Harness) -> None:
    ps = h.page_size
    a, b, c = (seq(k * 1000 * ps, 1, ps) for k in (1, 2, 3))
    for s in (a, b, c):
        h.insert(s)
    h.match(a)
    h.cache.evict(EvictParams(num_tokens=1))
    h.check()
    assert h.match_len(b) == 0
    assert h.match_len(a) == len(a) and h.match_len(c) == len(c)


def test_evict_empty_tree_returns_zeros(h: Harness) -> None:
    r = h.cache.evict(EvictParams(num_tokens=10, swa_num_tokens=3, mamba_num=5))
    assert tuple(r) == (0, 0, 0)
    h.check()


def test_evict_until_empty_leaves_nothing_matchable_and_all_slots_free(h: Harness) -> None:
    ps = h.page_size
    seqs = [seq(k * 100 * ps, 2, ps) for k in range(5)]
    seqs.append(seqs[0] + seq(9000 * ps, 1, ps))
    for s in seqs:
        h.insert(s)
    total = sum(len(s) for s in seqs)
    h.cache.evict(EvictParams(num_tokens=2 * total))
    h.check()
    assert h.cache.evictable_size() == 0 and h.cache.num_nodes == 0
    assert all(h.match_len(s) == 0 for s in seqs)
    assert h.alloc.available_size() == h.alloc.size


def test_prev_prefix_len_decides_which_duplicate_indices_are_freed(h: Harness) -> None:
    ps = h.page_size
    start = h.alloc.available_size()
    h.insert(seq(0, 1, ps))
    assert h.alloc.available_size() == start - ps
    # prev 0: the one duplicate page is freed, one new page kept.
    h.insert(seq(0, 2, ps), prev_prefix_len=0)
    assert h.alloc.available_size() == start - 2 * ps
    # prev == 2 pages: the first two pages are the tree's own (matched): nothing is freed.
    tree_part = h.match(seq(0, 2, ps)).device_indices
    own = h.new_value(ps)
    value = torch.cat([tree_part, own])
    r = h.cache.insert(
        InsertParams(key=RadixKey(seq(0, 3, ps)), value=value, prev_prefix_len=2 * ps)
    )
    h.held -= ps
    h.check()
    assert r.prefix_len == 2 * ps
    assert h.alloc.available_size() == start - 3 * ps


def test_prev_prefix_len_keeps_tree_owned_slots() -> None:
    h = Harness(page_size=1, kv_size=256)
    start = h.alloc.available_size()
    h.insert([1, 2, 3])
    assert h.alloc.available_size() == start - 3
    # [1..7] with prev 0: [1,2,3] duplicates are freed -> net -4.
    h.insert([1, 2, 3, 4, 5, 6, 7], prev_prefix_len=0)
    assert h.alloc.available_size() == start - 7
    # A request that matched [1..7] owns only the slots past it: pass the tree's slots first.
    tree = h.match([1, 2, 3, 4, 5, 6, 7]).device_indices
    own = h.new_value(2)
    value = torch.cat([tree, own])
    h.cache.insert(InsertParams(key=RadixKey(list(range(1, 10))), value=value, prev_prefix_len=7))
    h.held -= 2
    h.check()
    assert h.alloc.available_size() == start - 9
    assert h.match_len(list(range(1, 10))) == 9


def test_unaligned_keys_are_truncated_to_whole_pages(h: Harness) -> None:
    ps = h.page_size
    if ps == 1:
        pytest.skip("every key is aligned at page size 1")
    s = seq(0, 2, ps)
    h.insert(s + [99] * (ps - 1))
    assert h.match_len(s + [99] * (ps - 1)) == len(s)
    assert h.match_len(s[: ps - 1]) == 0
    assert h.cache.evictable_size() == len(s)


def test_a_mismatch_inside_a_page_matches_only_the_pages_before_it(h: Harness) -> None:
    ps = h.page_size
    if ps == 1:
        pytest.skip("needs pages of several tokens")
    s = seq(0, 3, ps)
    h.insert(s)
    in_page_two = [*s[: ps + ps // 2], -1, *s[ps + ps // 2 + 1 :]]
    assert h.match_len(in_page_two) == ps
    in_page_one = [-1, *s[1:]]
    assert h.match_len(in_page_one) == 0
    # The partial match split the node on a page boundary; inserting the fork shares it.
    assert h.insert(in_page_two).prefix_len == ps


def test_child_keys_are_pages(h: Harness) -> None:
    """Page 1: the token; larger pages: the packed page's bytes (int64, native order)."""
    ps = h.page_size
    h.insert(seq(0, 2, ps))
    (key,) = h.cache.root.children
    assert key == (0 if ps == 1 else array("q", range(ps)).tobytes())


def test_extra_key_namespaces_never_match_each_other(h: Harness) -> None:
    ps = h.page_size
    s = seq(0, 2, ps)
    h.insert(s, extra_key=("tenant", 1))
    h.insert(s, extra_key=("tenant", 2))
    h.insert(s)
    assert h.match_len(s, ("tenant", 1)) == len(s)
    assert h.match_len(s, ("tenant", 3)) == 0
    m1 = h.match(s, ("tenant", 1)).device_indices
    m2 = h.match(s, ("tenant", 2)).device_indices
    m0 = h.match(s).device_indices
    assert not set(m1.tolist()) & set(m2.tolist())
    assert not set(m0.tolist()) & set(m1.tolist())
    # A string namespace is the 1-tuple of that string.
    assert RadixKey(s, "lora").extra_key == ("lora",)


def _two_branches(h: Harness) -> tuple[list[int], list[int], TreeNode, TreeNode]:
    """Insert two keys that share a two-page base; returns them and their leaves."""
    ps = h.page_size
    base = seq(0, 2, ps)
    x = base + seq(100 * ps, 1, ps)
    y = base + seq(200 * ps, 1, ps)
    h.insert(x)
    h.insert(y)
    return x, y, h.match(x).last_device_node, h.match(y).last_device_node


def test_lock_moves_sizes_between_evictable_and_protected(h: Harness) -> None:
    ps = h.page_size
    x, y, nx, ny = _two_branches(h)
    rx = h.cache.inc_lock_ref(nx)
    assert (h.cache.protected_size(), rx.delta) == (len(x), len(x))
    ry = h.cache.inc_lock_ref(ny)
    assert ry.delta == ps  # the shared base was already protected
    h.check()
    assert h.cache.dec_lock_ref(nx, rx.to_dec_params()).delta == ps
    assert h.cache.dec_lock_ref(ny, ry.to_dec_params()).delta == len(y)
    assert h.cache.protected_size() == 0
    h.check()


def test_full_lock_count_is_own_locks_plus_locked_children(h: Harness) -> None:
    _, y, nx, ny = _two_branches(h)
    shared = nx.parent
    assert shared is ny.parent and shared is not None
    receipts = [h.cache.inc_lock_ref(n) for n in (nx, nx, ny)]
    # Two locks on x, one on y: the shared node counts its two locked children, not 3 locks.
    assert (nx.lock_ref, ny.lock_ref, shared.lock_ref) == (2, 1, 2)
    h.check()
    h.cache.dec_lock_ref(nx, receipts[0].to_dec_params())
    assert (nx.lock_ref, shared.lock_ref) == (1, 2)
    h.cache.dec_lock_ref(nx, receipts[1].to_dec_params())
    assert (nx.lock_ref, shared.lock_ref, h.cache.protected_size()) == (0, 1, len(y))
    h.check()
    h.cache.dec_lock_ref(ny, receipts[2].to_dec_params())
    assert (shared.lock_ref, h.cache.protected_size()) == (0, 0)
    h.check()


def test_extending_leaves_keeps_the_eviction_heap_compact(h: Harness) -> None:
    ps = h.page_size
    h = Harness(page_size=ps, kv_size=512 * ps)  # room for a 200-page key twice
    tokens: list[int] = []
    for i in range(200):  # every insert turns the previous leaf into an internal node
        tokens += seq(1000 * ps + i * ps, 1, ps)
        h.insert(tokens)  # checks the heap invariants after every step
    heap = h.cache.full._heap
    # Orphaned entries go once they are 65 and a quarter of the heap.
    assert len(heap) <= 66, f"{len(heap)} heap entries for 1 leaf: dead entries not dropped"
    assert h.cache.evict(EvictParams(num_tokens=ps)).num_tokens_evicted == ps  # the leaf
    assert h.match(tokens).device_indices.shape[0] == len(tokens) - ps
    h.check()


def _leaves_of(h: Harness) -> list[TreeNode]:
    return [n for n in h.cache.iter_nodes() if h.cache.full.is_device_leaf(n)]


def test_eviction_order_is_lru_over_leaves_with_many_orphaned_entries(h: Harness) -> None:
    """Leaves extended at random orphan their heap entries (dropped by identity, on a pop or
    in one pass); every eviction still takes the least recently used unlocked leaf."""
    ps = h.page_size
    h = Harness(page_size=ps, kv_size=1200 * ps)
    rng = random.Random(5)
    seqs: list[list[int]] = [seq(0, 1, ps)]
    h.insert(seqs[0])
    for i in range(300):  # most inserts extend a leaf (the newest, or an earlier one)
        r = rng.random()
        parent = seqs[-1] if r < 0.5 else rng.choice(seqs) if r < 0.9 else []
        seqs.append(parent + seq(10_000 * ps + i * ps, 1, ps))
        h.insert(seqs[-1])
        if rng.random() < 0.2:
            h.match(rng.choice(seqs))  # touches a path: its leaf is no longer the oldest
    assert len(h.cache.full._heap) < 2 * len(_leaves_of(h)) + 65  # orphans were dropped
    while h.cache.evictable_size():
        oldest = min(_leaves_of(h), key=lambda n: n.last_access_time)
        assert h.cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == oldest.key_len
        assert oldest.deleted
        h.check()


@pytest.mark.parametrize(
    ("policy", "victim"),
    [
        (EvictionPolicy.LRU, "a"),  # least recently used
        (EvictionPolicy.FIFO, "d"),  # inserted first
        (EvictionPolicy.LFU, "b"),  # fewest hits; ties broken by last access
        (EvictionPolicy.PRIORITY, "c"),  # lowest priority
    ],
)
def test_eviction_policy_picks_its_victim(policy: EvictionPolicy, victim: str, h: Harness) -> None:
    ps = h.page_size
    h = Harness(page_size=ps, kv_size=64 * ps, eviction_policy=policy)
    keys = {name: seq(100 * i * ps, 1, ps) for i, name in enumerate("abcd", start=1)}
    for name, prio in (("d", 1), ("a", 1), ("b", 1), ("c", 0)):
        v = h.new_value(ps)
        h.cache.insert(InsertParams(key=RadixKey(keys[name]), value=v, priority=prio))
        h.held -= ps
    for _ in range(3):  # a: most hits (hits count on insert, as in SGLang) ...
        v = h.new_value(ps)
        h.cache.insert(InsertParams(key=RadixKey(keys["a"]), value=v, priority=1))
        h.held -= ps
    for name in "bcd":  # ... but least recent; b, c, d: one hit each (their insert)
        h.match(keys[name])
    assert h.cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == ps
    gone = [name for name, k in keys.items() if h.match(k).device_indices.shape[0] == 0]
    assert gone == [victim]
    h.check()


def test_dec_lock_ref_on_an_unlocked_node_is_a_typed_error_and_changes_nothing(
    h: Harness,
) -> None:
    ps = h.page_size
    h.insert(seq(0, 2, ps))
    node = h.match(seq(0, 2, ps)).last_device_node
    with pytest.raises(InvalidLockError):
        h.cache.dec_lock_ref(node)
    h.check()
    receipt = h.cache.inc_lock_ref(node)
    other = h.cache.root
    h.cache.dec_lock_ref(other)  # the root is never locked: a no-op
    wrong = DecLockRefParams(node_id=node.id + 10_000)
    with pytest.raises(InvalidLockError):
        h.cache.dec_lock_ref(node, wrong)
    h.cache.dec_lock_ref(node, receipt.to_dec_params())
    with pytest.raises(InvalidLockError):
        h.cache.dec_lock_ref(node, receipt.to_dec_params())
    h.check()


@pytest.mark.parametrize(
    "components",
    [(FULL, ComponentType.SWA), (FULL, ComponentType.SWA, ComponentType.MAMBA)],
    ids=["full+swa", "full+swa+mamba"],
)
def test_refused_second_release_through_an_swa_tombstone_changes_nothing(
    components: tuple[ComponentType, ...],
) -> None:
    """A receipt released twice on an SWA tombstone without Mamba state: Mamba (released
    first) has nothing to release, SWA's window walk passes the tombstone and would take the
    count another lock holds on the node above, and only Full's lock check refuses: it must
    run before SWA releases anything."""
    swa, mamba = ComponentType.SWA, ComponentType.MAMBA
    cache = build_cache(
        CacheConfig(
            components=components_of(components, SlidingWindowSpec(4, 256), MambaSpec(size=8)),
            kv_size=256,
            max_num_reqs=4,
            max_context_len=64,
        )
    )
    alloc = cache.token_to_kv_pool_allocator
    states = cache.pools.mamba
    first = InsertParams(key=RadixKey(list(range(1, 9))), value=alloc.alloc(8))
    if states is not None:
        first.mamba_value = states.alloc(1)
    cache.insert(first)
    hit = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(range(1, 9)))))
    tail = alloc.alloc(4)
    alloc.free_swa(tail)  # slid out of the window: the new node is an SWA tombstone
    cache.insert(
        InsertParams(
            key=RadixKey(list(range(1, 13))),
            value=torch.cat([hit.device_indices, tail]),
            prev_prefix_len=8,
            swa_evicted_seqlen=12,
        )
    )
    above = hit.last_device_node
    (node,) = above.children.values()
    assert node.data[swa].value is None and above.data[swa].value is not None  # type: ignore[union-attr]
    if states is not None:
        assert node.data[mamba].value is None  # type: ignore[union-attr]
    receipt = cache.inc_lock_ref(node).to_dec_params()
    cache.inc_lock_ref(above)  # holds the SWA count the walk from ``node`` reaches
    cache.dec_lock_ref(node, receipt)

    def counts() -> list[object]:
        return [
            (n.id, [cd.lock_ref for cd in n.data if cd is not None]) for n in cache.iter_nodes()
        ] + [(c.evictable_size, c.protected_size) for c in cache.components]

    before = counts()
    with pytest.raises(InvalidLockError):
        cache.dec_lock_ref(node, receipt)
    assert counts() == before
    cache.sanity_check()


def test_cache_finished_req_inserts_and_frees_the_unaligned_tail(h: Harness) -> None:
    ps = h.page_size
    inp = seq(0, 3, ps)
    out = seq(10_000, 1, ps)[: max(1, ps // 2)]
    req = running_request(h, inp, out)
    held_by_req = h.held
    h.cache.cache_finished_req(req)
    h.held = 0
    h.check()
    aligned = (len(inp) + len(out)) // ps * ps
    assert h.match_len(inp + out) == aligned
    assert h.cache.evictable_size() == aligned
    assert h.alloc.available_size() == h.alloc.size - aligned
    assert held_by_req >= aligned
    assert req.req_pool_idx is None and req.last_node is None


def test_cache_finished_req_reuses_a_cached_prefix(h: Harness) -> None:
    ps = h.page_size
    inp = seq(0, 3, ps)
    h.insert(inp)
    req = running_request(h, inp + seq(7000, 1, ps), seq(10_000, 1, ps))
    assert req.cache_protected_len == len(inp)
    assert h.cache.protected_size() == len(inp)
    h.cache.cache_finished_req(req)
    h.held = 0
    h.check()
    assert h.cache.protected_size() == 0
    assert h.cache.evictable_size() == len(inp) + 2 * ps


def test_cache_finished_req_without_insert_frees_everything_it_owned(h: Harness) -> None:
    ps = h.page_size
    inp = seq(0, 3, ps)
    req = running_request(h, inp, seq(10_000, 1, ps))
    h.cache.cache_finished_req(req, is_insert=False)
    h.held = 0
    h.check()
    assert h.match_len(inp) == 0
    assert h.alloc.available_size() == h.alloc.size


def test_cache_unfinished_req_locks_the_new_last_node(h: Harness) -> None:
    ps = h.page_size
    inp = seq(0, 4, ps) + [7] * (ps // 2)
    req = running_request(h, inp, [])
    req.kv_committed_len = len(inp)
    h.cache.cache_unfinished_req(req)
    aligned = len(inp) // ps * ps
    assert req.prefix_indices.shape[0] == aligned > 0
    assert req.cache_protected_len == req.prefix_indices.shape[0]
    assert req.last_node is not None and req.last_node.lock_ref > 0
    assert h.cache.protected_size() == aligned
    row = req.req_pool_idx
    assert row is not None
    assert torch.equal(h.cache.req_to_token_pool.read(row, 0, aligned), req.prefix_indices)
    h.held = (len(inp) - aligned and ps) if ps > 1 else 0
    h.check()
    # A second chunk: the lock moves down, the old one is released.
    more = seq(20_000, 1, ps)
    req.origin_input_ids = inp + more
    extra = h.new_value(len(more))
    full_row = torch.cat([h.cache.req_to_token_pool.read(row, 0, len(inp)), extra])
    h.cache.req_to_token_pool.write(row, 0, full_row[: len(inp) + len(more)])
    req.kv_committed_len = req.kv_allocated_len = len(inp) + len(more)
    h.cache.cache_unfinished_req(req)
    assert h.cache.protected_size() == req.cache_protected_len
    h.cache.cache_finished_req(req)
    h.held = 0
    h.check()
    assert h.cache.protected_size() == 0


def test_reset_frees_everything_but_refuses_while_locked(h: Harness) -> None:
    ps = h.page_size
    h.insert(seq(0, 2, ps))
    h.insert(seq(100 * ps, 2, ps))
    node = h.match(seq(0, 2, ps)).last_device_node
    receipt = h.cache.inc_lock_ref(node)
    with pytest.raises(InvalidLockError):
        h.cache.reset()
    h.check()
    h.cache.dec_lock_ref(node, receipt.to_dec_params())
    h.cache.reset()
    h.check()
    assert h.cache.num_nodes == 0 and h.alloc.available_size() == h.alloc.size


def test_pretty_print_and_stats(h: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    ps = h.page_size
    h.insert(seq(0, 2, ps))
    h.match(seq(0, 2, ps))
    text = h.cache.pretty_print()
    assert "#nodes=1" in capsys.readouterr().out and "full=D-/0" in text
    stats = h.cache.stats()
    assert stats.match_requests == 1 and stats.hit_tokens[Tier.DEVICE] == 2 * ps
    assert stats.inserted_tokens == 2 * ps
    full = stats.component(ComponentType.FULL)
    assert full is not None and full.evictable == 2 * ps


@pytest.mark.parametrize(
    "components",
    [(FULL,), (FULL, ComponentType.SWA), (FULL, ComponentType.MAMBA)],
    ids=["full", "swa", "mamba"],
)
def test_sglang_names_root_node_component_data_and_available_and_evictable_str(
    components: tuple[ComponentType, ...],
) -> None:
    cache = build_cache(
        CacheConfig(
            components=components_of(components, SlidingWindowSpec(4), MambaSpec(size=8)),
            kv_size=64,
        )
    )
    assert cache.root_node is cache.root
    v = cache.token_to_kv_pool_allocator.alloc(4)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=v))
    (node,) = cache.iter_nodes()
    assert node.component_data is node.data
    assert node.component_data[FULL] is node.full
    lines = cache.available_and_evictable_str().splitlines()
    assert lines[0] == (
        f"Available full tokens: {cache.full.pool_available() + 4} "
        f"(full_available_size={cache.full.pool_available()} + full_evictable_size_=4)"
    )
    assert len(lines) == len(components)
    for line, ct in zip(lines[1:], components[1:], strict=True):
        c = cache.component(ct)
        total = c.pool_available() + c.evictable_size
        assert line.startswith(f"Available {ct.name.lower()}: {total} ")
    cache.sanity_check()
    cache.check_pools()


@pytest.mark.parametrize(
    "components",
    [(FULL,), (FULL, SlidingWindowSpec(window=4)), (FULL, MambaSpec(size=8))],
    ids=["full", "swa", "mamba"],
)
def test_the_cache_keeps_its_fields_in_slots_and_still_takes_other_attributes(
    components: tuple[ComponentType | ComponentSpec, ...],
) -> None:
    """CPython 3.11 shares an instance dict's keys for at most 30 attributes; past that every
    field load on the lock and match paths became a hinted dict lookup.  The fields the
    operations read are slots, whatever their number; a caller may still add its own."""
    cache = build_cache(CacheConfig(components=components, kv_size=64))
    v = cache.token_to_kv_pool_allocator.alloc(4)
    node = cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=v)).last_device_node
    cache.dec_lock_ref(node, cache.inc_lock_ref(node).to_dec_params())
    assert vars(cache) == {}, sorted(vars(cache))
    cache.custom_tag = "kept"  # type: ignore[attr-defined]
    assert vars(cache) == {"custom_tag": "kept"}
    assert weakref.ref(cache)() is cache  # registries key caches weakly
    cache.sanity_check()
    cache.check_pools()


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize(
    "components",
    [
        (FULL,),
        (FULL, SlidingWindowSpec(window=4)),
        (FULL, MambaSpec(size=8)),
        (FULL, SlidingWindowSpec(window=4), MambaSpec(size=8)),
    ],
    ids=["full", "swa", "mamba", "swa+mamba"],
)
def test_each_components_on_device_flag_follows_its_value_and_sanity_check_holds_it(
    components: tuple[ComponentType | ComponentSpec, ...], ps: int
) -> None:
    """SWA's and Mamba's locks test a stored ``on_device``, not ``value``: every writer keeps
    the two together (insert, split, eviction to a tombstone), and ``sanity_check`` names a
    node where they disagree; Full's is derived from its value."""
    cache = build_cache(CacheConfig(components=components, page_size=ps, kv_size=256 * ps))
    mamba = cache.pools.mamba
    for n in (8, 4, 12):  # the second insert splits the first node
        v = cache.token_to_kv_pool_allocator.alloc(n * ps)
        slot = None if mamba is None else mamba.alloc(1)
        res = cache.insert(InsertParams(key=RadixKey(seq(0, n, ps)), value=v, mamba_value=slot))
        if res.mamba_exist and slot is not None:
            mamba.free(slot)
        cache.sanity_check()
    nodes = cache.tree.nodes()
    assert len(nodes) >= 3  # SWA may split more (a tombstone boundary)
    for node in nodes:
        assert (node.full, node.swa, node.mamba) == node.data
        assert node.full.on_device
        assert all(cd.on_device is (cd.value is not None) for cd in node.data if cd is not None)
    while cache.evict(
        EvictParams(num_tokens=4 * ps, swa_num_tokens=4 * ps, mamba_num=1)
    ).num_tokens_evicted:
        cache.sanity_check()  # tombstones on the way (SWA, Mamba), then whole nodes
    assert cache.tree.num_nodes == 0
    v = cache.token_to_kv_pool_allocator.alloc(4 * ps)
    (node,) = [cache.insert(InsertParams(key=RadixKey(seq(0, 4, ps)), value=v)).last_device_node]
    for cd in node.data:
        if cd is None:
            continue
        if not isinstance(cd, PresenceData):  # derived: a write that disagrees is refused
            with pytest.raises(AssertionError, match="on_device"):
                cd.on_device = not cd.on_device
            continue
        cd.on_device = not cd.on_device  # behind the cache's back
        with pytest.raises(AssertionError, match="on_device"):
            cache.sanity_check()
        cd.on_device = not cd.on_device
    cache.sanity_check()
    cache.check_pools()


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize(
    "components",
    [(FULL, MambaSpec(size=8)), (FULL, SlidingWindowSpec(window=4), MambaSpec(size=8))],
    ids=["mamba", "swa+mamba"],
)
def test_mamba_data_names_the_slot_of_its_state_and_sanity_check_holds_it(
    components: tuple[ComponentType | ComponentSpec, ...], ps: int
) -> None:
    """Each node's Mamba data keeps the pool slot its ``value`` names (``-1`` without state):
    an insert sets it, a split leaves the upper node without it, eviction clears it, and
    ``sanity_check`` names a node where slot and value disagree."""
    cache = build_cache(CacheConfig(components=components, page_size=ps, kv_size=256 * ps))
    mamba = cache.pools.mamba
    assert mamba is not None
    comp = cache.component(ComponentType.MAMBA)
    for n in (8, 4, 12):  # the second insert splits the first node
        v = cache.token_to_kv_pool_allocator.alloc(n * ps)
        slot = mamba.alloc(1)
        res = cache.insert(InsertParams(key=RadixKey(seq(0, n, ps)), value=v, mamba_value=slot))
        if res.mamba_exist:
            mamba.free(slot)
        cache.sanity_check()
    states = [n for n in cache.tree.nodes() if n.mamba.value is not None]
    assert len(states) == 3
    for node in cache.tree.nodes():
        cd = node.mamba
        want = -1 if cd.value is None else int(cd.value.item())
        assert cd.slot == want, (node.id, cd.slot, want)
        assert comp.state_slot(node) == (None if want < 0 else want)
        assert want < 0 or mamba.is_tree_owned(want)
    assert len({n.mamba.slot for n in states}) == 3
    victim = states[0]
    other = states[1].mamba.slot
    right = victim.mamba.slot
    victim.mamba.slot = other  # behind the cache's back
    with pytest.raises(AssertionError, match="slot"):
        cache.sanity_check()
    victim.mamba.slot = right
    while cache.evict(EvictParams(num_tokens=4 * ps, mamba_num=1)).num_tokens_evicted:
        cache.sanity_check()
        assert all((n.mamba.slot >= 0) is (n.mamba.value is not None) for n in cache.tree.nodes())
    assert cache.tree.num_nodes == 0
    assert mamba.num_tree_owned() == 0
    cache.check_pools()
