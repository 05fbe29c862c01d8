"""Random operation sequences on the FULL cache keep every invariant after every step.

Keys are drawn from a small alphabet of page-sized blocks so that they share prefixes, split
nodes and diverge inside pages.  After each operation: ``sanity_check()`` and
``free + evictable + protected + held == capacity``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cache_harness import POLICY_CONFIGS, start_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from urc import (
    CacheConfig,
    ComponentType,
    EvictParams,
    IncLockRefResult,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    TreeNode,
    build_cache,
)

BLOCKS = 4  # distinct token blocks; few, so keys share prefixes


def _key(blocks: list[int], tail: int, ps: int) -> list[int]:
    tokens = [b * 1000 + i for b in blocks for i in range(ps)]
    return tokens + [7] * tail


keys = st.builds(
    lambda blocks, tail: (blocks, tail),
    st.lists(st.integers(0, BLOCKS - 1), min_size=0, max_size=6),
    st.integers(0, 3),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), keys, st.booleans()),
        st.tuples(st.just("match"), keys),
        st.tuples(st.just("lock"), keys),
        st.tuples(st.just("unlock"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(0, 40)),
        st.tuples(st.just("request"), keys, st.integers(0, 5), st.booleans()),
    ),
    max_size=40,
)


class Model:
    """Drives a cache and tracks what the test itself holds."""

    def __init__(self, ps: int, **config: Any) -> None:
        self.ps = ps
        self.cache = build_cache(
            CacheConfig(page_size=ps, kv_size=256 * ps, max_num_reqs=4, **config)
        )
        self.alloc = self.cache.token_to_kv_pool_allocator
        self.locks: list[tuple[TreeNode, IncLockRefResult]] = []

    def check(self) -> None:
        self.cache.sanity_check()
        self.cache.check_pools({ComponentType.FULL: 0})

    def insert(self, tokens: list[int], with_prefix: bool) -> None:
        ps = self.ps
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        prefix = m.device_indices if with_prefix else m.device_indices[:0]
        own = self.alloc.alloc(len(tokens) - prefix.shape[0])
        if own is None:
            return
        value = torch.cat([prefix, own])
        r = self.cache.insert(
            InsertParams(key=RadixKey(tokens), value=value, prev_prefix_len=prefix.shape[0])
        )
        aligned = len(tokens) // ps * ps
        assert r.prefix_len <= aligned
        if aligned < len(tokens):
            self.alloc.free(value[aligned:])
        assert (
            self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_indices.shape[0]
            == aligned
        )

    def request(self, tokens: list[int], out_len: int, unfinished_first: bool) -> None:
        cache = self.cache
        req = start_request(cache, tokens, out_len)
        if req is None:
            return
        total = len(tokens) + out_len
        if unfinished_first:
            req.kv_committed_len = req.kv_allocated_len = len(tokens)
            cache.cache_unfinished_req(req)
            self.cache.sanity_check()
            assert req.cache_protected_len == req.prefix_indices.shape[0]
        req.kv_committed_len = req.kv_allocated_len = total
        cache.cache_finished_req(req)


@pytest.mark.parametrize("ps", [1, 4])
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(program=ops)
def test_random_operations_keep_invariants(ps: int, program: list[tuple]) -> None:  # type: ignore[type-arg]
    _run(Model(ps), program)


@pytest.mark.parametrize("config", POLICY_CONFIGS)
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=ops)
def test_every_eviction_policy_keeps_invariants(
    config: dict[str, Any], program: list[tuple]
) -> None:  # type: ignore[type-arg]
    _run(Model(4, **config), program)


def _run(model: Model, program: list[tuple]) -> None:  # type: ignore[type-arg]
    ps = model.ps
    cache = model.cache
    for op in program:
        kind = op[0]
        if kind == "insert":
            model.insert(_key(*op[1], ps), op[2])
        elif kind == "match":
            tokens = _key(*op[1], ps)
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            assert m.device_indices.shape[0] % ps == 0
            assert m.device_indices.shape[0] <= len(tokens)
        elif kind == "lock":
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(_key(*op[1], ps))))
            model.locks.append((m.last_device_node, cache.inc_lock_ref(m.last_device_node)))
        elif kind == "unlock" and model.locks:
            node, receipt = model.locks.pop(op[1] % len(model.locks))
            cache.dec_lock_ref(node, receipt.to_dec_params())
        elif kind == "evict":
            before = cache.evictable_size()
            r = cache.evict(EvictParams(num_tokens=op[1] * ps))
            assert r.num_tokens_evicted >= min(op[1] * ps, before) or cache.evictable_size() == 0
            if cache.config.partial_leaf_eviction:  # never more than the request, in pages
                assert r.num_tokens_evicted <= op[1] * ps, (r, op)
        elif kind == "request":
            model.request(_key(*op[1], ps), op[2], op[3])
        model.check()
    while model.locks:
        node, receipt = model.locks.pop()
        cache.dec_lock_ref(node, receipt.to_dec_params())
    cache.evict(EvictParams(num_tokens=1 << 30))
    model.check()
    assert cache.num_nodes == 0
    assert model.alloc.available_size() == model.alloc.size
