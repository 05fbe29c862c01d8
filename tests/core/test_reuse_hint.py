"""Reuse hints (``urc.reuse_hint``) and the session-aware eviction order.

Hints reach the policy through ``insert``, ``cache_finished_req`` and the service; policies
that do not use them evict exactly as without them; the session-aware policy is LRU without
hints and keeps a tool-call session over an answered one; every policy keeps the cache's
invariants under random operations with hints (``sanity_check`` and pool conservation after
every step).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from cache_harness import POLICY_CONFIGS, start_request
from hint_harness import PS, hint_cache, insert, session, survivors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from urc import (
    CacheConfig,
    ComponentType,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    build_cache,
)
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError, InvalidInputError
from urc.eviction_policy import EvictionPolicy
from urc.reuse_hint import ReuseHint, StopReason
from urc.service import AsyncUnifiedRadixCache
from urc.session_eviction import SessionAwareStrategy


def _cache(policy: EvictionPolicy = EvictionPolicy.SESSION_AWARE, **kw: Any) -> UnifiedRadixCache:
    return hint_cache(policy, **kw)


def test_tool_call_session_outlives_an_answered_one_finished_later() -> None:
    # Session 1 called a tool at t=100 (back in seconds); session 2 answered at t=110 (a
    # person types next).  Evicting one session's worth keeps session 1; LRU keeps 2.
    for policy, kept in ((EvictionPolicy.SESSION_AWARE, [1]), (EvictionPolicy.LRU, [2])):
        cache = _cache(policy)
        insert(cache, session(1), ReuseHint("s1", StopReason.TOOL_USE, finished_at_s=100.0))
        insert(cache, session(2), ReuseHint("s2", StopReason.END_TURN, finished_at_s=110.0))
        cache.evict(EvictParams(num_tokens=2 * PS))
        cache.sanity_check()
        assert survivors(cache, [1, 2]) == kept, policy


def test_within_one_quantum_the_older_session_goes_first() -> None:
    # Sessions 1 (seen first) and 2 both called a tool within the same 20 s quantum: the
    # older session goes first, whatever their recency (LRU evicts session 2, the one used
    # less recently).
    cache = _cache()
    insert(cache, session(1), ReuseHint("s1", StopReason.TOOL_USE, finished_at_s=101.0))
    insert(cache, session(2), ReuseHint("s2", StopReason.TOOL_USE, finished_at_s=102.0))
    insert(cache, session(2), ReuseHint("s2", StopReason.TOOL_USE, finished_at_s=103.0))
    insert(cache, session(1), ReuseHint("s1", StopReason.TOOL_USE, finished_at_s=104.0))
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 2]) == [2]


def test_a_hint_that_lowers_a_cached_leafs_key_is_honoured() -> None:
    # Session 1 called a tool (kept until t=700), then answered at t=101 (kept until 101):
    # its leaf's key dropped while it sat in the heap.  Session 2 answered at t=200, so
    # session 1 goes first.
    # (An eviction of an unhinted session 3 first re-keys session 1's heap entry to its
    # tool-call key, so that entry is larger than the key the answer leaves.)
    cache = _cache()
    insert(cache, session(1), ReuseHint("s1", StopReason.TOOL_USE, finished_at_s=100.0))
    insert(cache, session(3))
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 3]) == [1]
    insert(cache, session(2), ReuseHint("s2", StopReason.END_TURN, finished_at_s=200.0))
    insert(cache, session(1), ReuseHint("s1", StopReason.END_TURN, finished_at_s=101.0))
    cache.evict(EvictParams(num_tokens=2 * PS))
    cache.sanity_check()
    assert survivors(cache, [1, 2]) == [2]


def test_a_session_without_hints_goes_before_hinted_ones() -> None:
    cache = _cache()
    insert(cache, session(1), ReuseHint("s1", StopReason.END_TURN, finished_at_s=1.0))
    insert(cache, session(2))  # no hint, used later
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 2]) == [1]


def test_insert_params_session_id_names_the_hints_session() -> None:
    cache = _cache()
    hint = ReuseHint(None, StopReason.TOOL_USE, finished_at_s=5.0)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(session(1))))
    own = cache.token_to_kv_pool_allocator.alloc(2 * PS)
    assert own is not None and m.device_indices.shape[0] == 0
    cache.insert(
        InsertParams(key=RadixKey(session(1)), value=own, session_id="abc", reuse_hint=hint)
    )
    strategy = cache.full.strategy
    assert isinstance(strategy, SessionAwareStrategy)
    assert hash("abc") in strategy._ranks
    cache.sanity_check()


@pytest.mark.parametrize("bad", ["tool_use", 3, object()])
def test_a_hint_of_the_wrong_type_is_refused_and_changes_nothing(bad: object) -> None:
    cache = _cache()
    before = cache.num_nodes
    own = cache.token_to_kv_pool_allocator.alloc(2 * PS)
    assert own is not None
    with pytest.raises(InvalidInputError):
        cache.insert(InsertParams(key=RadixKey(session(1)), value=own, reuse_hint=bad))  # type: ignore[arg-type]
    assert cache.num_nodes == before
    cache.token_to_kv_pool_allocator.free(own)
    req = start_request(cache, session(2), 0)
    assert req is not None
    req.kv_committed_len = req.kv_allocated_len = 2 * PS
    with pytest.raises(InvalidInputError):
        cache.cache_finished_req(req, hint=bad)  # type: ignore[arg-type]
    assert cache.num_nodes == before
    cache.cache_finished_req(req)
    cache.sanity_check()
    cache.check_pools({ComponentType.FULL: 0})


@pytest.mark.parametrize(
    "kwargs",
    [{"expected_gap_s": -1.0}, {"expected_gap_s": float("nan")}, {"finished_at_s": float("inf")}],
)
def test_hint_fields_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidInputError):
        ReuseHint("s", StopReason.TOOL_USE, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"session_id": ["a"]},
        {"session_id": {"a": 1}},
        {"session_id": 5},
        {"session_id": b"a"},
        {"expected_gap_s": "5"},
        {"expected_gap_s": True},
        {"finished_at_s": [1.0]},
        {"session_id": "a", "parent_id": 5},
        {"session_id": "a", "parent_id": b"p"},
        {"parent_id": "p"},  # a sub-agent's flow has a session of its own
        {"session_id": "a", "parent_id": "a"},
    ],
)
def test_hint_fields_of_the_wrong_type_are_refused_at_construction(kwargs: dict[str, Any]) -> None:
    """Issue 50 item 4: such a hint used to construct and then raise TypeError in the actor."""
    with pytest.raises(InvalidInputError):
        ReuseHint(**kwargs)


@pytest.mark.parametrize("bad", [["a"], {"a": 1}, 7])
def test_insert_session_id_of_the_wrong_type_is_refused_and_changes_nothing(bad: object) -> None:
    cache = _cache()
    before = cache.num_nodes
    own = cache.token_to_kv_pool_allocator.alloc(2 * PS)
    assert own is not None
    params = InsertParams(
        key=RadixKey(session(1)),
        value=own,
        session_id=bad,
        reuse_hint=ReuseHint(),  # type: ignore[arg-type]
    )
    with pytest.raises(InvalidInputError):
        cache.insert(params)
    assert cache.num_nodes == before
    cache.token_to_kv_pool_allocator.free(own)
    cache.sanity_check()
    cache.check_pools({ComponentType.FULL: 0})


def test_a_bad_session_id_does_not_fail_the_service() -> None:
    """A caller's bad session id is the caller's typed error (it used to raise TypeError in
    the actor: every client got ServiceFailedError); the service keeps serving."""

    async def main() -> None:
        async with AsyncUnifiedRadixCache(_cache()) as svc:
            with anyio.fail_after(10):
                req = await svc.call(lambda c: start_request(c, session(1), 0))
                assert req is not None
                req.kv_committed_len = req.kv_allocated_len = 2 * PS
                with pytest.raises(InvalidInputError):
                    hint = ReuseHint(["a"], StopReason.TOOL_USE)  # type: ignore[arg-type]
                    await svc.cache_finished_req(req, hint=hint)
                await svc.cache_finished_req(req, hint=ReuseHint("a", StopReason.TOOL_USE))
                assert (await svc.match(session(1))).prefix_len == 2 * PS
                await svc.sanity_check({ComponentType.FULL: 0})

    anyio.run(main)


def test_session_table_bytes_do_not_grow_with_session_id_length() -> None:
    """300 one-MiB session ids used to keep ~300 MB in the table; it keeps their hashes."""
    import sys

    cache = _cache(kv_size=1024 * PS)
    strategy = cache.full.strategy
    assert isinstance(strategy, SessionAwareStrategy)
    for i in range(300):
        sid = f"{i:08d}" + "x" * (1 << 20)
        insert(cache, session(i), ReuseHint(sid, StopReason.TOOL_USE, finished_at_s=float(i)))
        del sid
    assert len(strategy._ranks) == 300
    table_bytes = sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in strategy._ranks.items())
    assert table_bytes < 64 * 300, table_bytes


@pytest.mark.parametrize(
    "kwargs", [{"window_s": -1.0}, {"quantum_s": 0.0}, {"hot_gap_s": -2.0}, {"quantile": 0.5}]
)
def test_session_policy_parameters_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        CacheConfig(eviction_policy=EvictionPolicy.SESSION_AWARE, eviction_params=kwargs)


def test_cache_finished_req_passes_the_hint_to_the_policy() -> None:
    cache = _cache()
    req = start_request(cache, session(1), 0)
    assert req is not None
    req.kv_committed_len = req.kv_allocated_len = 2 * PS
    cache.cache_finished_req(req, hint=ReuseHint("s1", StopReason.TOOL_USE, finished_at_s=1.0))
    leaf = cache.match_prefix(MatchPrefixParams(key=RadixKey(session(1)))).last_device_node
    assert leaf.eviction_state is not None  # the path carries the hinted key base
    cache.sanity_check()
    cache.check_pools({ComponentType.FULL: 0})


def test_service_cache_finished_req_passes_the_hint() -> None:
    async def main() -> None:
        cache = _cache()
        async with AsyncUnifiedRadixCache(cache) as svc:
            with anyio.fail_after(10):
                req = await svc.call(lambda c: start_request(c, session(1), 0))
                assert req is not None
                req.kv_committed_len = req.kv_allocated_len = 2 * PS
                hint = ReuseHint("s1", StopReason.END_TURN, finished_at_s=3.0)
                await svc.cache_finished_req(req, hint=hint)
                with pytest.raises(InvalidInputError):
                    await svc.cache_finished_req(req, hint="end_turn")  # type: ignore[arg-type]
                states = await svc.call(
                    lambda c: (
                        c.match_prefix(
                            MatchPrefixParams(key=RadixKey(session(1)))
                        ).last_device_node.eviction_state
                    )
                )
                assert states is not None
                await svc.sanity_check({ComponentType.FULL: 0})

    anyio.run(main)


# ------------------------------------------------------------------ random operations
_hints = st.one_of(
    st.none(),
    st.builds(
        ReuseHint,
        st.sampled_from([None, "a", "b", "c"]),
        st.sampled_from([None, *StopReason]),
        st.one_of(st.none(), st.floats(0, 1000)),
        st.one_of(st.none(), st.floats(-50, 5000)),
    ),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 3), max_size=5), _hints),
        st.tuples(st.just("request"), st.lists(st.integers(0, 3), max_size=5), _hints),
        st.tuples(st.just("lock"), st.lists(st.integers(0, 3), max_size=5)),
        st.tuples(st.just("unlock"), st.integers(0, 9)),
        st.tuples(st.just("evict"), st.integers(0, 30)),
    ),
    max_size=30,
)


def _tokens(blocks: list[int]) -> list[int]:
    return [b * 100 + i for b in blocks for i in range(PS)]


def _run(cache: UnifiedRadixCache, program: list[tuple[Any, ...]]) -> list[int]:
    """Apply ``program``; return what each evict freed (the eviction order's fingerprint)."""
    alloc = cache.token_to_kv_pool_allocator
    locks: list[Any] = []
    freed: list[int] = []
    for op in program:
        kind = op[0]
        if kind in ("insert", "request") and op[1]:
            tokens = _tokens(op[1])
            if kind == "request":
                req = start_request(cache, tokens, 1)
                if req is not None:
                    req.kv_committed_len = req.kv_allocated_len = len(tokens) + 1
                    cache.cache_finished_req(req, hint=op[2])
            else:
                m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
                own = alloc.alloc(len(tokens) - m.device_indices.shape[0])
                if own is not None:
                    value = torch.cat([m.device_indices, own])
                    cache.insert(
                        InsertParams(
                            key=RadixKey(tokens),
                            value=value,
                            prev_prefix_len=m.device_indices.shape[0],
                            reuse_hint=op[2],
                        )
                    )
        elif kind == "lock" and op[1]:
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(_tokens(op[1]))))
            locks.append((m.last_device_node, cache.inc_lock_ref(m.last_device_node)))
        elif kind == "unlock" and locks:
            node, receipt = locks.pop(op[1] % len(locks))
            cache.dec_lock_ref(node, receipt.to_dec_params())
        elif kind == "evict":
            freed.append(cache.evict(EvictParams(num_tokens=op[1] * PS)).num_tokens_evicted)
        cache.sanity_check()
        cache.check_pools({ComponentType.FULL: 0})
    while locks:
        node, receipt = locks.pop()
        cache.dec_lock_ref(node, receipt.to_dec_params())
    cache.evict(EvictParams(num_tokens=1 << 30))
    cache.sanity_check()
    assert cache.num_nodes == 0
    assert alloc.available_size() == alloc.size
    return freed


@pytest.mark.parametrize("config", POLICY_CONFIGS)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=_ops)
def test_every_policy_keeps_invariants_with_hints(
    config: dict[str, Any], program: list[tuple[Any, ...]]
) -> None:
    cache = build_cache(CacheConfig(page_size=PS, kv_size=24 * PS, max_num_reqs=4, **config))
    _run(cache, program)


def _strip(program: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [(*op[:2], None) if op[0] in ("insert", "request") else op for op in program]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=_ops)
def test_without_hints_session_aware_evicts_exactly_as_lru(program: list[tuple[Any, ...]]) -> None:
    plain = _strip(program)
    lru = _run(_cache(EvictionPolicy.LRU, kv_size=24 * PS), plain)
    assert _run(_cache(kv_size=24 * PS), plain) == lru


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.SLRU, EvictionPolicy.TLRU])
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=_ops)
def test_policies_without_hint_support_ignore_hints(
    policy: EvictionPolicy, program: list[tuple[Any, ...]]
) -> None:
    with_hints = _run(_cache(policy, kv_size=24 * PS), program)
    assert _run(_cache(policy, kv_size=24 * PS), _strip(program)) == with_hints
