"""HiCache with SWA and Mamba: random sequences of backup / evict / host eviction / match /
load-back / insert keep every invariant and the bytes of every match."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from hicache_harness import (
    FULL,
    MAMBA,
    SET_IDS,
    SETS,
    SWA,
    WINDOW_PAGES,
    InFlight,
    check,
    host_free_all,
    insert,
    make,
    mamba_slot,
    match,
    path_to,
    seq,
    swa_kv,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from urc import (
    ComponentType,
    EvictionPolicy,
    EvictParams,
    UnifiedRadixCache,
)
from urc.host import transfers as host_transfers
from urc.host_protocol import BackupTicket, LoadTicket, WritePolicy
from urc.params import MatchResult


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
    eviction=st.sampled_from([p for p in EvictionPolicy if p is not EvictionPolicy.BELADY]),
    partial=st.booleans(),
    ops=st.lists(_op, min_size=10, max_size=40),
)
def test_random_sequences_keep_invariants(
    comps: tuple[ComponentType, ...],
    ps: int,
    policy: WritePolicy,
    eviction: EvictionPolicy,
    partial: bool,
    ops: list[tuple],
) -> None:
    cache = make(
        comps,
        ps,
        policy,
        kv_pages=20,
        swa_pages=14,
        host_pages=28,
        mamba_size=5,
        window_pages=2,
        eviction_policy=eviction,  # device and host eviction order
        partial_leaf_eviction=partial,
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
            for node in host_transfers.take_pending_backups(cache, 4):
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
                t = host_transfers.start_load_back(cache, node)
                if t is not None:
                    flight.loads.append(t)
                    if kind == "load_node":
                        check(cache, flight)
                        host_transfers.copy_load_back(cache.host_tier, t)  # type: ignore[arg-type]
                        flight.loads.remove(t)
                        host_transfers.finish_load_back(cache, t)
                        check(cache, flight)
                        tokens = [tok for n in path_to(node) for tok in n.key]
                        _verify(cache, tokens, match(cache, tokens, flight))
        elif kind == "start_backup":
            _, m = node_of(op[1])
            if m.last_device_node is not cache.root and len(flight.backups) < 2:
                b = host_transfers.start_backup(cache, m.last_device_node)
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
                        host_transfers.copy_load_back(tier, ticket)
                    host_transfers.finish_load_back(cache, ticket, op[2])
                else:
                    flight.backups.remove(ticket)
                    if op[2]:
                        host_transfers.copy_backup(tier, ticket)
                    host_transfers.finish_backup(cache, ticket, op[2])
        check(cache, flight)
    for t in list(flight.loads):
        flight.loads.remove(t)
        host_transfers.finish_load_back(cache, t, False)
    for b in list(flight.backups):
        flight.backups.remove(b)
        host_transfers.finish_backup(cache, b, False)
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
