"""HiCache with SWA and Mamba components: byte-exact round trips, tombstones, splits during
transfers, host eviction, write-back demotion, and a randomized sequence over all three
component sets.

Every step ends with ``sanity_check()`` and conservation of every component's device and host
pool; slots reserved by tickets in flight are passed as ``held`` / ``host_held``.
"""

from __future__ import annotations

import pytest
from hicache_harness import (
    FULL,
    MAMBA,
    SET_IDS,
    SETS,
    SWA,
    InFlight,
    check,
    demote_all,
    host_free_all,
    insert,
    leaves,
    make,
    mamba_slot,
    match,
    path_to,
    seq,
    snapshot,
    zero_device,
)

from urc import (
    ComponentType,
    EvictParams,
    InvalidLockError,
)
from urc.host import transfers as host_transfers
from urc.host_protocol import WritePolicy
from urc.node import Tier


# ---------------------------------------------------------------------- round trip
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("comps", SETS, ids=SET_IDS)
def test_round_trip_is_byte_exact(comps: tuple[ComponentType, ...], ps: int) -> None:
    cache = make(comps, ps)
    a = seq(0, 8, ps)
    b = a[: 4 * ps] + seq(1000, 4, ps)
    assert insert(cache, a) and insert(cache, b)
    before = {}
    for tokens in (a, b):
        m = match(cache, tokens)
        assert m.device_indices.shape[0] == len(tokens)
        before[tuple(tokens)] = snapshot(cache, m.last_device_node)
    if MAMBA in comps:
        assert all(s.mamba for s in before.values())
    if SWA in comps:
        assert all(any(s.swa_mask) for s in before.values())
    demote_all(cache)
    zero_device(cache)
    for tokens in (a, b):
        m = match(cache, tokens)
        # The host hit extends the device hit to the whole key (for b, the shared part is
        # on device since a's load; without Mamba state there it is no device hit).
        assert m.device_indices.shape[0] + m.host_hit_length == len(tokens)
        host_only = sum(n.key_len for n in path_to(m.best_match_node) if n.evicted)
        assert host_only == (len(tokens) if tokens is a else 4 * ps)
        assert cache.load_back(m.best_match_node) == host_only
        check(cache)
        m = match(cache, tokens)
        assert m.device_indices.shape[0] == len(tokens) and m.host_hit_length == 0
        snapshot(cache, m.last_device_node).assert_equal(before[tuple(tokens)])
    # The host copies stay: a second demotion needs no new backup.
    backed = cache.stats().backed_up_tokens
    cache.evict(EvictParams(num_tokens=10**6))
    check(cache)
    assert cache.stats().backed_up_tokens == backed
    assert all(n.evicted for n in cache.iter_nodes())


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("comps", [SETS[0], SETS[2]], ids=["swa", "swa+mamba"])
def test_swa_tombstones_stay_tombstones_and_leak_nothing(
    comps: tuple[ComponentType, ...], ps: int
) -> None:
    cache = make(comps, ps)
    tokens = seq(0, 8, ps)
    assert insert(cache, tokens, swa_b=2 * ps)  # [0, 2 pages) is an SWA tombstone
    nodes = path_to(match(cache, tokens).last_device_node)
    assert [n.data[SWA].value is None for n in nodes] == [True, False, False]  # type: ignore[union-attr]
    swa = cache.component(SWA)
    used = swa.pool_capacity() - swa.pool_available()
    assert used == 6 * ps
    before = snapshot(cache, nodes[-1])
    demote_all(cache)
    assert nodes[0].data[SWA].host_value is None  # type: ignore[union-attr]
    assert nodes[1].data[SWA].host_value is not None  # type: ignore[union-attr]
    assert swa.pool_available() == swa.pool_capacity()
    zero_device(cache)
    m = match(cache, tokens)
    assert m.host_hit_length == len(tokens) and m.best_match_node is nodes[-1]
    assert cache.load_back(m.best_match_node) == len(tokens)
    check(cache)
    assert nodes[0].data[SWA].value is None  # type: ignore[union-attr]
    assert swa.pool_capacity() - swa.pool_available() == used  # no SWA page leaked
    snapshot(cache, nodes[-1]).assert_equal(before)


@pytest.mark.parametrize("comps", [SETS[0], SETS[2]], ids=["swa", "swa+mamba"])
def test_host_pass_needs_a_full_window_of_swa(comps: tuple[ComponentType, ...]) -> None:
    cache = make(comps, 1)
    tokens = seq(0, 8, 1)
    assert insert(cache, tokens, swa_b=6)  # only the last 2 tokens keep SWA: < one window
    assert match(cache, tokens).device_indices.shape[0] == 0  # no valid device boundary
    (leaf,) = leaves(cache)
    demote_all(cache)
    m = match(cache, tokens)
    assert m.host_hit_length == 0 and m.best_match_node is cache.root
    assert cache.load_back(leaf) == 8  # an explicit load still restores the structure
    check(cache)


def test_load_back_evicts_swa_when_only_the_swa_pool_is_short() -> None:
    cache = make((FULL, SWA), 1, swa_pages=12)
    a = seq(0, 8, 1)
    assert insert(cache, a)
    before = snapshot(cache, match(cache, a).last_device_node)
    demote_all(cache)
    assert insert(cache, seq(500, 8, 1))  # 8 of 12 SWA slots in use, Full mostly free
    swa = cache.component(SWA)
    assert swa.pool_available() == 4
    m = match(cache, a)
    assert cache.load_back(m.best_match_node) == 8
    check(cache)
    assert match(cache, seq(500, 8, 1)).device_indices.shape[0] > 0  # Full kept, SWA evicted
    snapshot(cache, match(cache, a).last_device_node).assert_equal(before)


def test_mamba_load_back_without_a_free_slot_gives_a_tombstone() -> None:
    cache = make((FULL, MAMBA), 1, mamba_size=2)
    a, b = seq(0, 4, 1), seq(100, 4, 1)
    assert insert(cache, a)
    demote_all(cache)
    assert insert(cache, b)
    # Hold the last free slot and pin b's state: no slot can be had for a's.
    pool = cache.pools.mamba
    last = match(cache, b).last_device_node
    node_a = match(cache, a).best_match_node
    held = pool.alloc_slot()
    assert held is not None and pool.available_size() == 0
    receipt = cache.inc_lock_ref(last)
    assert cache.load_back(node_a) == 4
    cache.sanity_check()
    cache.check_pools({MAMBA: 1})
    assert not node_a.evicted and mamba_slot(cache, node_a) is None
    assert node_a.data[MAMBA].host_value is not None  # type: ignore[union-attr]
    cache.dec_lock_ref(last, receipt.to_dec_params())
    pool.free_slots([held])
    check(cache)


# ---------------------------------------------------------------------- transfers in flight
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("comps", SETS, ids=SET_IDS)
def test_split_and_device_eviction_during_a_backup(
    comps: tuple[ComponentType, ...], ps: int
) -> None:
    cache = make(comps, ps)
    tokens = seq(0, 12, ps)
    assert insert(cache, tokens)
    leaf = match(cache, tokens).last_device_node
    flight = InFlight()
    ticket = host_transfers.start_backup(cache, leaf)
    assert ticket is not None
    flight.backups.append(ticket)
    check(cache, flight)
    match(cache, tokens[: 2 * ps], flight)  # splits the chain's top node
    match(cache, tokens[: 10 * ps], flight)  # and the bottom one
    # Only what the chain's lock pins is safe: Full everywhere, SWA one window, the leaf's
    # state.  Everything else may go and must then get no host copy.
    r = cache.evict(EvictParams(num_tokens=10**6, swa_num_tokens=10**6, mamba_num=10**6))
    assert r.num_tokens_evicted == 0
    check(cache, flight)
    host_transfers.copy_backup(cache.host_tier, ticket)  # type: ignore[arg-type]
    flight.backups.clear()
    assert host_transfers.finish_backup(cache, ticket) == len(tokens)
    check(cache)
    nodes = path_to(leaf)
    assert len(nodes) >= 3 and all(n.backuped for n in nodes)
    for n in nodes:
        for ct in comps[1:]:
            cd = n.data[ct]
            assert cd is not None
            # A host copy only where the device data survived.
            assert (cd.host_value is not None) == (cd.value is not None)
    if MAMBA in comps:
        assert nodes[-1].data[MAMBA].host_value is not None  # type: ignore[union-attr]
        assert all(n.data[MAMBA].host_value is None for n in nodes[:-1])  # type: ignore[union-attr]


def test_a_state_evicted_during_its_backup_gets_no_host_copy() -> None:
    """Where SWA is a tombstone a lock skips the Mamba state (lock order), so a backup
    cannot pin it: evicted meanwhile, its host slot is freed at commit."""
    cache = make((FULL, SWA, MAMBA), 1)
    tokens = seq(0, 4, 1)
    assert insert(cache, tokens, swa_b=4)  # SWA tombstone leaf with a Mamba state
    (leaf,) = leaves(cache)
    assert mamba_slot(cache, leaf) is not None
    ticket = host_transfers.start_backup(cache, leaf)
    assert ticket is not None
    flight = InFlight(backups=[ticket])
    assert cache.evict(EvictParams(mamba_num=1)).mamba_num_evicted == 1
    check(cache, flight)
    host_transfers.copy_backup(cache.host_tier, ticket)  # type: ignore[arg-type]
    assert host_transfers.finish_backup(cache, ticket) == 4
    check(cache)
    assert leaf.backuped and leaf.data[MAMBA].host_value is None  # type: ignore[union-attr]
    mamba = cache.component(MAMBA)
    assert mamba.host_available() == mamba.host_capacity()


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("comps", SETS, ids=SET_IDS)
def test_split_during_a_load_back(comps: tuple[ComponentType, ...], ps: int) -> None:
    cache = make(comps, ps)
    tokens = seq(0, 8, ps)
    assert insert(cache, tokens)
    before = snapshot(cache, match(cache, tokens).last_device_node)
    demote_all(cache)
    zero_device(cache)
    flight = InFlight()
    ticket = host_transfers.start_load_back(cache, match(cache, tokens).best_match_node)
    assert ticket is not None
    flight.loads.append(ticket)
    check(cache, flight)
    held, _ = flight.held()
    assert held[FULL] == len(tokens)
    if SWA in comps:
        assert held[SWA] == len(tokens)
    if MAMBA in comps:
        assert held[MAMBA] == 1
    # Splits of host-only nodes being loaded (top and bottom).
    assert match(cache, tokens[:ps], flight).host_hit_length in (0, ps)
    match(cache, tokens[: 6 * ps], flight)
    assert cache.evict_host(10**6) == 0  # pinned by the load
    cache.evict(EvictParams(num_tokens=10**6, swa_num_tokens=10**6, mamba_num=10**6))
    check(cache, flight)
    host_transfers.copy_load_back(cache.host_tier, ticket)  # type: ignore[arg-type]
    flight.loads.clear()
    assert host_transfers.finish_load_back(cache, ticket) == len(tokens)
    check(cache)
    m = match(cache, tokens)
    assert m.device_indices.shape[0] == len(tokens)
    snapshot(cache, m.last_device_node).assert_equal(before)


@pytest.mark.parametrize("comps", SETS, ids=SET_IDS)
def test_insert_adopting_a_node_during_its_load_back(comps: tuple[ComponentType, ...]) -> None:
    cache = make(comps, 1)
    tokens = seq(0, 8, 1)
    assert insert(cache, tokens)
    demote_all(cache)
    flight = InFlight()
    ticket = host_transfers.start_load_back(cache, match(cache, tokens).best_match_node)
    assert ticket is not None
    flight.loads.append(ticket)
    assert insert(cache, tokens, flight=flight)  # the request recomputed it meanwhile
    fresh = snapshot(cache, match(cache, tokens, flight).last_device_node)
    host_transfers.copy_load_back(cache.host_tier, ticket)  # type: ignore[arg-type]
    flight.loads.clear()
    host_transfers.finish_load_back(cache, ticket)
    check(cache)
    # The adopted data stays; the load's slots were all freed (check_pools above).
    snapshot(cache, match(cache, tokens).last_device_node).assert_equal(fresh)


@pytest.mark.parametrize("comps", SETS, ids=SET_IDS)
def test_aborted_transfers_free_what_they_reserved(comps: tuple[ComponentType, ...]) -> None:
    cache = make(comps, 1)
    tokens = seq(0, 8, 1)
    assert insert(cache, tokens)
    leaf = match(cache, tokens).last_device_node
    b = host_transfers.start_backup(cache, leaf)
    assert b is not None
    check(cache, InFlight(backups=[b]))
    assert host_transfers.finish_backup(cache, b, ok=False) == 0
    check(cache)
    assert host_free_all(cache)
    demote_all(cache)
    t = host_transfers.start_load_back(cache, match(cache, tokens).best_match_node)
    assert t is not None
    check(cache, InFlight(loads=[t]))
    assert host_transfers.finish_load_back(cache, t, ok=False) == 0
    check(cache)
    assert all(n.evicted for n in cache.iter_nodes())
    assert all(c.pool_available() == c.pool_capacity() for c in cache.components)


# ---------------------------------------------------------------------- host eviction
@pytest.mark.parametrize("comps", SETS, ids=SET_IDS)
def test_host_eviction_frees_swa_and_mamba_host_copies(comps: tuple[ComponentType, ...]) -> None:
    cache = make(comps, 1)
    keys = [seq(s, 6, 1) for s in (0, 100, 200)]
    for k in keys:
        assert insert(cache, k)
    demote_all(cache)
    stats = cache.stats()
    for ct in comps:
        c = cache.component(ct)
        host = stats.component(ct, Tier.HOST)
        assert host is not None and host.evictable == c.host_evictable_size > 0
        assert host.capacity == c.host_capacity() and host.unit == c.unit
    if MAMBA in comps:
        assert cache.component(MAMBA).host_evictable_size == 3  # one state per key
    match(cache, keys[0])  # refresh the first
    assert cache.evict_host(6) == 6
    check(cache)
    assert match(cache, keys[1]).host_hit_length == 0
    assert match(cache, keys[0]).host_hit_length == 6
    assert cache.evict_host(10**6) == 12
    check(cache)
    assert cache.num_nodes == 0 and host_free_all(cache)


@pytest.mark.parametrize("comps", SETS, ids=SET_IDS)
def test_reset_frees_host_copies(comps: tuple[ComponentType, ...]) -> None:
    cache = make(comps, 1)
    assert insert(cache, seq(0, 6, 1)) and insert(cache, seq(100, 6, 1))
    demote_all(cache)
    assert insert(cache, seq(100, 6, 1))
    cache.reset()
    check(cache)
    assert cache.num_nodes == 0 and host_free_all(cache)


# ---------------------------------------------------------------------- write-back
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("comps", SETS, ids=SET_IDS)
def test_write_back_demotes_with_swa_and_mamba(comps: tuple[ComponentType, ...], ps: int) -> None:
    cache = make(comps, ps, WritePolicy.WRITE_BACK)
    a = seq(0, 8, ps)
    assert insert(cache, a)
    m = match(cache, a)
    before = snapshot(cache, m.last_device_node)
    assert not any(n.backuped for n in cache.iter_nodes())
    # Evict through the auxiliary component's own eviction too: a leaf goes whole.
    params = EvictParams(
        num_tokens=10**6,
        swa_num_tokens=10**6 if SWA in comps else 0,
        mamba_num=10**6 if MAMBA in comps else 0,
    )
    cache.evict(params)
    check(cache)
    nodes = cache.iter_nodes()
    assert nodes and all(n.evicted and n.backuped for n in nodes)
    zero_device(cache)
    m = match(cache, a)
    assert m.host_hit_length == len(a)
    assert cache.load_back(m.best_match_node) == len(a)
    check(cache)
    snapshot(cache, match(cache, a).last_device_node).assert_equal(before)


@pytest.mark.parametrize("comps", [SETS[0], SETS[2]], ids=["swa", "swa+mamba"])
def test_write_back_swa_eviction_of_a_leaf_demotes_it(comps: tuple[ComponentType, ...]) -> None:
    cache = make(comps, 1, WritePolicy.WRITE_BACK)
    assert insert(cache, seq(0, 4, 1))
    cache.evict(EvictParams(swa_num_tokens=1))
    check(cache)
    (node,) = cache.iter_nodes()
    assert node.evicted and node.backuped and node.data[SWA].host_value is not None  # type: ignore[union-attr]


# ---------------------------------------------------------------------- SWA recovery
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("case", ["all", "split", "none"])
def test_insert_over_a_host_only_node_recovers_swa(case: str, ps: int) -> None:
    cache = make((FULL, SWA), ps)
    tokens = seq(0, 4, ps)
    assert insert(cache, tokens)
    demote_all(cache)
    (node,) = cache.iter_nodes()
    swa_b = {"all": 0, "split": 2 * ps, "none": 4 * ps}[case]
    assert insert(cache, tokens, swa_b=swa_b)
    nodes = path_to(node)
    assert all(not n.evicted for n in nodes)
    has = [n.data[SWA].value is not None for n in nodes]  # type: ignore[union-attr]
    assert has == {"all": [True], "split": [False, True], "none": [False]}[case]
    # The host copies were split with the node and stay usable.
    assert all(n.backuped and n.data[SWA].host_value is not None for n in nodes)  # type: ignore[union-attr]
    swa = cache.component(SWA)
    assert swa.pool_capacity() - swa.pool_available() == sum(
        n.key_len for n, h in zip(nodes, has, strict=True) if h
    )
    cache.evict(EvictParams(num_tokens=10**6))
    check(cache)
    m = match(cache, tokens)
    assert cache.load_back(m.best_match_node) == 4 * ps
    check(cache)
    assert all(n.data[SWA].value is not None for n in path_to(m.best_match_node))  # type: ignore[union-attr]


@pytest.mark.parametrize("split", [False, True])
def test_a_lock_on_a_host_only_node_is_refused_until_it_is_loaded_back(split: bool) -> None:
    """The core refuses ``inc_lock_ref`` on a host-only node (issue 33, defect 6: the lock
    would protect fewer tokens than its depth, and host eviction may delete the node under
    it); once loaded back (and split), the same node locks and releases normally."""
    cache = make((FULL, SWA), 1)
    a = seq(0, 4, 1)
    assert insert(cache, a) and insert(cache, a + seq(100, 4, 1))
    demote_all(cache)
    _upper, lower = path_to(leaves(cache)[0])
    with pytest.raises(InvalidLockError, match="not on device"):
        cache.inc_lock_ref(lower)
    check(cache)
    assert cache.load_back(lower) == 8
    check(cache)
    if split:
        match(cache, a[:2])
    receipt = cache.inc_lock_ref(lower)
    check(cache)
    cache.dec_lock_ref(lower, receipt.to_dec_params())
    check(cache)
