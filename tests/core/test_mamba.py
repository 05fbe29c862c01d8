"""MAMBA component: state placement, copy-on-write, branching, eviction, locks, bad input.

Every test that mutates the cache ends each step with ``sanity_check()`` and a pool
conservation check (``held`` = units owned by live requests).  States carry a fingerprint of
the tokens they summarise, so a test can tell a state at the right position from any other.
"""

from __future__ import annotations

import pytest
import torch
from mamba_harness import (
    FULL,
    MAMBA,
    Server,
    check,
    comp,
    insert_state,
    make,
    match,
    pages,
    pool_of,
    snapshot,
    state_at,
    state_is,
    write_state,
)

from urc import (
    CacheConfig,
    DecLockRefParams,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    Req,
    UnifiedRadixCache,
    build_cache,
)
from urc.config import build_pools
from urc.errors import (
    ConfigError,
    InvalidIndicesError,
    InvalidInputError,
    InvalidLockError,
    TreeOwnedSlotError,
)
from urc.specs import MambaSpec


# ---------------------------------------------------------------------------- scenarios
@pytest.mark.parametrize("ps", [1, 4, 64])
def test_legacy_mamba_scenario(ps: int) -> None:
    """SGLang's legacy MambaRadixCache test (four overlapping inserts, each with a state)."""
    cache = make(ps)

    def P(*xs: int) -> list[int]:
        return pages(ps, *xs)

    assert insert_state(cache, P(1, 2, 3))[0].prefix_len == 0
    assert insert_state(cache, P(1, 2, 3, 4, 5, 6, 7))[0].prefix_len == 3 * ps
    assert insert_state(cache, P(10, 11, 12))[0].prefix_len == 0
    assert insert_state(cache, P(1, 2, 3, 4, 5, 60, 70))[0].prefix_len == 5 * ps
    assert cache.mamba_evictable_size() == 4
    # Our Full eviction takes leaves by last access (a split leaves the lower part's time
    # unchanged), so [6, 7] would be the oldest leaf; use it once so the victims are the ones
    # SGLang's LRU list picked: the leaf [10, 11, 12], then the oldest state, on [1, 2, 3].
    assert match(cache, P(1, 2, 3, 4, 5, 6, 7)).device_indices.shape[0] == 7 * ps
    ev = cache.evict(EvictParams(num_tokens=1))
    assert ev.num_tokens_evicted == 3 * ps and ev.mamba_num_evicted == 1  # a leaf counts its state
    check(cache)
    ev = cache.evict(EvictParams(mamba_num=1))
    assert ev.mamba_num_evicted == 1 and ev.num_tokens_evicted == 0  # internal: tombstone only
    check(cache)
    # A prefix without state does not match, even though its KV is cached.
    r = match(cache, P(1, 2, 3, 4, 5))
    assert r.device_indices.shape[0] == 0 and r.last_device_node is cache.root
    assert r.mamba_branching_seqlen == 4 * ps  # visited 5 pages: checkpoint at the chunk below
    # Prefixes ending on a node with state match, with that node last.
    r = match(cache, P(1, 2, 3, 4, 5, 60, 70))
    assert r.device_indices.shape[0] == 7 * ps and list(r.last_device_node.key) == P(60, 70)
    assert r.mamba_branching_seqlen is None
    r = match(cache, P(1, 2, 3, 4, 5, 6, 7))
    assert r.device_indices.shape[0] == 7 * ps and list(r.last_device_node.key) == P(6, 7)
    check(cache)
    # The least recently used state now is [60, 70]'s: a leaf, so the node goes.
    ev = cache.evict(EvictParams(mamba_num=1))
    assert ev.mamba_num_evicted == 1 and ev.num_tokens_evicted == 2 * ps
    r = match(cache, P(1, 2, 3, 4, 5, 60, 70))
    assert r.device_indices.shape[0] == 0 and r.last_device_node.key_len == 0
    check(cache)
    # Copy-on-write: the request gets an equal state in a slot of its own.
    req = Req("cow", P(1, 2, 3, 4, 5, 6, 7))
    r = match(cache, P(1, 2, 3, 4, 5, 6, 7), req)
    node = r.last_device_node
    assert r.device_indices.shape[0] == 7 * ps
    src = state_at(cache, node)
    assert req.mamba_pool_idx is not None and src is not None
    dst = int(req.mamba_pool_idx)
    pool = pool_of(cache)
    assert dst != src
    assert torch.equal(pool.conv[dst], pool.conv[src])
    assert torch.equal(pool.temporal[dst], pool.temporal[src])
    assert state_is(cache, dst, P(1, 2, 3, 4, 5, 6, 7))
    check(cache, (req,))
    # Evicting every state makes every sequence unmatchable; the request's copy survives.
    cache.evict(EvictParams(mamba_num=100))
    assert cache.mamba_evictable_size() == 0
    for seq in (P(1, 2, 3), P(1, 2, 3, 4, 5, 6, 7), P(10, 11, 12)):
        assert match(cache, seq).device_indices.shape[0] == 0
    assert state_is(cache, dst, P(1, 2, 3, 4, 5, 6, 7))
    check(cache, (req,))
    comp(cache).free_req_slots(req)
    check(cache)


@pytest.mark.parametrize("ps", [1, 4, 64])
def test_cow_keeps_tree_copy_and_node_matchable(ps: int) -> None:
    cache = make(ps)
    seq = pages(ps, 1, 2, 3)
    insert_state(cache, seq)
    req = Req("a", seq)
    r1 = match(cache, seq, req)
    node = r1.last_device_node
    src = state_at(cache, node)
    assert src is not None and req.mamba_pool_idx is not None
    dst = int(req.mamba_pool_idx)
    write_state(cache, dst, [999])  # the request runs on: its copy changes, the tree's not
    assert state_is(cache, src, seq)
    # A second copy-on-write reuses the request's slot and restores the matched state.
    r2 = match(cache, seq, req)
    assert r2.last_device_node is node and int(req.mamba_pool_idx) == dst
    assert state_is(cache, dst, seq)
    assert state_at(cache, node) == src
    check(cache, (req,))


@pytest.mark.parametrize("ps", [1, 4])
def test_cow_evicts_one_state_but_never_its_source(ps: int) -> None:
    cache = make(ps, mamba_size=3)
    seqs = [pages(ps, i, i + 1) for i in (1, 10, 20)]
    for s in seqs:
        insert_state(cache, s)
    assert pool_of(cache).available_size() == 0
    # Make the source the least recently used state: only the temporary lock saves it.
    req = Req("a", seqs[0])
    r = match(cache, seqs[0], req)
    assert r.device_indices.shape[0] == 2 * ps and req.mamba_pool_idx is not None
    assert state_at(cache, r.last_device_node) is not None
    assert state_is(cache, req.mamba_pool_idx, seqs[0])
    # Exactly one other state was evicted (with its leaf); the lock was fully released.
    assert cache.mamba_evictable_size() == 2
    assert match(cache, seqs[1]).device_indices.shape[0] == 0
    assert cache.full_protected_size() == 0 and cache.mamba_protected_size() == 0
    check(cache, (req,))


def test_cow_without_a_free_slot_degrades_to_a_miss() -> None:
    cache = make(1, mamba_size=2)
    seq = [1, 2, 3]
    insert_state(cache, seq)
    pool = pool_of(cache)
    hold = pool.alloc(1)  # every other slot held by someone else
    assert hold is not None
    req = Req("a", seq)
    r = match(cache, seq, req)  # the only evictable state is the source: locked meanwhile
    assert r.device_indices.shape[0] == 0 and r.last_device_node is cache.root
    assert req.mamba_pool_idx is None
    assert match(cache, seq).device_indices.shape[0] == 3  # the tree still has it
    check(cache, extra_slots=1)


@pytest.mark.parametrize("ps", [1, 4])
def test_split_gives_the_upper_node_no_state(ps: int) -> None:
    cache = make(ps)
    a, b, c = pages(ps, 1, 2), pages(ps, 3, 4), pages(ps, 5)
    _, slot = insert_state(cache, a + b)
    insert_state(cache, a + c)
    upper = match(cache, a + c).last_device_node.parent
    assert upper is not None and list(upper.key) == a
    assert state_at(cache, upper) is None
    leaf = match(cache, a + b).last_device_node
    assert list(leaf.key) == b and state_at(cache, leaf) == slot
    assert match(cache, a).device_indices.shape[0] == 0  # no state at the split point
    # A match that ends mid-edge splits too; the new node is not a valid boundary either.
    r = match(cache, a + pages(ps, 3, 9))
    assert r.device_indices.shape[0] == 0 and r.mamba_branching_seqlen is not None
    check(cache)


@pytest.mark.parametrize("ps", [1, 4, 64])
def test_checkpoint_on_an_internal_node(ps: int) -> None:
    cache = make(ps)
    a, b = pages(ps, 1, 2), pages(ps, 3)
    insert_state(cache, a + b)
    result, slot = insert_state(cache, a)  # splits; the upper node takes the state
    assert result.prefix_len == len(a) and not result.mamba_exist and slot is not None
    node = result.last_device_node
    assert node is not None and node.children and state_at(cache, node) == slot
    r = match(cache, a + pages(ps, 7))
    assert r.last_device_node is node and r.device_indices.shape[0] == len(a)
    assert state_is(cache, slot, a)
    assert comp(cache).lru.ids()[-1] == node.id  # the match refreshed it
    # Use the leaf: the checkpoint is now the oldest state.  Evicting it tombstones the node
    # (no cascade); the leaf below keeps its state and its match.
    assert match(cache, a + b).device_indices.shape[0] == len(a + b)
    ev = cache.evict(EvictParams(mamba_num=1))
    assert (ev.mamba_num_evicted, ev.num_tokens_evicted) == (1, 0)
    assert not node.deleted and state_at(cache, node) is None
    assert match(cache, a + b).device_indices.shape[0] == len(a + b)
    assert match(cache, a).device_indices.shape[0] == 0
    check(cache)


def test_mamba_exist_frees_the_callers_slot() -> None:
    cache = make(4)
    seq = pages(4, 1, 2)
    first, slot = insert_state(cache, seq)
    assert not first.mamba_exist and slot is not None
    pool = pool_of(cache)
    before = pool.available_size()
    value = cache.token_to_kv_pool_allocator.alloc(len(seq))
    t = pool.alloc(1)
    assert value is not None and t is not None
    second = cache.insert(InsertParams(RadixKey(seq), value, mamba_value=t))
    assert second.mamba_exist and second.prefix_len == len(seq)
    assert state_at(cache, match(cache, seq).last_device_node) == slot  # kept its own
    check(cache, extra_slots=1)  # the caller still holds t ...
    pool.free(t)  # ... and frees it
    assert pool.available_size() == before
    # Without a state value the result still says the node has one.
    value = cache.token_to_kv_pool_allocator.alloc(len(seq))
    assert value is not None
    assert cache.insert(InsertParams(RadixKey(seq), value)).mamba_exist
    check(cache)


def test_insert_without_state_makes_an_unmatchable_leaf() -> None:
    cache = make(1)
    result, slot = insert_state(cache, [1, 2, 3], state=False)
    assert slot is None and not result.mamba_exist
    r = match(cache, [1, 2, 3])
    assert r.device_indices.shape[0] == 0 and r.mamba_branching_seqlen == 0
    check(cache)


def test_branching_seqlen() -> None:
    cache = make(1, chunk=4)
    long = list(range(1, 13))
    insert_state(cache, long)
    r = match(cache, [*long[:10], 99])  # walks 10 tokens (split there), no state on the way
    assert r.device_indices.shape[0] == 0 and r.mamba_branching_seqlen == 8
    insert_state(cache, long[:4])  # a checkpoint at 4
    req = Req("b", [*long[:10], 99])
    r = match(cache, req.origin_input_ids, req)
    assert r.device_indices.shape[0] == 4 and r.mamba_branching_seqlen == 8
    assert req.mamba_branching_seqlen == 8
    r = match(cache, long)
    assert r.device_indices.shape[0] == 12 and r.mamba_branching_seqlen is None
    check(cache, (req,))


def test_branching_seqlen_is_page_aligned() -> None:
    cache = make(4, chunk=8)
    seq = pages(4, *range(1, 7))  # 24 tokens
    insert_state(cache, seq)
    r = match(cache, seq[:20] + pages(4, 99))  # visits 5 pages = 20 tokens
    assert r.mamba_branching_seqlen == 16
    check(cache)


# ---------------------------------------------------------------------------- eviction
@pytest.mark.parametrize("ps", [1, 4, 64])
def test_full_eviction_of_a_leaf_counts_its_state(ps: int) -> None:
    cache = make(ps)
    insert_state(cache, pages(ps, 1, 2))
    ev = cache.evict(EvictParams(num_tokens=1))
    assert ev.num_tokens_evicted == 2 * ps and ev.mamba_num_evicted == 1
    assert cache.num_nodes == 0
    check(cache)


def test_mamba_eviction_skips_locked_states_and_keeps_full_locked_leaves() -> None:
    cache = make(1)
    insert_state(cache, [1, 2])
    insert_state(cache, [5, 6])
    leaf = match(cache, [1, 2]).last_device_node
    receipt = cache.inc_lock_ref(leaf)
    assert cache.mamba_protected_size() == 1 and cache.mamba_evictable_size() == 1
    ev = cache.evict(EvictParams(mamba_num=5))
    assert ev.mamba_num_evicted == 1  # only the unlocked one
    assert match(cache, [1, 2]).last_device_node is leaf
    check(cache)
    cache.dec_lock_ref(leaf, receipt.to_dec_params())
    # A Full-locked leaf whose state was adopted after the lock: the state goes, the node stays.
    other, _ = insert_state(cache, [7, 8], state=False)
    node = other.last_device_node
    assert node is not None
    receipt = cache.inc_lock_ref(node)
    assert receipt.skip_lock_node_ids[MAMBA] == {node.id}
    t = pool_of(cache).alloc(1)
    value = cache.token_to_kv_pool_allocator.alloc(2)
    cache.insert(InsertParams(RadixKey([7, 8]), value, mamba_value=t, prev_prefix_len=0))
    assert state_at(cache, node) is not None and cache.mamba_evictable_size() == 2
    ev = cache.evict(EvictParams(mamba_num=5))
    assert ev.mamba_num_evicted == 2 and not node.deleted and node.data[FULL].lock_ref == 1  # type: ignore[union-attr]
    check(cache)
    cache.dec_lock_ref(node, receipt.to_dec_params())  # skips Mamba: it never locked it
    check(cache)


# ---------------------------------------------------------------------------- locks
def test_lock_pins_only_the_node_itself() -> None:
    cache = make(1)
    insert_state(cache, [1, 2])
    insert_state(cache, [1, 2, 3, 4])
    leaf = match(cache, [1, 2, 3, 4]).last_device_node
    parent = leaf.parent
    assert parent is not None and state_at(cache, parent) is not None
    receipt = cache.inc_lock_ref(leaf)
    assert leaf.data[MAMBA].lock_ref == 1 and parent.data[MAMBA].lock_ref == 0  # type: ignore[union-attr]
    assert parent.data[FULL].lock_ref == 1  # type: ignore[union-attr]
    assert (cache.mamba_protected_size(), cache.mamba_evictable_size()) == (1, 1)
    check(cache)
    assert cache.evict(EvictParams(mamba_num=1)).mamba_num_evicted == 1  # the parent's state
    assert state_at(cache, parent) is None and state_at(cache, leaf) is not None
    cache.dec_lock_ref(leaf, receipt.to_dec_params())
    assert (cache.mamba_protected_size(), cache.mamba_evictable_size()) == (0, 1)
    check(cache)
    before = snapshot(cache)
    with pytest.raises(InvalidLockError):
        cache.dec_lock_ref(leaf, receipt.to_dec_params())
    assert snapshot(cache) == before


def test_refused_releases_change_nothing_though_full_is_not_checked_first() -> None:
    """Mamba is released first and proves Full's lock when it releases anything, so Full's
    separate check is skipped: every refused release must still leave everything as it was,
    and a release that consumes another lock's count keeps the counts consistent."""
    cache = make(1)
    insert_state(cache, [1, 2])
    insert_state(cache, [1, 2, 3, 4], state=False)  # [3, 4]: no state of its own
    with_state = match(cache, [1, 2]).last_device_node
    (stateless,) = with_state.children.values()  # a match would end above it (no state)
    assert state_at(cache, with_state) is not None and state_at(cache, stateless) is None
    for node in (with_state, stateless):
        before = snapshot(cache)
        with pytest.raises(InvalidLockError):  # not locked, no receipt: Mamba has nothing
            cache.dec_lock_ref(node)
        assert snapshot(cache) == before
        receipt = cache.inc_lock_ref(node).to_dec_params()
        cache.dec_lock_ref(node, receipt)
        before = snapshot(cache)
        with pytest.raises(InvalidLockError):  # the same receipt again
            cache.dec_lock_ref(node, receipt)
        assert snapshot(cache) == before
        check(cache)
    first = cache.inc_lock_ref(with_state).to_dec_params()
    cache.inc_lock_ref(with_state)
    cache.dec_lock_ref(with_state, first)
    cache.dec_lock_ref(with_state, first)  # a caller's bug: it takes the second lock's count
    check(cache)
    assert with_state.data[MAMBA].lock_ref == 0 and with_state.data[FULL].lock_ref == 0  # type: ignore[union-attr]


def test_release_without_receipt_and_early_release() -> None:
    cache = make(1)
    insert_state(cache, [1, 2])
    leaf = match(cache, [1, 2]).last_device_node
    cache.inc_lock_ref(leaf)
    cache.dec_lock_ref(leaf)  # no receipt: lock counts decide
    check(cache)
    # An early partial release (what SWA's dec_swa_lock_only calls) drops the Mamba part and
    # records it in the receipt, so the final release does not repeat it.
    receipt = cache.inc_lock_ref(leaf)
    params = receipt.to_dec_params()
    comp(cache).release_lock_early(leaf, params)
    comp(cache).release_lock_early(leaf, params)  # idempotent per receipt
    assert leaf.data[MAMBA].lock_ref == 0 and leaf.data[FULL].lock_ref == 1  # type: ignore[union-attr]
    check(cache)
    cache.dec_lock_ref(leaf, receipt.to_dec_params())
    assert leaf.data[FULL].lock_ref == 0  # type: ignore[union-attr]
    check(cache)


def test_lock_counts_keep_full_above_mamba_across_requests() -> None:
    cache = make(1)
    insert_state(cache, [1, 2, 3])
    node = match(cache, [1, 2, 3]).last_device_node
    receipts = [cache.inc_lock_ref(node) for _ in range(3)]
    assert node.data[MAMBA].lock_ref == 3 == node.data[FULL].lock_ref  # type: ignore[union-attr]
    insert_state(cache, [1, 2])  # split above: the new parent has no state and no Mamba lock
    parent = node.parent
    assert parent is not None and parent.data[MAMBA].lock_ref == 0  # type: ignore[union-attr]
    check(cache)
    for r in receipts:
        cache.dec_lock_ref(node, r.to_dec_params())
        check(cache)


# ---------------------------------------------------------------------------- bad input
def _mamba_value_cases(cache: UnifiedRadixCache, tree_slot: int) -> list[tuple[object, type]]:
    pool = pool_of(cache)
    free_slot = next(s for s in range(pool.size) if not pool.is_allocated(s))
    return [
        (torch.tensor([pool.size]), InvalidIndicesError),  # outside the pool
        (torch.tensor([-1]), InvalidIndicesError),
        (torch.tensor([free_slot]), InvalidIndicesError),  # not allocated
        (torch.tensor([tree_slot]), TreeOwnedSlotError),  # the tree's own
        (torch.tensor([0], dtype=torch.int32), InvalidIndicesError),
        (torch.tensor([0, 1]), InvalidIndicesError),
        (torch.tensor([0], device="meta"), InvalidIndicesError),  # not the pool's device
        (torch.tensor(tree_slot), TreeOwnedSlotError),  # 0-d: one element, like SGLang's
        (5, InvalidIndicesError),
    ]


def test_bad_mamba_value_on_insert_changes_nothing() -> None:
    cache = make(1)
    _, tree_slot = insert_state(cache, [1, 2, 3])
    assert tree_slot is not None
    for bad, err in _mamba_value_cases(cache, tree_slot):
        value = cache.token_to_kv_pool_allocator.alloc(2)
        assert value is not None
        before = snapshot(cache)
        with pytest.raises(err):
            cache.insert(InsertParams(RadixKey([1, 9]), value, mamba_value=bad))  # type: ignore[arg-type]
        assert snapshot(cache) == before
        cache.token_to_kv_pool_allocator.free(value)
    check(cache)


def test_a_state_on_another_device_than_the_pools_indices_is_refused() -> None:
    """A pool whose index tensors live off the CPU (SGLang's on a GPU; ``meta`` here): a CPU
    tensor naming a slot the caller holds is on the wrong device, refused like any other."""
    config = make(1).config
    pools = build_pools(config)
    assert pools.mamba is not None
    pools.mamba.index_device = torch.device("meta")
    cache = build_cache(config, pools)
    slot = pools.mamba.alloc_slot()
    value = cache.token_to_kv_pool_allocator.alloc(2)
    assert slot is not None and value is not None
    before = snapshot(cache)
    with pytest.raises(InvalidIndicesError, match="meta"):
        cache.insert(InsertParams(RadixKey([1, 9]), value, mamba_value=torch.tensor([slot])))
    assert snapshot(cache) == before


def test_state_on_an_unaligned_key_is_refused() -> None:
    cache = make(4)
    value = cache.token_to_kv_pool_allocator.alloc(6)
    t = pool_of(cache).alloc(1)
    assert value is not None and t is not None
    before = snapshot(cache)
    with pytest.raises(InvalidInputError):
        cache.insert(InsertParams(RadixKey(list(range(6))), value, mamba_value=t))
    assert snapshot(cache) == before


def test_cow_without_request_or_with_a_bad_slot_changes_nothing() -> None:
    cache = make(1)
    _, tree_slot = insert_state(cache, [1, 2, 3, 4])
    assert tree_slot is not None
    before = snapshot(cache)
    with pytest.raises(InvalidInputError):
        # Would split [1, 2, 3, 4] and touch access times if it got that far.
        cache.match_prefix(MatchPrefixParams(RadixKey([1, 2, 9]), cow_mamba=True))
    assert snapshot(cache) == before
    for bad, err in _mamba_value_cases(cache, tree_slot):
        req = Req("a", [1, 2, 9])
        req.mamba_pool_idx = bad  # type: ignore[assignment]
        with pytest.raises(err):
            match(cache, [1, 2, 9], req)
        assert snapshot(cache) == before
    check(cache)


def test_freeing_a_tree_owned_slot_is_refused() -> None:
    cache = make(1)
    srv = Server(cache)
    _, tree_slot = insert_state(cache, [1, 2, 3])
    assert tree_slot is not None
    pool = pool_of(cache)
    before = snapshot(cache)
    with pytest.raises(TreeOwnedSlotError):
        pool.free(tree_slot)
    req = srv.start([5, 6, 7], buffer=2)
    before = snapshot(cache)
    own = req.mamba_pool_idx
    req.mamba_pool_idx = torch.tensor(tree_slot)  # a request claiming the tree's slot
    with pytest.raises(TreeOwnedSlotError):
        comp(cache).free_req_slots(req)
    with pytest.raises(TreeOwnedSlotError):
        cache.cache_finished_req(req)
    with pytest.raises(TreeOwnedSlotError):
        cache.cache_unfinished_req(req)
    assert snapshot(cache) == before and req.req_pool_idx is not None
    req.mamba_pool_idx = own
    buf = req.mamba_ping_pong_track_buffer
    req.mamba_ping_pong_track_buffer = torch.tensor([tree_slot])
    with pytest.raises(TreeOwnedSlotError):
        cache.cache_finished_req(req, is_insert=False)
    req.mamba_ping_pong_track_buffer = torch.tensor([int(own), 0])  # type: ignore[arg-type]
    with pytest.raises(InvalidIndicesError):  # the same slot twice
        cache.cache_finished_req(req)
    assert snapshot(cache) == before
    req.mamba_ping_pong_track_buffer = buf
    srv.compute(req, 3, track=2)
    req.mamba_last_track_seqlen = 9  # past the committed tokens
    with pytest.raises(InvalidInputError):
        cache.cache_finished_req(req)
    req.mamba_next_track_idx = 2
    with pytest.raises(InvalidInputError):
        cache.cache_finished_req(req)
    req.mamba_next_track_idx = 1
    req.mamba_last_track_seqlen = 2
    srv.finish(req)
    srv.check()


def test_snapshot_past_the_computed_tokens_is_refused() -> None:
    # (An unaligned snapshot is aligned down to a page, as SGLang does: test_mamba_requests.)
    cache = make(4)
    srv = Server(cache)
    req = srv.start(pages(4, 1, 2), buffer=2)
    srv.compute(req, 8, track=8)
    req.mamba_last_track_seqlen = 12
    before = snapshot(cache)
    with pytest.raises(InvalidInputError):
        cache.cache_unfinished_req(req)
    assert snapshot(cache) == before
    req.mamba_last_track_seqlen = 8
    srv.finish(req)
    srv.check()


def test_config_errors() -> None:
    with pytest.raises(ConfigError):
        CacheConfig(components=(FULL, MambaSpec(size=0)))
    with pytest.raises(ConfigError):
        CacheConfig(components=(FULL, MambaSpec(size=4, conv_shape=())))


def test_reset_frees_every_state() -> None:
    cache = make(1)
    insert_state(cache, [1, 2, 3])
    insert_state(cache, [1, 2])
    cache.reset()
    check(cache)
    assert pool_of(cache).available_size() == 20 and len(comp(cache).lru) == 0


def test_stats_report_states() -> None:
    cache = make(1)
    insert_state(cache, [1, 2, 3])
    s = cache.stats().component(MAMBA)
    assert s is not None and s.unit == "states"
    assert (s.evictable, s.protected, s.capacity, s.available) == (1, 0, 20, 19)


def test_dec_params_type_is_accepted() -> None:
    # A hand-built receipt with the Mamba skip recorded behaves like the real one.
    cache = make(1)
    insert_state(cache, [1, 2])
    node = match(cache, [1, 2]).last_device_node
    receipt = cache.inc_lock_ref(node)
    params = DecLockRefParams(skip_lock_node_ids=dict(receipt.skip_lock_node_ids))
    cache.dec_lock_ref(node, params)
    check(cache)
