"""Matching (``urc.matching``): a match without device indices (``with_indices=False``,
SGLang 0.5.23's match) and ``path_device_indices``.

A match that skips the indices must leave the cache exactly as one that builds them: the
same splits, stamps, LRUs, locks and counters, and the same hit, whose indices
``path_device_indices`` of its last device node then gives.  Checked step by step on random
operation sequences for every component set and page sizes 1 and 4, plus the edge cases.
"""

from __future__ import annotations

from typing import Any

import mamba_harness as mamba
import pytest
import torch
from cache_harness import Harness, seq
from hicache_harness import demote_all, make
from hicache_harness import insert as host_insert
from hypothesis import given
from lockstep_harness import LOCKSTEP_SETTINGS, SETS, Lockstep, Side
from test_cache_properties import ops

from urc import ComponentType, EvictParams, MatchPrefixParams, MatchResult, RadixKey, Req
from urc.errors import InvalidInputError
from urc.fastpath import WalkImpl

FULL, MAMBA = ComponentType.FULL, ComponentType.MAMBA


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("components", SETS, ids=lambda s: "+".join(c.name for c in s))
@LOCKSTEP_SETTINGS
@given(ops=ops)
def test_a_match_without_indices_changes_the_cache_as_one_with_them(
    ps: int, components: tuple[ComponentType, ...], ops: list[tuple[Any, ...]]
) -> None:
    m = Lockstep(components, ps, (Side(WalkImpl.AUTO), Side(WalkImpl.AUTO, with_indices=False)))
    for op in ops:
        m.run(op)
    for c in m.caches:
        c.sanity_check()


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_a_match_without_indices_reports_the_hit_length_and_no_tensor(ps: int) -> None:
    h = Harness(page_size=ps)
    a = seq(0, 3, ps)
    h.insert(a)
    key = a + seq(500, 1, ps)
    lazy = h.cache.match_prefix(MatchPrefixParams(key=RadixKey(key), with_indices=False))
    h.check()
    assert lazy.device_indices is None
    assert lazy.device_prefix_len == lazy.device_len == len(a)
    with pytest.raises(InvalidInputError, match="with_indices=False"):
        _ = lazy.indices
    eager = h.match(key)
    assert eager.last_device_node is lazy.last_device_node
    assert torch.equal(h.cache.path_device_indices(lazy.last_device_node), eager.indices)
    miss = h.cache.match_prefix(
        MatchPrefixParams(key=RadixKey(seq(900, 1, ps)), with_indices=False)
    )
    assert miss.device_indices is None and miss.device_prefix_len == 0
    assert miss.last_device_node is h.cache.root


def test_hits_count_the_same_with_and_without_indices() -> None:
    h = Harness(page_size=1)
    h.insert([1, 2, 3, 4])
    counters = h.cache.counters

    def added(with_indices: bool) -> tuple[int, ...]:
        before = (counters.match_requests, counters.query_tokens, *counters.hit_tokens.values())
        params = MatchPrefixParams(key=RadixKey([1, 2, 3, 9]), with_indices=with_indices)
        h.cache.match_prefix(params)
        after = (counters.match_requests, counters.query_tokens, *counters.hit_tokens.values())
        return tuple(b - a for a, b in zip(before, after, strict=True))

    assert added(True) == added(False) == (1, 4, 3, 0, 0)


def test_path_device_indices_of_the_root_is_empty_and_of_an_evicted_node_an_error() -> None:
    h = Harness(page_size=1)
    h.insert([1, 2, 3])
    root = h.cache.root
    assert h.cache.path_device_indices(root).shape == (0,)
    node = h.match([1, 2, 3]).last_device_node
    h.cache.evict(EvictParams(num_tokens=3))
    h.check()
    with pytest.raises(InvalidInputError, match="evicted"):
        h.cache.path_device_indices(node)


@pytest.mark.parametrize("components", [(FULL, MAMBA), (FULL,)], ids=["mamba", "full"])
def test_a_match_without_indices_reports_a_host_hit_as_one_with_them(
    components: tuple[ComponentType, ...],
) -> None:
    cache = make(components, 4)
    tokens = seq(0, 3, 4)
    assert host_insert(cache, tokens)
    demote_all(cache)  # every node host-only: the device hit is empty, the host hit whole
    eager = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    lazy = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens), with_indices=False))
    assert lazy.device_indices is None and eager.indices.shape == (0,)
    assert lazy.device_prefix_len == eager.device_prefix_len == 0
    assert lazy._replace(device_indices=None, device_len=None) == eager._replace(
        device_indices=None, device_len=None
    )
    assert lazy.host_hit_length == len(tokens)
    with pytest.raises(InvalidInputError, match="not on device"):
        cache.path_device_indices(lazy.best_match_node)


def test_copy_on_write_without_indices_copies_the_state_and_degrades_the_same() -> None:
    cache = mamba.make(1, mamba_size=2)
    seq = [1, 2, 3]
    mamba.insert_state(cache, seq)
    req = Req("a", seq)
    r = cache.match_prefix(
        MatchPrefixParams(RadixKey(seq), cow_mamba=True, req=req, with_indices=False)
    )
    assert r.device_indices is None and r.device_prefix_len == 3
    assert req.mamba_pool_idx is not None and mamba.state_is(cache, req.mamba_pool_idx, seq)
    mamba.check(cache, (req,))
    # No slot left for a second request: the match degrades to a miss, still without a tensor.
    other = Req("b", seq)
    r = cache.match_prefix(
        MatchPrefixParams(RadixKey(seq), cow_mamba=True, req=other, with_indices=False)
    )
    assert r.device_indices is None and r.device_prefix_len == 0
    assert r.last_device_node is cache.root and other.mamba_pool_idx is None
    mamba.check(cache, (req,))


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("components", SETS, ids=lambda s: "+".join(c.name for c in s))
@LOCKSTEP_SETTINGS
@given(ops=ops)
def test_indices_read_long_after_the_match_are_those_of_the_match(
    ps: int, components: tuple[ComponentType, ...], ops: list[tuple[Any, ...]]
) -> None:
    # Before every keyed operation both caches match its key (so they stay in lockstep);
    # cache 0's result is kept unread with the path's indices as they stood.  Read at the
    # end, after the splits, evictions and recoveries of the whole sequence, each result
    # gives what the match would have built eagerly.
    m = Lockstep(components, ps, (Side(WalkImpl.AUTO), Side(WalkImpl.AUTO)))
    kept: list[tuple[MatchResult, list[int]]] = []
    for op in ops:
        if op[0] in ("insert", "match", "lock", "request"):
            tokens = m.key(*op[1])
            results = m.each(
                lambda i, c, t=tokens: c.match_prefix(MatchPrefixParams(key=RadixKey(list(t))))
            )
            r = results[0]
            kept.append((r, m.caches[0].path_device_indices(r.last_device_node).tolist()))
        m.run(op)
    for r, expected in kept:
        assert r.indices.tolist() == expected
        assert r.device_prefix_len == len(expected)


@pytest.mark.parametrize("ps", [1, 16])
def test_a_match_result_reads_its_indices_through_every_tuple_protocol(ps: int) -> None:
    h = Harness(page_size=ps)
    a = seq(0, 3, ps)
    h.insert(a)
    r = h.cache.match_prefix(MatchPrefixParams(key=RadixKey(a)))
    expected = h.cache.path_device_indices(r.last_device_node).tolist()
    # A split on the path and the eviction of the whole tree: the result keeps its hit.
    h.match(a[:ps])
    h.cache.evict(EvictParams(num_tokens=len(a)))
    h.check()
    assert h.cache.num_nodes == 0
    first = r.device_indices
    assert first is not None and first.tolist() == expected
    assert r.device_indices is first and r[0] is first and r[-len(r)] is first
    indices, *_ = r
    assert indices is first and next(iter(r)) is first
    assert r._asdict()["device_indices"] is first and r[:1][0] is first
    again = r._replace(host_hit_length=0)
    assert again.device_indices is first and again == r
    assert "device_indices=tensor(" in repr(r)
    with pytest.raises(TypeError, match="no fields"):
        r._replace(device_index=first)


def test_a_pending_result_replaced_before_its_first_read_shares_one_tensor() -> None:
    h = Harness()
    h.insert(seq(0, 4, 1))
    r = h.cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(0, 4, 1))))
    copy = r._replace(mamba_branching_seqlen=3)
    assert copy.device_indices is r.device_indices  # built once, on the first read
    assert copy.mamba_branching_seqlen == 3 and r.mamba_branching_seqlen is None


def test_a_miss_reads_a_fresh_empty_tensor_each_match() -> None:
    h = Harness()
    a = h.cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2])))
    b = h.cache.match_prefix(MatchPrefixParams(key=RadixKey([3])))
    assert a.indices.shape == (0,) and a.indices.dtype == torch.int64
    assert a.indices is not b.indices  # never one tensor shared between callers
    assert a.last_device_node is h.cache.root
