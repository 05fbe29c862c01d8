"""The return-time eviction policy (``urc.return_time_eviction``) and its gap model.

Without hints it evicts exactly as LRU (the same victims, in the same order: property test);
with hints, expired and unhinted leaves go first, then the furthest predicted return; a
prediction moves later (and expires) as its session stays away, through the timer queue;
gaps are learned from the requests that extend a cached path, and paths not extended within
the horizon count as never.  Invariants under random operations with hints are checked for
every policy in ``tests/core/test_reuse_hint.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
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
)
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError
from urc.eviction_policy import EvictionPolicy
from urc.gap_model import GapHistogram, gap_edges
from urc.return_time_eviction import ReturnTimeStrategy
from urc.reuse_hint import ReuseHint, StopReason

TOOL = StopReason.TOOL_USE
END = StopReason.END_TURN


def _cache(policy: EvictionPolicy = EvictionPolicy.RETURN_TIME, **kw: Any) -> UnifiedRadixCache:
    return hint_cache(policy, **kw)


def _strategy(cache: UnifiedRadixCache) -> ReturnTimeStrategy:
    s = cache.full.strategy
    assert isinstance(s, ReturnTimeStrategy)
    return s


# ------------------------------------------------------------------ the gap model
def test_gap_edges_double_up_to_the_horizon() -> None:
    assert gap_edges(20.0) == (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 20.0)


@pytest.mark.parametrize(
    ("gaps", "nevers", "j", "q", "expected"),
    [
        ([3.0] * 4, 0, 0, 0.5, 3.0),  # bin [2, 4): halfway through its counts
        ([3.0] * 4, 4, 0, 0.5, 4.0),  # half never: the end of the last returning bin
        ([3.0] * 4, 5, 0, 0.5, None),  # more than half never: expired
        ([3.0] * 4 + [40.0] * 4, 0, 3, 0.5, 48.0),  # late: only the later gaps count
        ([3.0] * 4, 0, 3, 0.5, None),  # past every observed gap
    ],
)
def test_gap_histogram_predicts_the_conditional_quantile(
    gaps: list[float], nevers: int, j: int, q: float, expected: float | None
) -> None:
    h = GapHistogram(gap_edges(100.0), None, prior_weight=0.0)
    for g in gaps:
        h.add(g)
    for _ in range(nevers):
        h.add_never()
    assert h.predict(j, q) == expected


def test_gap_histogram_counts_gaps_past_the_horizon_as_never_and_halves_old_counts() -> None:
    h = GapHistogram(gap_edges(100.0), 5.0, prior_weight=1.0)
    h.add(100.0)
    assert h.never == 1.0
    for _ in range(70000):
        h.add(1.5)
    assert h.total <= 65536.0
    assert h.counts[h.bin_of(1.5)] > 30000.0


# ------------------------------------------------------------------ the order
def test_an_answer_goes_before_a_tool_call_that_is_due() -> None:
    # Session 1 answered at t=100 (back in minutes), session 2 called a tool at t=90 (back
    # in seconds): the furthest predicted return goes first, although LRU would keep 2.
    for policy, kept in ((EvictionPolicy.RETURN_TIME, [2]), (EvictionPolicy.LRU, [1])):
        cache = _cache(policy)
        insert(cache, session(2), ReuseHint("s2", TOOL, finished_at_s=90.0))
        insert(cache, session(1), ReuseHint("s1", END, finished_at_s=100.0))
        cache.evict(EvictParams(num_tokens=2 * PS))
        cache.sanity_check()
        assert survivors(cache, [1, 2]) == kept, policy


def test_a_late_tool_call_expires_before_a_pending_answer() -> None:
    # Session 1 called a tool at t=0 and has not come back by t=100: no tool gap seen so
    # far was that long, so its prediction has expired (the timer queue lowered its key);
    # session 2's answer at t=100 is still pending.  The session-aware policy keeps 1.
    for policy, kept in ((EvictionPolicy.RETURN_TIME, [2]), (EvictionPolicy.SESSION_AWARE, [1])):
        cache = _cache(policy)
        insert(cache, session(1), ReuseHint("s1", TOOL, finished_at_s=0.0))
        insert(cache, session(3))  # an unhinted leaf: its eviction re-keys 1's entry
        cache.evict(EvictParams(num_tokens=2 * PS))
        assert survivors(cache, [1, 3]) == [1]
        insert(cache, session(2), ReuseHint("s2", END, finished_at_s=100.0))
        cache.evict(EvictParams(num_tokens=2 * PS))
        cache.sanity_check()
        assert survivors(cache, [1, 2]) == kept, policy


def test_unhinted_leaves_go_first_in_lru_order() -> None:
    cache = _cache()
    insert(cache, session(1), ReuseHint("s1", END, finished_at_s=1.0))
    insert(cache, session(2))
    insert(cache, session(3))
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 2, 3]) == [1, 3]
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 2, 3]) == [1]


def test_a_sub_agents_final_answer_goes_before_a_main_agents_answer() -> None:
    # A sub-agent's answer goes to its parent: its flow ends (learned apart from the main
    # agents' answers, prior never), so its path expires at once.  Learned together, the
    # main agent's later answer would be the furthest return and go first.
    cache = _cache()
    insert(cache, session(1), ReuseHint("s1/a", END, finished_at_s=0.0, parent_id="s1"))
    insert(cache, session(2), ReuseHint("s2", END, finished_at_s=10.0))
    cache.evict(EvictParams(num_tokens=2 * PS))
    cache.sanity_check()
    cache.check_pools({ComponentType.FULL: 0})
    assert survivors(cache, [1, 2]) == [2]


def test_a_parent_waiting_on_its_sub_agent_stays_due_until_it_answers() -> None:
    cache = _cache()
    insert(cache, session(1), ReuseHint("s1", TOOL, finished_at_s=0.0))  # starts a sub-agent
    insert(cache, session(2), ReuseHint("s2", TOOL, finished_at_s=0.0))
    insert(cache, session(3), ReuseHint("s1/a", TOOL, finished_at_s=100.0, parent_id="s1"))
    # At 100 s both tool calls are late (expired: the prior's gap is 9 s), but session 1
    # waits on its sub-agent: due when the sub-agent is, so session 2 goes first.
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 2, 3]) == [1, 3]
    # The sub-agent answers: its flow ends (expired), its parent is due at once.
    insert(cache, session(4), ReuseHint("s1/a", END, finished_at_s=130.0, parent_id="s1"))
    cache.evict(EvictParams(num_tokens=4 * PS))
    assert survivors(cache, [1, 3, 4]) == [1]
    # Held for as long again (a quantum at least), then its own prediction again: expired.
    insert(cache, session(5), ReuseHint("s5", TOOL, finished_at_s=1000.0))
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 5]) == [5]


def test_a_servers_own_expected_gap_wins_over_the_learned_one() -> None:
    # Both called a tool at t=10; the server expects session 1 back in 500 s.
    cache = _cache()
    insert(cache, session(1), ReuseHint("s1", TOOL, 500.0, finished_at_s=10.0))
    insert(cache, session(2), ReuseHint("s2", TOOL, finished_at_s=10.0))
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 2]) == [2]


# ------------------------------------------------------------------ learning
def test_gaps_are_learned_from_requests_that_extend_a_path() -> None:
    cache = _cache(kv_size=256 * PS)
    model = _strategy(cache)._models[TOOL, False]
    before = model.counts[model.bin_of(100.0)]
    tokens = session(1, pages=1)
    for i in range(5):
        tokens = tokens + [50_000 + 10 * i + k for k in range(PS)]
        insert(cache, tokens, ReuseHint("s1", TOOL, finished_at_s=100.0 * i))
    # Four extensions, each 100 s after the previous: four gaps in the [64, 128) bin.
    assert model.counts[model.bin_of(100.0)] == before + 4
    # A request of the session that does not extend the path is no reuse.
    insert(cache, session(7), ReuseHint("s1", TOOL, finished_at_s=500.0))
    assert model.counts[model.bin_of(100.0)] == before + 4


def test_a_sub_agents_gaps_are_learned_apart_from_the_main_agents() -> None:
    cache = _cache(kv_size=256 * PS)
    models = _strategy(cache)._models
    main, sub = models[TOOL, False], models[TOOL, True]
    j = main.bin_of(100.0)
    before = main.counts[j], sub.counts[j]
    tokens = session(1, pages=1)
    for i in range(3):
        tokens = tokens + [50_000 + 10 * i + k for k in range(PS)]
        insert(cache, tokens, ReuseHint("s1/a", TOOL, finished_at_s=100.0 * i, parent_id="s1"))
    assert (main.counts[j], sub.counts[j]) == (before[0], before[1] + 2)


def test_a_path_not_extended_within_the_horizon_counts_as_never() -> None:
    cache = _cache(eviction_params={"horizon_s": 64.0})
    model = _strategy(cache)._models[END, False]
    never = model.never
    insert(cache, session(1), ReuseHint("s1", END, finished_at_s=0.0))
    insert(cache, session(2), ReuseHint("s2", END, finished_at_s=30.0))
    assert model.never == never
    insert(cache, session(3), ReuseHint("s3", END, finished_at_s=65.0))
    assert model.never == never + 1  # session 1's path, at its horizon


def test_learned_long_tool_gaps_keep_a_late_session_pending() -> None:
    # Tool calls of this workload come back after ~100 s: at age 40 s a tool call is due,
    # not expired, so it outlives an answer.
    cache = _cache(kv_size=256 * PS)
    tokens = session(9, pages=1)
    for i in range(12):
        tokens = tokens + [60_000 + 10 * i + k for k in range(PS)]
        insert(cache, tokens, ReuseHint("s9", TOOL, finished_at_s=100.0 * i))
    cache.evict(EvictParams(num_tokens=1 << 20))
    insert(cache, session(1), ReuseHint("s1", TOOL, finished_at_s=2000.0))
    insert(cache, session(2), ReuseHint("s2", END, finished_at_s=2040.0))
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 2]) == [1]


def _loop(cache: UnifiedRadixCache, sid: str, base: int, times: list[float]) -> None:
    """Session ``sid`` calls tools at ``times``, each request extending the previous one."""
    tokens = [base + k for k in range(PS)]
    for i, t in enumerate(times):
        tokens = tokens + [base + 100 + 10 * i + k for k in range(PS)]
        insert(cache, tokens, ReuseHint(sid, TOOL, finished_at_s=t))


def test_a_sessions_own_slow_gaps_keep_it_pending_when_others_would_expire() -> None:
    # Six sessions called tools every 5 s, then stopped; session "x" every 100 s.  Most tool
    # calls still missing after 40 s never came back, so a newcomer's expires at 40 s; "x"'s
    # own gaps keep it pending: the newcomer goes first, and an answer pending since stays.
    cache = _cache(kv_size=512 * PS)
    for n in range(6):
        _loop(cache, f"f{n}", 100_000 * (n + 1), [5.0 * i for i in range(6)])
    _loop(cache, "x", 900_000, [100.0 * i for i in range(6)])
    cache.evict(EvictParams(num_tokens=1 << 20))
    insert(cache, session(1), ReuseHint("x", TOOL, finished_at_s=2000.0))
    insert(cache, session(2), ReuseHint("new", TOOL, finished_at_s=2000.0))
    insert(cache, session(3), ReuseHint("z", END, finished_at_s=2040.0))
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 2, 3]) == [1, 3]
    # Without the session's own gaps, "x" is a newcomer too.
    cache = _cache(kv_size=512 * PS)
    cache.full.strategy._own_weight = 0.0  # type: ignore[attr-defined]
    for n in range(6):
        _loop(cache, f"f{n}", 100_000 * (n + 1), [5.0 * i for i in range(6)])
    _loop(cache, "x", 900_000, [100.0 * i for i in range(6)])
    cache.evict(EvictParams(num_tokens=1 << 20))
    insert(cache, session(1), ReuseHint("x", TOOL, finished_at_s=2000.0))
    insert(cache, session(2), ReuseHint("new", TOOL, finished_at_s=2000.0))
    insert(cache, session(3), ReuseHint("z", END, finished_at_s=2040.0))
    cache.evict(EvictParams(num_tokens=2 * PS))
    assert survivors(cache, [1, 2, 3]) == [2, 3]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantile": 0.0},
        {"quantile": 1.0},
        {"horizon_s": 1.0},
        {"quantum_s": 0.0},
        {"quantum_s": float("nan")},
        {"quantile": "0.5"},
        {"window_s": 1.0},
    ],
)
def test_return_time_parameters_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        CacheConfig(eviction_policy=EvictionPolicy.RETURN_TIME, eviction_params=kwargs)


# ------------------------------------------------------------------ LRU without hints
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=5)),
        st.tuples(st.just("match"), st.lists(st.integers(0, 3), min_size=1, max_size=5)),
        st.tuples(st.just("lock"), st.lists(st.integers(0, 3), min_size=1, max_size=5)),
        st.tuples(st.just("unlock"), st.integers(0, 9)),
        st.tuples(st.just("evict"), st.integers(1, 12)),
    ),
    max_size=40,
)


def _contents(cache: UnifiedRadixCache) -> list[tuple[int, ...]]:
    """Every device path's tokens (what is cached, independent of node ids)."""
    out = []
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            if child.full.value is not None:
                path = prefix + tuple(int(t) for t in child.key)
                out.append(path)
                stack.append((child, path))
    return sorted(out)


def _run(cache: UnifiedRadixCache, program: list[tuple[Any, ...]]) -> list[Any]:
    """Apply ``program``; return what is cached after each eviction (the victims' trace)."""
    alloc = cache.token_to_kv_pool_allocator
    locks: list[Any] = []
    trace: list[Any] = []
    for op in program:
        kind = op[0]
        if kind in ("insert", "match", "lock"):
            tokens = [b * 100 + i for b in op[1] for i in range(PS)]
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            if kind == "insert":
                own = alloc.alloc(len(tokens) - m.device_indices.shape[0])
                if own is not None:
                    cache.insert(
                        InsertParams(
                            key=RadixKey(tokens),
                            value=torch.cat([m.device_indices, own]),
                            prev_prefix_len=m.device_indices.shape[0],
                        )
                    )
            elif kind == "lock":
                locks.append((m.last_device_node, cache.inc_lock_ref(m.last_device_node)))
        elif kind == "unlock" and locks:
            node, receipt = locks.pop(op[1] % len(locks))
            cache.dec_lock_ref(node, receipt.to_dec_params())
        elif kind == "evict":
            freed = cache.evict(EvictParams(num_tokens=op[1] * PS)).num_tokens_evicted
            trace.append((freed, _contents(cache)))
        cache.sanity_check()
        cache.check_pools({ComponentType.FULL: 0})
    return trace


@pytest.mark.parametrize("partial", [False, True])
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=_ops)
def test_without_hints_return_time_evicts_exactly_as_lru(
    partial: bool, program: list[tuple[Any, ...]]
) -> None:
    kw = {"kv_size": 24 * PS, "partial_leaf_eviction": partial}
    lru = _run(_cache(EvictionPolicy.LRU, **kw), program)
    assert _run(_cache(**kw), program) == lru


def test_timers_at_float_rounded_times_fire_once_and_end() -> None:
    # Finish times 0.1 s apart: ``(at + edge) - at`` rounds below ``edge`` for some of them;
    # a timer re-armed at its own due time would fire forever (it hung the bench).
    cache = _cache(kv_size=512 * PS)
    for i in range(200):
        insert(cache, session(i % 40), ReuseHint(f"s{i % 7}", TOOL, finished_at_s=0.1 * i))
    insert(cache, session(99), ReuseHint("z", END, finished_at_s=5000.0))
    assert not _strategy(cache)._timers or _strategy(cache)._timers[0][0] > 5000.0


# ------------------------------------------------------------------ cost of the timers
def _chain(cache: UnifiedRadixCache, s: int, pages: int) -> list[Any]:
    """Insert session ``s``'s prompt one page longer at a time (one node per page); returns
    the path's nodes, root excluded, top first."""
    for n in range(1, pages + 1):
        insert(cache, session(s, n))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(session(s, pages))))
    path = []
    node = m.last_device_node
    while node is not cache.root:
        path.append(node)
        node = node.parent
    return path[::-1]


@pytest.mark.parametrize("evicted", [0, 1, 3])
def test_a_timer_step_rekeys_only_the_deepest_node_left_of_a_stamps_path(evicted: int) -> None:
    # One stamp over a 6-node path; its timer re-keys only the path's one possible leaf (the
    # deepest node still cached), however deep the path: the others read the new key when
    # they become leaves.  (It re-keyed every node of the path at every step: 40x LRU's
    # insert cost on bench.core --hints.)
    cache = _cache()
    path = _chain(cache, 1, 6)
    insert(cache, session(1, 6), ReuseHint("s1", TOOL, finished_at_s=0.0))
    assert all(n.eviction_state is path[-1].eviction_state for n in path)
    if evicted:
        cache.evict(EvictParams(num_tokens=evicted * PS))
        cache.sanity_check()
        cache.check_pools({ComponentType.FULL: 0})
        assert all(n.deleted for n in path[-evicted:])
    # Late: the tool call's prediction expires, its key drops.
    dropped = _strategy(cache).note_hint([], ReuseHint(finished_at_s=2000.0))
    assert dropped == [path[-1 - evicted]]


def test_a_superseded_stamp_stops_its_timers() -> None:
    # The session's next request re-stamps the whole path: the old stamp carries no node,
    # its gap is counted, so its next timer step disarms it (no re-key, no more timers).
    cache = _cache()
    insert(cache, session(1, 1), ReuseHint("s1", TOOL, finished_at_s=0.0))
    old = _strategy(cache)._timers[0][2]
    insert(cache, session(1, 2), ReuseHint("s1", TOOL, finished_at_s=5.0))
    assert not old.open
    assert _strategy(cache).note_hint([], ReuseHint(finished_at_s=2000.0)) == [
        cache.match_prefix(MatchPrefixParams(key=RadixKey(session(1, 2)))).last_device_node
    ]
    assert not old.armed and all(t[2] is not old for t in _strategy(cache)._timers)


def test_rehinted_leaves_keep_the_full_heap_within_twice_the_nodes() -> None:
    # Each hint that lowers a leaf's key pushes a fresh heap entry; compaction must drop the
    # entries it superseded (it kept every entry of a live leaf: the heap grew without
    # bound and every insert compacted it again).
    cache = _cache()
    for i in range(300):
        s = i % 4
        # 10 s apart: each hint moves the leaf's predicted return by a quantum or more.
        insert(cache, session(s), ReuseHint(f"s{s}", TOOL, finished_at_s=10.0 * i))
        heap = cache.full._heap
        assert len(heap) <= 2 * cache.tree.num_nodes + 64, (i, len(heap), cache.tree.num_nodes)
    cache.evict(EvictParams(num_tokens=8 * PS))
    cache.sanity_check()
    cache.check_pools({ComponentType.FULL: 0})
    assert survivors(cache, [0, 1, 2, 3]) == []
