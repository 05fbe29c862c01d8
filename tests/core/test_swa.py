"""The SWA component on ``(FULL, SWA)`` caches, table-driven over (page_size, window).

Every mutating step is followed by ``sanity_check()`` and a conservation check of both pools
(Full and SWA): ``free + evictable + protected + held == capacity``, where ``held`` is what
the test itself still owns.
"""

from __future__ import annotations

import pytest
import torch
from swa_harness import SWAHarness

from urc import (
    CacheConfig,
    ComponentType,
    ConfigError,
    DecLockRefParams,
    EvictParams,
    InsertParams,
    InvalidInputError,
    InvalidLockError,
    MatchPrefixParams,
    RadixKey,
    Req,
    UnifiedRadixCache,
    build_cache,
)
from urc.components.swa import SWAData
from urc.config import build_pools
from urc.pools.allocator import TokenSlotAllocator
from urc.specs import SlidingWindowSpec

FULL, SWA = ComponentType.FULL, ComponentType.SWA
CONFIGS = [(1, 4), (4, 4), (4, 2), (16, 16), (64, 64), (128, 4), (1, 128)]
IDS = [f"ps{ps}-w{w}" for ps, w in CONFIGS]


@pytest.fixture(params=CONFIGS, ids=IDS)
def h(request: pytest.FixtureRequest) -> SWAHarness:
    ps, w = request.param
    return SWAHarness(ps, w)


# ====================================================================== insert and match
def test_insert_and_match_basic(h: SWAHarness) -> None:
    a = h.seq(1000, 2)
    assert h.insert(a)[0].prefix_len == 0
    r, _ = h.insert(a + h.seq(5000, 1))
    assert r.prefix_len == len(a)
    assert h.match(a + h.seq(5000, 1))[0] == len(a) + h.ps
    assert h.match(a + h.seq(9000, 1))[0] == len(a)
    assert h.match(h.seq(7000, 2))[0] == 0
    assert h.cache.swa_evictable_size() == h.cache.full_evictable_size() == len(a) + h.ps


def test_shared_prefix_branches_match_fully(h: SWAHarness) -> None:
    base = h.seq(1, 2)
    h.insert(base)
    for start in (100, 200, 300):
        branch = base + h.seq(start * 1000, 2)
        assert h.insert(branch)[0].prefix_len == len(base)
    for start in (100, 200, 300):
        branch = base + h.seq(start * 1000, 2)
        assert h.match(branch)[0] == len(branch)


# ====================================================================== leaf cap
def test_new_leaf_is_capped_to_one_window(h: SWAHarness) -> None:
    tail_pages = h.cap // h.ps
    long = h.seq(10, tail_pages + 2)
    h.insert(long)
    leaf = h.node(long)
    assert leaf.key_len == h.cap
    swa = h.swa_of(leaf)
    assert swa is not None and swa.shape[0] == h.cap
    assert leaf.parent is not None and leaf.parent is not h.cache.root
    assert h.swa_of(leaf.parent) is not None  # the upper part keeps SWA
    receipt = h.lock(leaf)
    assert h.cache.swa_protected_size() == h.cap
    assert h.cache.full_protected_size() == len(long)
    assert receipt.swa_uuid_for_lock is not None
    h.unlock(leaf, receipt)
    short = h.seq(90_000, tail_pages)
    h.insert(short)
    assert h.node(short).parent is h.cache.root  # not split


# ====================================================================== tombstones and match
def _tombstone_prefix(
    h: SWAHarness, prefix_pages: int = 2, via_evict: bool = False
) -> tuple[list[int], list[int]]:
    """A tree ``P -> X`` where ``P`` (one node) is an SWA tombstone and ``X`` is long (cap-split
    into an upper part and a one-window leaf).

    ``via_evict``: insert ``P`` (at most one window, so it stays one node), then ``P + X``, and
    SWA-evict ``P`` (the oldest SWA node; it is internal, so it is tombstoned).  Otherwise
    ``P + X`` is inserted with ``swa_evicted_seqlen = len(P)``.
    """
    x = h.seq(50_000, h.cap // h.ps + 2)
    if via_evict:
        p = h.seq(1, min(prefix_pages, h.cap // h.ps))
        h.insert(p)
        h.insert(p + x)
        full_before = h.cache.full_evictable_size()
        assert h.evict(swa=1) == (0, len(p))
        assert h.cache.full_evictable_size() == full_before  # Full stays on the tombstone
    else:
        p = h.seq(1, prefix_pages)
        h.insert(p + x, swa_evicted_seqlen=len(p))
    node = h.node(p)
    assert h.swa_of(node) is None and node.children and node.parent is h.cache.root
    return p, x


def test_match_below_a_tombstone_needs_a_full_window_above(h: SWAHarness) -> None:
    p, x = _tombstone_prefix(h)
    ps, w = h.ps, h.window
    assert h.match(p)[0] == 0  # ends on the tombstone
    # One page below the tombstone: valid only if one page already covers the window.
    assert h.match(p + x[:ps])[0] == (len(p) + ps if ps >= w else 0)
    # Two pages below it.
    assert h.match(p + x[: 2 * ps])[0] == (len(p) + 2 * ps if 2 * ps >= w else 0)
    # The whole sequence: the leaf holds a full window.
    n, last = h.match(p + x)
    assert n == len(p) + len(x)
    assert last is h.node(p + x)


def test_evicting_swa_breaks_only_the_broken_window(h: SWAHarness) -> None:
    p, x = _tombstone_prefix(h, via_evict=True)
    other = h.seq(700_000, h.cap // h.ps + 1)
    h.insert(other)
    assert h.match(p + x)[0] == len(p) + len(x)  # window intact below the tombstone
    assert h.match(other)[0] == len(other)
    assert h.match(p + h.seq(800_000, 1))[0] == 0  # stops at the tombstone


# SGLang's legacy ``test_swa_radix_cache_1`` scenario (page 1, window 4).  The expected
# values are those of SGLang 0.5.16's ``UnifiedRadixCache`` on the same steps (run through the
# development shim; 0.5.23's split rule leaves them unchanged here), not of the legacy
# ``SWARadixCache`` the test was written for: the unified
# cache refreshes one window plus a page on insert end, so the whole of [1..5] stays warm and
# the evictions take the [6, 7] / [10, 11, 12] / [60, 70] leaves instead.
_LEGACY_INSERTS = ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12], [1, 2, 3, 4, 5, 60, 70])
_LEGACY_EVICTS = ((1, 0), (0, 1), (1, 2))


def test_legacy_swa_scenario() -> None:
    h = SWAHarness(1, 4, pages=128, swa_pages=64)
    prefix = [h.insert(tokens)[0].prefix_len for tokens in _LEGACY_INSERTS]
    assert prefix == [0, 3, 0, 5]
    trace = []
    for full, swa in _LEGACY_EVICTS:
        trace.append(h.evict(full=full, swa=swa))
        trace.append((h.cache.full_evictable_size(), h.cache.swa_evictable_size()))
    assert trace == [(3, 3), (9, 9), (2, 2), (7, 7), (2, 2), (5, 5)]
    assert h.match([1, 2, 3, 4, 5])[0] == 5
    n, last = h.match([1, 2, 3, 4, 5, 60, 70])
    assert n == 5
    assert list(last.key) == [4, 5]


def test_legacy_swa_scenario_eagle() -> None:
    cache = build_cache(
        CacheConfig(
            components=(FULL, SlidingWindowSpec(window=4, kv_size=64)),
            kv_size=128,
            is_eagle=True,
        )
    )
    alloc = cache.token_to_kv_pool_allocator
    prefix = []
    for tokens in _LEGACY_INSERTS:
        v = alloc.alloc(len(tokens))
        assert v is not None
        r = cache.insert(InsertParams(key=RadixKey(tokens), value=v[: len(tokens) - 1]))
        alloc.free(v[len(tokens) - 1 :])
        prefix.append(r.prefix_len)
        cache.sanity_check()
        cache.check_pools()
    assert prefix == [0, 2, 0, 4]
    trace = []
    for full, swa in _LEGACY_EVICTS:
        r = cache.evict(EvictParams(num_tokens=full, swa_num_tokens=swa))
        trace.append((r.num_tokens_evicted, r.swa_num_tokens_evicted))
        trace.append((cache.full_evictable_size(), cache.swa_evictable_size()))
        cache.sanity_check()
        cache.check_pools()
    assert trace == [(2, 2), (8, 8), (2, 2), (6, 6), (2, 2), (4, 4)]
    m = cache.match_prefix(MatchPrefixParams(RadixKey([1, 2, 3, 4, 5])))
    assert m.device_indices.numel() == 4
    m = cache.match_prefix(MatchPrefixParams(RadixKey([1, 2, 3, 4, 5, 60, 70])))
    assert m.device_indices.numel() == 4
    assert m.last_device_node.key == [(3, 4), (4, 5)]


# ====================================================================== insert with a boundary
def test_insert_below_boundary_becomes_a_tombstone(h: SWAHarness) -> None:
    tokens = h.seq(3, 2 * (h.cap // h.ps))
    r, _ = h.insert(tokens, swa_evicted_seqlen=h.cap)
    assert r.prefix_len == 0
    upper = h.node(tokens[: h.cap])
    leaf = h.node(tokens)
    assert h.swa_of(upper) is None and h.swa_of(leaf) is not None
    assert leaf.parent is upper and upper.parent is h.cache.root
    assert h.match(tokens)[0] == len(tokens)


def test_insert_entirely_outside_window_keeps_a_full_leaf(h: SWAHarness) -> None:
    tokens = h.seq(3, 1)
    avail = h.alloc.available_size()
    swa_avail = h.alloc.swa_available_size()
    # The request did not free its SWA slots itself: the insert releases them.
    h.insert(tokens, swa_evicted_seqlen=len(tokens), free_out_of_window=False)
    leaf = h.node(tokens)
    assert h.swa_of(leaf) is None and h.full_of(leaf).shape[0] == len(tokens)
    assert h.alloc.available_size() == avail - len(tokens)
    assert h.alloc.swa_available_size() == swa_avail
    # A Full eviction deletes the tombstone leaf like any leaf.
    assert h.evict(full=1) == (len(tokens), 0)
    assert h.cache.num_nodes == 0


# ====================================================================== tombstone recovery
def test_recovery_inside_window_adopts_the_incoming_slots(h: SWAHarness) -> None:
    p, x = _tombstone_prefix(h, via_evict=True)
    node = h.node(p)
    old_full = h.full_of(node).clone()
    _, value = h.insert(p + x, swa_evicted_seqlen=0)
    assert torch.equal(h.full_of(node), value[: len(p)])  # adopted
    swa = h.swa_of(node)
    assert swa is not None and torch.equal(swa, h.alloc.translate(value[: len(p)]))
    assert not h.alloc.is_allocated(old_full)  # the old Full slots were freed
    assert h.match(p)[0] == len(p)


def test_recovery_with_boundary_inside_the_node_splits_it(h: SWAHarness) -> None:
    p, x = _tombstone_prefix(h)
    ps = h.ps
    _, value = h.insert(p + x, swa_evicted_seqlen=ps)
    upper = h.node(p[:ps])
    lower = h.node(p)
    assert lower.parent is upper
    assert h.swa_of(upper) is None
    assert torch.equal(h.full_of(lower), value[ps : len(p)])
    assert h.swa_of(lower) is not None


def test_recovery_outside_window_changes_nothing(h: SWAHarness) -> None:
    p, x = _tombstone_prefix(h)
    node = h.node(p)
    old_full = h.full_of(node).clone()
    avail = h.alloc.available_size()
    h.insert(p + x, swa_evicted_seqlen=len(p))
    assert h.swa_of(node) is None
    assert torch.equal(h.full_of(node), old_full)
    assert h.alloc.available_size() == avail  # every incoming slot was a duplicate


def test_recovery_with_locked_full_keeps_the_full_indices(h: SWAHarness) -> None:
    p, x = _tombstone_prefix(h)
    node = h.node(p)
    leaf = h.node(p + x)
    receipt = h.lock(leaf)  # Full locks the whole path, including the tombstone
    old_full = h.full_of(node).clone()
    avail = h.alloc.available_size()
    _, value = h.insert(p + x, swa_evicted_seqlen=0)
    assert torch.equal(h.full_of(node), old_full)  # indices unchanged
    swa = h.swa_of(node)
    assert swa is not None
    assert torch.equal(swa, h.alloc.translate(old_full))
    assert h.alloc.available_size() == avail  # every fresh Full slot was freed
    assert not h.alloc.is_allocated(value[: len(p)])
    h.unlock(leaf, receipt)
    assert h.cache.full_protected_size() == h.cache.swa_protected_size() == 0


def test_receipt_skips_tombstones_recovered_after_acquire(h: SWAHarness) -> None:
    """A lock that skipped a tombstone must not release it after it was recovered (and split,
    and locked by another request): SGLang #24153 / PR #36350."""
    p, x = _tombstone_prefix(h, prefix_pages=3)
    ps = h.ps
    node = h.node(p)
    first = h.lock(node)  # SWA: the tombstone is skipped
    assert node.id in first.skip_lock_node_ids[SWA]
    # Recover the lower part (split at one page), then the upper part: both under a Full lock.
    h.insert(p + x, swa_evicted_seqlen=ps)
    h.insert(p + x, swa_evicted_seqlen=0)
    upper = h.node(p[:ps])
    assert h.swa_of(upper) is not None and h.swa_of(node) is not None
    second = h.lock(node)
    before = h.locks()
    h.unlock(node, first)
    after = {nid: swa for nid, _, swa in h.locks()}
    for nid, _, swa in before:
        if nid in (node.id, upper.id):
            assert after[nid] == swa  # untouched by the first receipt
    h.unlock(node, second)
    assert h.cache.swa_protected_size() == h.cache.full_protected_size() == 0


# ====================================================================== window locks
def test_window_lock_receipt_survives_a_split(h: SWAHarness) -> None:
    tokens = h.seq(5, 2 * (h.cap // h.ps) + 1)
    h.insert(tokens)
    n_upper = h.cap + h.ps
    upper = h.node(tokens[:n_upper])  # the upper part of the capped leaf: >= 1 window
    receipt = h.lock(upper)
    assert receipt.swa_uuid_for_lock is not None
    assert h.cache.swa_protected_size() == n_upper
    h.match(tokens[: h.ps])  # splits the locked node: the uuid moves to the upper part
    top = h.node(tokens[: h.ps])
    top_swa = top.data[SWA]
    assert isinstance(top_swa, SWAData)
    assert top_swa.uuid == receipt.swa_uuid_for_lock
    assert h.cache.swa_protected_size() == n_upper
    h.unlock(upper, receipt)
    assert h.cache.swa_protected_size() == 0
    assert all(swa == 0 for _, _, swa in h.locks())


def test_release_with_wrong_or_missing_receipt_is_refused(h: SWAHarness) -> None:
    a = h.seq(5, h.cap // h.ps + 1)
    b = h.seq(600_000, h.cap // h.ps + 1)
    h.insert(a)
    h.insert(b)
    na, nb = h.node(a), h.node(b)
    ra = h.lock(na)
    rb = h.lock(nb)
    snap = h.snapshot()
    with pytest.raises(InvalidLockError):
        h.cache.dec_lock_ref(na, rb.to_dec_params())  # another request's receipt
    with pytest.raises(InvalidLockError):
        h.cache.dec_lock_ref(na, DecLockRefParams(swa_uuid_for_lock=rb.swa_uuid_for_lock))
    with pytest.raises(InvalidLockError):
        h.cache.dec_lock_ref(na, None)  # the window boundary needs its receipt
    with pytest.raises(InvalidLockError):
        h.cache.dec_swa_lock_only(na, rb.to_dec_params())
    assert h.snapshot() == snap
    h.check()
    h.unlock(na, ra)
    h.unlock(nb, rb)
    with pytest.raises(InvalidLockError):
        h.cache.dec_lock_ref(na, ra.to_dec_params())  # twice
    h.check()


def test_lock_that_reaches_the_root_has_no_uuid(h: SWAHarness) -> None:
    if h.ps >= h.window:
        pytest.skip("one page already fills the window")
    tokens = h.seq(5, 1)
    h.insert(tokens)
    node = h.node(tokens)
    receipt = h.lock(node)
    assert receipt.swa_uuid_for_lock is None
    assert h.cache.swa_protected_size() == h.ps
    h.unlock(node, receipt)


def test_early_window_release_keeps_full_locked(h: SWAHarness) -> None:
    tokens = h.seq(5, h.cap // h.ps + 2)
    h.insert(tokens)
    leaf = h.node(tokens)
    receipt = h.lock(leaf)
    params = receipt.to_dec_params()
    h.cache.dec_swa_lock_only(leaf, params)
    h.check()
    assert params.skip_swa
    assert h.cache.swa_protected_size() == 0
    assert h.cache.full_protected_size() == len(tokens)
    with pytest.raises(InvalidLockError):
        h.cache.dec_swa_lock_only(leaf, params)  # already released
    # SWA of the Full-locked leaf may now go; Full stays (a cascade never frees locked data).
    assert h.evict(swa=1 << 20)[1] == len(tokens)
    assert h.swa_of(leaf) is None and h.full_of(leaf).shape[0] == h.cap
    assert h.evict(full=1 << 20) == (0, 0)
    h.cache.dec_lock_ref(leaf, params)
    h.check()
    assert h.cache.full_protected_size() == 0
    assert h.evict(full=1 << 20)[0] == len(tokens)
    assert h.cache.num_nodes == 0


def test_dec_swa_lock_only_needs_swa() -> None:
    cache = build_cache(CacheConfig())
    with pytest.raises(InvalidInputError):
        cache.dec_swa_lock_only(cache.root)


# ====================================================================== eviction and cascade
def test_full_eviction_cascades_to_swa(h: SWAHarness) -> None:
    tokens = h.seq(5, 1)
    h.insert(tokens)
    assert h.evict(full=1) == (h.ps, h.ps)
    assert h.cache.num_nodes == 0
    assert h.alloc.swa_available_size() == h.alloc.swa_size


def test_swa_eviction_of_a_leaf_deletes_it(h: SWAHarness) -> None:
    tokens = h.seq(5, 1)
    h.insert(tokens)
    assert h.evict(swa=1) == (h.ps, h.ps)
    assert h.cache.num_nodes == 0


def test_locked_data_is_never_freed(h: SWAHarness) -> None:
    a = h.seq(5, h.cap // h.ps + 2)
    b = h.seq(500_000, 2)
    h.insert(a)
    h.insert(b)
    leaf = h.node(a)
    receipt = h.lock(leaf)
    h.evict(full=1 << 20, swa=1 << 20)
    # The window-locked leaf keeps both; its ancestors keep Full (SWA of the upper part may go).
    assert h.swa_of(leaf) is not None
    assert h.match(a)[0] == len(a)
    assert h.cache.full_evictable_size() == 0
    h.unlock(leaf, receipt)
    h.evict(full=1 << 20)
    assert h.cache.num_nodes == 0


def test_swa_lru_order_tombstones_old_ancestors_first(h: SWAHarness) -> None:
    seg = h.cap // h.ps + 4
    a = h.seq(1, seg)
    b = h.seq(100_000, seg)
    c = h.seq(200_000, seg)
    side = h.seq(300_000, seg)
    h.insert(a)
    h.insert(a + b)  # must not refresh a's nodes
    h.insert(side)
    h.insert(a + b + c)
    assert h.match(a + b + c)[0] == len(a + b + c)
    order = h.swa.lru.ids()
    a_upper, a_leaf = h.node(a[: len(a) - h.cap]), h.node(a)
    assert order[:2] == [a_upper.id, a_leaf.id]
    h.evict(swa=h.ps)
    assert h.swa_of(a_upper) is None  # the oldest ancestor went first
    assert h.match(side)[0] == len(side)
    assert h.match(a + b + c)[0] == len(a + b + c)


# ====================================================================== request caching
def _request(h: SWAHarness, tokens: list[int], rid: str = "r") -> Req:
    cache = h.cache
    row = cache.req_to_token_pool.alloc()
    assert row is not None
    req = Req(rid=rid, origin_input_ids=tokens)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    req.req_pool_idx = row
    req.last_node = m.last_device_node
    req.lock = cache.lock(m.last_device_node)
    req.prefix_indices = m.device_indices
    req.cache_protected_len = int(m.device_indices.shape[0])
    own = h.new_value(len(tokens) - req.cache_protected_len)
    cache.req_to_token_pool.write(row, 0, torch.cat([m.device_indices, own]))
    req.kv_committed_len = req.kv_allocated_len = len(tokens)
    h.check()
    return req


def _finish(h: SWAHarness, req: Req, own: torch.Tensor) -> None:
    h.cache.cache_finished_req(req)
    h.give(own)
    h.check()


def test_unfinished_request_keeps_the_eviction_boundary(h: SWAHarness) -> None:
    tokens = h.seq(7, 2 * (h.cap // h.ps))
    req = _request(h, tokens)
    own = h.owned[-1]
    # The window slid past the first ``cap`` tokens: their SWA slots are freed.
    assert h.swa.free_out_of_window_slots(req, h.cap + max(h.window, h.ps)) == h.cap
    assert req.swa_evicted_seqlen == h.cap
    h.check()
    h.cache.cache_unfinished_req(req)
    h.give(own)  # the tree took the request's slots
    h.check()
    upper, leaf = h.node(tokens[: h.cap]), h.node(tokens)
    assert h.swa_of(upper) is None and h.swa_of(leaf) is not None
    assert req.cache_protected_len == len(tokens) and req.last_node is leaf
    assert h.cache.swa_protected_size() == h.cap
    assert h.match(tokens)[0] == len(tokens)
    _finish(h, req, own)
    assert h.cache.full_protected_size() == h.cache.swa_protected_size() == 0


def test_free_out_of_window_slots_then_finish(h: SWAHarness) -> None:
    tokens = h.seq(9, 3 * (h.cap // h.ps) + 1)
    req = _request(h, tokens)
    own = h.owned[-1]
    swa_before = h.alloc.swa_available_size()
    freed = h.swa.free_out_of_window_slots(req, len(tokens))
    expect = len(tokens) - max(h.window, h.ps)
    expect -= expect % h.ps
    assert freed == expect and req.swa_evicted_seqlen == expect
    assert h.alloc.swa_available_size() == swa_before + expect
    assert h.swa.free_out_of_window_slots(req, len(tokens)) == 0  # idempotent
    h.check()
    _finish(h, req, own)
    leaf = h.node(tokens[: len(tokens) - len(tokens) % h.ps])
    assert h.swa_of(leaf) is not None
    assert h.match(tokens)[0] == len(tokens) - len(tokens) % h.ps


def test_early_release_through_a_request(h: SWAHarness) -> None:
    tokens = h.seq(11, h.cap // h.ps + 1)
    h.insert(tokens)
    req = _request(h, tokens + h.seq(800_000, 1))
    own = h.owned[-1]
    assert req.lock is not None and req.last_node is not None
    h.cache.release_swa(req.lock)
    h.check()
    assert h.cache.swa_protected_size() == 0
    assert h.cache.full_protected_size() == len(tokens)
    _finish(h, req, own)
    assert h.cache.full_protected_size() == 0


def test_finished_request_with_prefix_from_the_tree(h: SWAHarness) -> None:
    base = h.seq(13, h.cap // h.ps + 1)
    h.insert(base)
    tokens = base + h.seq(900_000, 2)
    req = _request(h, tokens)
    assert req.cache_protected_len == len(base)
    own = h.owned[-1]
    _finish(h, req, own)
    assert h.match(tokens)[0] == len(tokens)


# ====================================================================== bad input
def test_bad_swa_evicted_seqlen_changes_nothing(h: SWAHarness) -> None:
    h.insert(h.seq(1, 2))
    tokens = h.seq(1, 3)
    for bad in (-1, len(tokens) + 1):
        v = h.new_value(len(tokens))
        snap = h.snapshot()
        with pytest.raises(InvalidInputError):
            h.cache.insert(InsertParams(key=RadixKey(tokens), value=v, swa_evicted_seqlen=bad))
        assert h.snapshot() == snap
        h.check()
        h.alloc.free(v)
        h.give(v)
        h.check()


def test_bad_configuration() -> None:
    for bad in (0, -4, None, 2.5, True):
        with pytest.raises(ConfigError):
            CacheConfig(components=(FULL, SlidingWindowSpec(window=bad)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="bare type"):
        CacheConfig(components=(FULL, SWA))
    # An SWA component on a plain allocator (pools brought by the user) is refused.
    pools = build_pools(CacheConfig())
    assert type(pools.token_allocator) is TokenSlotAllocator
    with pytest.raises(ConfigError):
        UnifiedRadixCache(CacheConfig(components=(FULL, SlidingWindowSpec(window=4))), pools)


def test_reset_frees_both_pools(h: SWAHarness) -> None:
    h.insert(h.seq(1, h.cap // h.ps + 2))
    h.insert(h.seq(1, 1) + h.seq(40_000, 2), swa_evicted_seqlen=h.ps)
    h.cache.reset()
    h.check()
    assert h.alloc.available_size() == h.alloc.size
    assert h.alloc.swa_available_size() == h.alloc.swa_size
    assert len(h.swa.lru) == 0
