"""HiCache with SWA and Mamba components: byte-exact round trips, tombstones, splits during
transfers, host eviction, write-back demotion, and a randomized sequence over all three
component sets.

Every step ends with ``sanity_check()`` and conservation of every component's device and host
pool; slots reserved by tickets in flight are passed as ``held`` / ``host_held``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.config import HiCacheConfig
from hicache.tier import attach_hicache
from urc import (
    CacheConfig,
    ComponentType,
    EvictParams,
    InsertParams,
    KVShape,
    MatchPrefixParams,
    RadixKey,
    UnifiedRadixCache,
    build_cache,
    tiering,
)
from urc.params import MatchResult
from urc.tiers import BackupTicket, LoadTicket, WritePolicy
from urc.tree import Tier, TreeNode

FULL = ComponentType.FULL
SWA = ComponentType.SWA
MAMBA = ComponentType.MAMBA
SETS = [(FULL, SWA), (FULL, MAMBA), (FULL, SWA, MAMBA)]
SET_IDS = ["swa", "mamba", "swa+mamba"]
WINDOW_PAGES = 4


# ---------------------------------------------------------------------- helpers
def make(
    comps: tuple[ComponentType, ...],
    ps: int,
    policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    kv_pages: int = 64,
    swa_pages: int | None = None,
    host_pages: int = 128,
    mamba_size: int = 16,
    window_pages: int = WINDOW_PAGES,
) -> UnifiedRadixCache:
    cache = build_cache(
        CacheConfig(
            components=comps,
            page_size=ps,
            kv_size=kv_pages * ps,
            swa_kv_size=None if swa_pages is None else swa_pages * ps,
            sliding_window_size=window_pages * ps if SWA in comps else None,
            mamba_size=mamba_size if MAMBA in comps else 0,
            kv_shape=KVShape(2, 2, 4, torch.float32),
        )
    )
    attach_hicache(cache, HiCacheConfig(write_policy=policy, host_tokens=host_pages * ps))
    return cache


@dataclass
class InFlight:
    """Tickets not finished yet: their reserved slots are held outside the tree."""

    loads: list[LoadTicket] = field(default_factory=list)
    backups: list[BackupTicket] = field(default_factory=list)

    def held(self) -> tuple[dict[ComponentType, int], dict[ComponentType, int]]:
        held = dict.fromkeys(ComponentType, 0)
        host = dict.fromkeys(ComponentType, 0)
        for t in self.loads:
            held[FULL] += int(t.device.shape[0])
            for _, item in t.items:
                if item.component is not FULL:  # Full items are slices of t.device
                    held[item.component] += int(item.device.shape[0])
        for b in self.backups:
            for _, item in b.items:
                host[item.component] += int(item.host.shape[0])
        return held, host


def check(cache: UnifiedRadixCache, flight: InFlight | None = None) -> None:
    cache.sanity_check()
    held, host = (flight or InFlight()).held()
    cache.check_pools(held, host)


def swa_kv(cache: UnifiedRadixCache) -> torch.Tensor:
    return cache.pools.swa.kv_pool.kv  # type: ignore[no-any-return]


def mamba_slot(cache: UnifiedRadixCache, node: TreeNode) -> int | None:
    return cache.component(MAMBA).state_slot(node)  # type: ignore[attr-defined,no-any-return]


def insert(
    cache: UnifiedRadixCache,
    tokens: list[int],
    swa_b: int = 0,
    state: bool = True,
    fill: Sequence[float] | None = None,
    flight: InFlight | None = None,
) -> bool:
    """Insert ``tokens`` with fresh slots holding known bytes (``fill[p]`` for position ``p``
    in every buffer; random when ``None``) and, with Mamba, a state for the key's end.
    Returns False when no device memory could be found."""
    n = len(tokens)
    alloc = cache.token_to_kv_pool_allocator
    value = alloc.alloc(n)
    if value is None:
        swa_n = n if cache.supports_swa() else 0
        cache.evict(EvictParams(num_tokens=n, swa_num_tokens=swa_n))
        value = alloc.alloc(n)
        if value is None:
            return False
    kv = cache.pools.kv_pool.kv  # type: ignore[union-attr]
    if fill is None:
        kv[:, :, value] = torch.randn(kv[:, :, value].shape)
    else:
        kv[:, :, value] = torch.tensor(fill[:n]).view(1, 1, n, 1, 1)
    if cache.supports_swa():
        sv = alloc.translate(value)  # type: ignore[attr-defined]
        skv = swa_kv(cache)
        if fill is None:
            skv[:, :, sv] = torch.randn(skv[:, :, sv].shape)
        else:
            skv[:, :, sv] = (torch.tensor(fill[:n]) + 0.5).view(1, 1, n, 1, 1)
    mv = None
    slot = None
    if cache.supports_mamba() and state:
        pool = cache.pools.mamba
        slot = pool.alloc_slot()
        if slot is None:
            cache.evict(EvictParams(mamba_num=1))
            slot = pool.alloc_slot()
        if slot is not None:
            if fill is None:
                pool.conv[slot] = torch.randn(pool.conv[slot].shape)
                pool.temporal[slot] = torch.randn(pool.temporal[slot].shape)
            else:
                pool.conv[slot] = fill[n - 1] + 0.25
                pool.temporal[slot] = fill[n - 1] + 0.75
            mv = torch.tensor([slot], dtype=torch.int64)
    r = cache.insert(
        InsertParams(key=RadixKey(tokens), value=value, mamba_value=mv, swa_evicted_seqlen=swa_b)
    )
    if slot is not None and r.mamba_exist:
        cache.pools.mamba.free_slots([slot])
    check(cache, flight)
    return True


def match(
    cache: UnifiedRadixCache, tokens: list[int], flight: InFlight | None = None
) -> MatchResult:
    r = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    check(cache, flight)
    return r


def path_to(node: TreeNode) -> list[TreeNode]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    out.reverse()
    return out


@dataclass
class Snapshot:
    """Device bytes of a path by key position: Full KV per token, SWA KV per token where a
    node holds SWA, Mamba state per node end."""

    full: torch.Tensor
    swa_mask: list[bool]
    swa: torch.Tensor | None
    mamba: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def assert_equal(self, other: Snapshot) -> None:
        assert torch.equal(self.full, other.full)
        assert self.swa_mask == other.swa_mask
        assert (self.swa is None) == (other.swa is None)
        if self.swa is not None and other.swa is not None:
            assert torch.equal(self.swa, other.swa)
        assert self.mamba.keys() == other.mamba.keys()
        for k, (c, t) in self.mamba.items():
            assert torch.equal(c, other.mamba[k][0]) and torch.equal(t, other.mamba[k][1])


def snapshot(cache: UnifiedRadixCache, node: TreeNode) -> Snapshot:
    kv = cache.pools.kv_pool.kv  # type: ignore[union-attr]
    nodes = path_to(node)
    values = [n.data[FULL].value for n in nodes]  # type: ignore[union-attr]
    assert all(v is not None for v in values)
    full = kv[:, :, torch.cat(values)].clone()  # type: ignore[arg-type]
    mask: list[bool] = []
    swa: list[torch.Tensor] = []
    mamba: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    pos = 0
    for n in nodes:
        pos += n.key_len
        if cache.supports_swa():
            sv = n.data[SWA].value  # type: ignore[union-attr]
            mask += [sv is not None] * n.key_len
            if sv is not None:
                swa.append(swa_kv(cache)[:, :, sv].clone())
        if cache.supports_mamba():
            slot = mamba_slot(cache, n)
            if slot is not None:
                pool = cache.pools.mamba
                mamba[pos] = (pool.conv[slot].clone(), pool.temporal[slot].clone())
    return Snapshot(full, mask, torch.cat(swa, dim=2) if swa else None, mamba)


def zero_device(cache: UnifiedRadixCache) -> None:
    """Forget every device byte: what a load-back restores must come from host."""
    cache.pools.kv_pool.kv.zero_()  # type: ignore[union-attr]
    if cache.supports_swa():
        swa_kv(cache).zero_()
    if cache.supports_mamba():
        cache.pools.mamba.conv.zero_()
        cache.pools.mamba.temporal.zero_()


def seq(start: int, pages: int, ps: int) -> list[int]:
    return list(range(start, start + pages * ps))


def leaves(cache: UnifiedRadixCache) -> list[TreeNode]:
    return [n for n in cache.iter_nodes() if not n.children]


def demote_all(cache: UnifiedRadixCache) -> None:
    """Back every leaf up (parents first) and evict every device node to host."""
    for leaf in leaves(cache):
        cache.write_backup(leaf)
        check(cache)
    cache.evict(EvictParams(num_tokens=10**6))
    check(cache)
    assert all(n.evicted and n.backuped for n in cache.iter_nodes())


def host_free_all(cache: UnifiedRadixCache) -> bool:
    return all(c.host_available() == c.host_capacity() for c in cache.components)


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
    ticket = tiering.start_backup(cache, leaf)
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
    tiering.copy_backup(cache.host_tier, ticket)  # type: ignore[arg-type]
    flight.backups.clear()
    assert tiering.finish_backup(cache, ticket) == len(tokens)
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
    ticket = tiering.start_backup(cache, leaf)
    assert ticket is not None
    flight = InFlight(backups=[ticket])
    assert cache.evict(EvictParams(mamba_num=1)).mamba_num_evicted == 1
    check(cache, flight)
    tiering.copy_backup(cache.host_tier, ticket)  # type: ignore[arg-type]
    assert tiering.finish_backup(cache, ticket) == 4
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
    ticket = tiering.start_load_back(cache, match(cache, tokens).best_match_node)
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
    tiering.copy_load_back(cache.host_tier, ticket)  # type: ignore[arg-type]
    flight.loads.clear()
    assert tiering.finish_load_back(cache, ticket) == len(tokens)
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
    ticket = tiering.start_load_back(cache, match(cache, tokens).best_match_node)
    assert ticket is not None
    flight.loads.append(ticket)
    assert insert(cache, tokens, flight=flight)  # the request recomputed it meanwhile
    fresh = snapshot(cache, match(cache, tokens, flight).last_device_node)
    tiering.copy_load_back(cache.host_tier, ticket)  # type: ignore[arg-type]
    flight.loads.clear()
    tiering.finish_load_back(cache, ticket)
    check(cache)
    # The adopted data stays; the load's slots were all freed (check_pools above).
    snapshot(cache, match(cache, tokens).last_device_node).assert_equal(fresh)


@pytest.mark.parametrize("comps", SETS, ids=SET_IDS)
def test_aborted_transfers_free_what_they_reserved(comps: tuple[ComponentType, ...]) -> None:
    cache = make(comps, 1)
    tokens = seq(0, 8, 1)
    assert insert(cache, tokens)
    leaf = match(cache, tokens).last_device_node
    b = tiering.start_backup(cache, leaf)
    assert b is not None
    check(cache, InFlight(backups=[b]))
    assert tiering.finish_backup(cache, b, ok=False) == 0
    check(cache)
    assert host_free_all(cache)
    demote_all(cache)
    t = tiering.start_load_back(cache, match(cache, tokens).best_match_node)
    assert t is not None
    check(cache, InFlight(loads=[t]))
    assert tiering.finish_load_back(cache, t, ok=False) == 0
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
def test_a_lock_taken_across_host_only_nodes_survives_their_load_back(split: bool) -> None:
    """A lock on a host-only node skips every host-only node above it (no device data to
    pin); loading them back must not make its release touch them.  SWA stamps loaded nodes
    (restore epoch), which also covers pieces split off them later."""
    cache = make((FULL, SWA), 1)
    a = seq(0, 4, 1)
    assert insert(cache, a) and insert(cache, a + seq(100, 4, 1))
    demote_all(cache)
    upper, lower = path_to(leaves(cache)[0])
    receipt = cache.inc_lock_ref(lower)
    check(cache)
    assert cache.load_back(upper) == 4
    check(cache)
    if split:
        match(cache, a[:2])
    cache.dec_lock_ref(lower, receipt.to_dec_params())
    check(cache)


# ---------------------------------------------------------------------- randomized sequence
def _expected(tokens: Sequence[int]) -> list[float]:
    """Known per-position bytes: a chained hash of the prefix (KV depends on its prefix)."""
    out = []
    h = 0
    for t in tokens:
        h = hash((h, t)) % 1_000_003
        out.append(float(h))
    return out


def _verify(cache: UnifiedRadixCache, tokens: list[int], m: MatchResult) -> None:
    """The device hit holds exactly the bytes its prefix was inserted with."""
    exp = torch.tensor(_expected(tokens))
    kv = cache.pools.kv_pool.kv  # type: ignore[union-attr]
    n = m.device_indices.shape[0]
    got = kv[:, :, m.device_indices]
    assert torch.equal(got, exp[:n].view(1, 1, n, 1, 1).expand_as(got))
    pos = 0
    for node in path_to(m.last_device_node):
        k = node.key_len
        if cache.supports_swa():
            sv = node.data[SWA].value  # type: ignore[union-attr]
            if sv is not None:
                g = swa_kv(cache)[:, :, sv]
                assert torch.equal(g, (exp[pos : pos + k] + 0.5).view(1, 1, k, 1, 1).expand_as(g))
        pos += k
        if cache.supports_mamba():
            slot = mamba_slot(cache, node)
            if slot is not None:
                pool = cache.pools.mamba
                assert bool((pool.conv[slot] == exp[pos - 1] + 0.25).all())
                assert bool((pool.temporal[slot] == exp[pos - 1] + 0.75).all())


_key = st.lists(st.integers(0, 1), min_size=1, max_size=5)
_op = st.one_of(
    st.tuples(st.just("insert"), _key, st.integers(0, 6), st.booleans()),
    st.tuples(st.just("match"), _key),
    st.tuples(st.just("backup"), _key),
    st.tuples(st.just("drain")),
    st.tuples(st.just("evict"), st.integers(1, 12), st.sampled_from(["full", "swa", "mamba"])),
    st.tuples(st.just("demote"), _key),
    st.tuples(st.just("evict_host"), st.integers(1, 12)),
    st.tuples(st.just("load"), _key),
    st.tuples(st.just("load_node"), st.integers(0, 99)),
    st.tuples(st.just("start_load"), st.integers(0, 99)),
    st.tuples(st.just("start_backup"), _key),
    st.tuples(st.just("finish"), st.integers(0, 3), st.booleans()),
)


@pytest.mark.parametrize("comps", SETS, ids=SET_IDS)
@settings(
    max_examples=40,  # per component set
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    ps=st.sampled_from([1, 4]),
    policy=st.sampled_from([WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK]),
    ops=st.lists(_op, min_size=10, max_size=40),
)
def test_random_sequences_keep_invariants(
    comps: tuple[ComponentType, ...], ps: int, policy: WritePolicy, ops: list[tuple]
) -> None:
    cache = make(
        comps, ps, policy, kv_pages=20, swa_pages=14, host_pages=28, mamba_size=5, window_pages=2
    )
    flight = InFlight()

    def tokens_of(bits: list[int]) -> list[int]:
        return [b * 1000 + j * ps + t for j, b in enumerate(bits) for t in range(ps)]

    def node_of(bits: list[int]) -> tuple[list[int], MatchResult]:
        tokens = tokens_of(bits)
        m = match(cache, tokens, flight)
        _verify(cache, tokens, m)
        return tokens, m

    for op in ops:
        kind = op[0]
        if kind == "insert":
            tokens = tokens_of(op[1])
            swa_b = min(op[2], len(op[1])) * ps
            insert(cache, tokens, swa_b, op[3], _expected(tokens), flight)
        elif kind == "match":
            node_of(op[1])
        elif kind == "backup":
            _, m = node_of(op[1])
            if m.last_device_node is not cache.root:
                cache.write_backup(m.last_device_node)
        elif kind == "demote":
            # Back the key's path up and push everything unlocked off the device.
            _, m = node_of(op[1])
            if m.last_device_node is not cache.root:
                cache.write_backup(m.last_device_node)
            cache.evict(EvictParams(num_tokens=10**6))
        elif kind == "drain":
            for node in tiering.take_pending_backups(cache, 4):
                cache.write_backup(node)
        elif kind == "evict":
            n = op[1] * ps
            cache.evict(
                EvictParams(
                    num_tokens=n if op[2] == "full" else 0,
                    swa_num_tokens=n if op[2] == "swa" and cache.supports_swa() else 0,
                    mamba_num=op[1] if op[2] == "mamba" and cache.supports_mamba() else 0,
                )
            )
        elif kind == "evict_host":
            cache.evict_host(op[1] * ps)
        elif kind == "load":
            tokens, m = node_of(op[1])
            if m.host_hit_length:
                cache.load_back(m.best_match_node)
                check(cache, flight)
                _verify(cache, tokens, match(cache, tokens, flight))
        elif kind in ("load_node", "start_load"):
            host_only = [n for n in cache.iter_nodes() if n.evicted]
            if host_only and (kind == "load_node" or len(flight.loads) < 2):
                node = host_only[op[1] % len(host_only)]
                t = tiering.start_load_back(cache, node)
                if t is not None:
                    flight.loads.append(t)
                    if kind == "load_node":
                        check(cache, flight)
                        tiering.copy_load_back(cache.host_tier, t)  # type: ignore[arg-type]
                        flight.loads.remove(t)
                        tiering.finish_load_back(cache, t)
                        check(cache, flight)
                        tokens = [tok for n in path_to(node) for tok in n.key]
                        _verify(cache, tokens, match(cache, tokens, flight))
        elif kind == "start_backup":
            _, m = node_of(op[1])
            if m.last_device_node is not cache.root and len(flight.backups) < 2:
                b = tiering.start_backup(cache, m.last_device_node)
                if b is not None:
                    flight.backups.append(b)
        elif kind == "finish":
            pending: list[LoadTicket | BackupTicket] = [*flight.loads, *flight.backups]
            if pending:
                ticket = pending[op[1] % len(pending)]
                tier = cache.host_tier
                assert tier is not None
                if isinstance(ticket, LoadTicket):
                    flight.loads.remove(ticket)
                    if op[2]:
                        tiering.copy_load_back(tier, ticket)
                    tiering.finish_load_back(cache, ticket, op[2])
                else:
                    flight.backups.remove(ticket)
                    if op[2]:
                        tiering.copy_backup(tier, ticket)
                    tiering.finish_backup(cache, ticket, op[2])
        check(cache, flight)
    for t in list(flight.loads):
        flight.loads.remove(t)
        tiering.finish_load_back(cache, t, False)
    for b in list(flight.backups):
        flight.backups.remove(b)
        tiering.finish_backup(cache, b, False)
    check(cache)
    cache.reset()
    check(cache)
    assert host_free_all(cache)
    assert all(c.pool_available() == c.pool_capacity() for c in cache.components)


@pytest.mark.parametrize("comps", [(FULL, SWA), (FULL, MAMBA), (FULL, SWA, MAMBA)])
def test_match_reports_swa_and_mamba_host_hit_lengths(comps: tuple[ComponentType, ...]) -> None:
    ps = 1
    cache = make(comps, ps)
    tokens = seq(0, 4 * WINDOW_PAGES, ps)
    assert insert(cache, tokens)
    node = match(cache, tokens).last_device_node
    assert cache.write_backup(node) == len(tokens)
    check(cache)
    cache.evict(EvictParams(num_tokens=10**6))
    check(cache)
    m = match(cache, tokens)
    assert m.host_hit_length == len(tokens) and m.device_indices.shape[0] == 0
    if SWA in comps:
        assert m.swa_host_hit_length == m.host_hit_length
    else:
        assert m.swa_host_hit_length == 0
    if MAMBA in comps:
        assert m.mamba_host_hit_length == m.host_hit_length  # the state is at the end
    else:
        assert m.mamba_host_hit_length == 0
