"""Random operation sequences on ``(FULL, SWA)`` caches keep every invariant after every step.

Besides the core steps (insert, match, lock, unlock, evict, request) the sequences contain the
SWA-specific ones: SWA (tombstoning) evictions, inserts with a random ``swa_evicted_seqlen``
(with or without the request having freed those SWA slots first), early window releases, and
requests whose window slides (``free_out_of_window_slots``).  After each step:
``sanity_check()`` and conservation of both pools (Full and SWA).
"""

from __future__ import annotations

import pytest
import torch
from cache_harness import assert_path_validators_agree, start_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from urc import (
    CacheConfig,
    ComponentType,
    DecLockRefParams,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    Req,
    TreeNode,
    build_cache,
)
from urc.components.swa import SWAComponent
from urc.pools.swa import SWATokenSlotAllocator
from urc.specs import SlidingWindowSpec

FULL, SWA = ComponentType.FULL, ComponentType.SWA
BLOCKS = 4  # distinct token blocks; few, so keys share prefixes


def _key(blocks: list[int], tail: int, ps: int) -> list[int]:
    tokens = [b * 1000 + i for b in blocks for i in range(ps)]
    return tokens + [7] * tail


keys = st.builds(
    lambda blocks, tail: (blocks, tail),
    st.lists(st.integers(0, BLOCKS - 1), min_size=0, max_size=6),
    st.integers(0, 3),
)
fraction = st.integers(0, 4)  # quarters of a length
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), keys, st.booleans(), fraction, st.booleans()),
        st.tuples(st.just("match"), keys),
        st.tuples(st.just("lock"), keys),
        st.tuples(st.just("unlock"), st.integers(0, 20)),
        st.tuples(st.just("early"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(0, 40)),
        st.tuples(st.just("evict_swa"), st.integers(0, 40)),
        st.tuples(
            st.just("request"), keys, st.integers(0, 5), st.booleans(), fraction, st.booleans()
        ),
    ),
    min_size=10,
    max_size=40,
)


class Model:
    """Drives a cache; the test holds no slots between steps (so ``held`` is 0)."""

    def __init__(self, ps: int, window: int) -> None:
        self.ps = ps
        self.cache = build_cache(
            CacheConfig(
                components=(FULL, SlidingWindowSpec(window, 192 * ps)),
                page_size=ps,
                kv_size=256 * ps,
                max_num_reqs=4,
            )
        )
        alloc = self.cache.token_to_kv_pool_allocator
        assert isinstance(alloc, SWATokenSlotAllocator)
        self.alloc = alloc
        swa = self.cache.component(SWA)
        assert isinstance(swa, SWAComponent)
        self.swa = swa
        self.locks: list[tuple[TreeNode, DecLockRefParams]] = []

    def check(self) -> None:
        self.cache.sanity_check()
        assert_path_validators_agree(self.cache)
        self.cache.check_pools({FULL: 0, SWA: 0})

    def _assert_path(self, tokens: list[int]) -> None:
        """The aligned key is in the tree, with Full data all the way."""
        node = self.cache.root
        pos = 0
        aligned = len(tokens) - len(tokens) % self.ps
        while pos < aligned:
            for child in node.children.values():
                if tokens[pos : pos + child.key_len] == list(child.key):
                    node, pos = child, pos + child.key_len
                    break
            else:
                raise AssertionError(f"inserted key missing at {pos}")
            assert node.data[FULL].value is not None  # type: ignore[union-attr]

    def insert(self, tokens: list[int], with_prefix: bool, quarter: int, pre_free: bool) -> None:
        ps = self.ps
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        prefix = m.device_indices if with_prefix else m.device_indices[:0]
        n_prev = prefix.shape[0]
        own = self.alloc.alloc(len(tokens) - n_prev)
        if own is None:
            return
        value = torch.cat([prefix, own])
        s = len(tokens) * quarter // 4
        b = min(-(-s // ps) * ps, len(tokens))
        if pre_free and b > n_prev:
            self.alloc.free_swa(value[n_prev:b])  # the request's window slid past them
        r = self.cache.insert(
            InsertParams(
                key=RadixKey(tokens), value=value, prev_prefix_len=n_prev, swa_evicted_seqlen=s
            )
        )
        aligned = len(tokens) // ps * ps
        assert r.prefix_len <= aligned
        if aligned < len(tokens):
            self.alloc.free(value[aligned:])
        self._assert_path(tokens)

    def request(
        self, tokens: list[int], out_len: int, unfinished: bool, quarter: int, early: bool
    ) -> None:
        cache = self.cache
        req = start_request(cache, tokens, out_len)
        if req is None:
            return
        total = len(tokens) + out_len
        if early and req.last_node.parent is not None:
            cache.release_swa(req.lock)
            self.check_with_request(req, total)
        if unfinished:
            req.kv_committed_len = req.kv_allocated_len = len(tokens)
            self.swa.free_out_of_window_slots(req, len(tokens) * quarter // 4)
            self.check_with_request(req, total)
            cache.cache_unfinished_req(req)
            assert req.cache_protected_len == req.prefix_indices.shape[0]
            self.check_with_request(req, total)
        req.kv_committed_len = req.kv_allocated_len = total
        self.swa.free_out_of_window_slots(req, total * quarter // 4)
        self.check_with_request(req, total)
        cache.cache_finished_req(req)

    def check_with_request(self, req: Req, total: int) -> None:
        """Conservation while ``req`` holds its own slots ``[cache_protected_len, total)``."""
        assert req.req_pool_idx is not None
        ps = self.ps
        own = self.cache.req_to_token_pool.read(req.req_pool_idx, req.cache_protected_len, total)
        full = -(-own.shape[0] // ps) * ps
        self.cache.sanity_check()
        self.cache.check_pools({FULL: full, SWA: self.alloc.num_swa_mapped(own)})


CONFIGS = [(1, 4), (4, 2), (2, 8)]


@pytest.mark.parametrize(("ps", "window"), CONFIGS, ids=[f"ps{p}-w{w}" for p, w in CONFIGS])
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(program=ops)
def test_random_swa_operations_keep_invariants(ps: int, window: int, program: list[tuple]) -> None:  # type: ignore[type-arg]
    model = Model(ps, window)
    cache = model.cache
    for op in program:
        kind = op[0]
        if kind == "insert":
            model.insert(_key(*op[1], ps), op[2], op[3], op[4])
        elif kind == "match":
            tokens = _key(*op[1], ps)
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            assert m.device_indices.shape[0] % ps == 0
            assert m.device_indices.shape[0] <= len(tokens)
        elif kind == "lock":
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(_key(*op[1], ps))))
            receipt = cache.inc_lock_ref(m.last_device_node)
            model.locks.append((m.last_device_node, receipt.to_dec_params()))
        elif kind == "unlock" and model.locks:
            node, params = model.locks.pop(op[1] % len(model.locks))
            cache.dec_lock_ref(node, params)
        elif kind == "early" and model.locks:
            node, params = model.locks[op[1] % len(model.locks)]
            if not params.skip_swa and node.parent is not None:
                cache.dec_swa_lock_only(node, params)
                assert params.skip_swa
        elif kind == "evict":
            before = cache.evictable_size()
            r = cache.evict(EvictParams(num_tokens=op[1] * ps))
            assert r.num_tokens_evicted >= min(op[1] * ps, before) or cache.evictable_size() == 0
        elif kind == "evict_swa":
            before = cache.swa_evictable_size()
            r = cache.evict(EvictParams(swa_num_tokens=op[1] * ps))
            assert (
                r.swa_num_tokens_evicted >= min(op[1] * ps, before)
                or cache.swa_evictable_size() == 0
            )
        elif kind == "request":
            model.request(_key(*op[1], ps), op[2], op[3], op[4], op[5])
        model.check()
    while model.locks:
        node, params = model.locks.pop()
        cache.dec_lock_ref(node, params)
    model.check()
    assert cache.full_protected_size() == cache.swa_protected_size() == 0
    cache.evict(EvictParams(num_tokens=1 << 30))
    model.check()
    assert cache.num_nodes == 0
    assert model.alloc.available_size() == model.alloc.size
    assert model.alloc.swa_available_size() == model.alloc.swa_size
