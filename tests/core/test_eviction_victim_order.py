"""Victim order of every SGLang eviction policy, against a reference written from the semantics
of SGLang 0.5.23's ``mem_cache/evict_policy.py`` (not from urc's strategies).

SGLang evicts, among the unlocked device leaves, the one with the smallest
``strategy.get_priority(node)``, ties broken by ``last_access_time``:

=========  ===================================================================================
LRU        ``last_access_time``
LFU        ``(hit_count, last_access_time)``
FIFO       ``creation_time``
MRU        ``-last_access_time``
FILO       ``-creation_time``
PRIORITY   ``(priority, last_access_time)``
SLRU       ``(1 if hit_count >= protected_threshold else 0, last_access_time)``
TLRU       ``(-1 if parent_end >= max(L + next_prompt_estimate - threshold, 0) else 0,
           last_access_time)``, where ``parent_end`` is where the leaf's parent ends and ``L``
           the branch's high-water depth: the longest key inserted through the leaf's end
           since the leaf (or the node it was split from) was created.
=========  ===================================================================================

Random programs of inserts (re-inserts count hits), matches (stamps), locks, unlocks and
one-leaf evictions; before each eviction the reference names the victim, and exactly that
leaf must go.  The reference keeps its own record of inserted keys (for TLRU's ``L``).
"""

from __future__ import annotations

from typing import Any

import pytest
from cache_harness import Harness
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from urc import EvictionPolicy, EvictParams, TreeNode

PAGE_SIZES = [1, 4]
SLRU_THRESHOLD = 2
TLRU_THRESHOLD, TLRU_ESTIMATE = 5, 2  # in pages (times the page size)

POLICIES = [
    EvictionPolicy.LRU,
    EvictionPolicy.LFU,
    EvictionPolicy.FIFO,
    EvictionPolicy.MRU,
    EvictionPolicy.FILO,
    EvictionPolicy.PRIORITY,
    EvictionPolicy.SLRU,
    EvictionPolicy.TLRU,
]


class Reference:
    """The cache plus what the reference needs to rank its leaves."""

    def __init__(self, policy: EvictionPolicy, ps: int) -> None:
        self.policy = policy
        self.ps = ps
        self.h = Harness(
            ps,
            kv_size=4096 * ps,
            eviction_policy=policy,
            eviction_params={
                EvictionPolicy.SLRU: {"protected_threshold": SLRU_THRESHOLD},
                EvictionPolicy.TLRU: {
                    "threshold": TLRU_THRESHOLD * ps,
                    "next_prompt_estimate": TLRU_ESTIMATE * ps,
                },
            }.get(policy, {}),
        )
        # (tree clock after the insert, key) of every insert.
        self.inserted: list[tuple[int, list[int]]] = []

    def insert(self, tokens: list[int], priority: int) -> None:
        from urc import InsertParams, RadixKey

        h = self.h
        value = h.new_value(len(tokens))
        h.cache.insert(InsertParams(key=RadixKey(tokens), value=value, priority=priority))
        h.held -= len(tokens)
        h.check()
        self.inserted.append((h.cache.tree.clock, tokens))

    def _path_tokens(self, node: TreeNode) -> list[int]:
        parts = []
        while node.parent is not None:
            parts.append(list(node.key))
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def _tlru_priority(self, node: TreeNode) -> int:
        path = self._path_tokens(node)
        end = len(path)
        history = end
        for clock, key in self.inserted:
            if clock >= node.creation_time and len(key) > history and key[:end] == path:
                history = len(key)
        budget = max(history + (TLRU_ESTIMATE - TLRU_THRESHOLD) * self.ps, 0)
        return -1 if end - node.key_len >= budget else 0

    def priority(self, node: TreeNode) -> tuple[Any, ...]:
        p, t = self.policy, node.last_access_time
        if p is EvictionPolicy.LRU:
            return (t, t)
        if p is EvictionPolicy.LFU:
            return ((node.hit_count, t), t)
        if p is EvictionPolicy.FIFO:
            return (node.creation_time, t)
        if p is EvictionPolicy.MRU:
            return (-t, t)
        if p is EvictionPolicy.FILO:
            return (-node.creation_time, t)
        if p is EvictionPolicy.PRIORITY:
            return ((node.priority, t), t)
        if p is EvictionPolicy.SLRU:
            return ((1 if node.hit_count >= SLRU_THRESHOLD else 0, t), t)
        assert p is EvictionPolicy.TLRU
        return ((self._tlru_priority(node), t), t)

    def victim(self) -> TreeNode | None:
        leaves = [
            n
            for n in self.h.cache.iter_nodes()
            if not n.children and n.full is not None and n.full.lock_ref == 0
        ]
        return min(leaves, key=self.priority, default=None)


def _tokens(branch: int, depth: int, ps: int) -> list[int]:
    # Branches share their first pages pairwise, so keys fork at several depths.
    return [(branch // 2 if i < 2 * ps else branch) * 1000 + i for i in range(depth * ps)]


_op = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 5), st.integers(1, 8), st.integers(0, 2)),
    st.tuples(st.just("match"), st.integers(0, 5), st.integers(1, 8)),
    st.tuples(st.just("lock"), st.integers(0, 5), st.integers(1, 8)),
    st.tuples(st.just("unlock"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(1, 3)),
)


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.value)
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=st.lists(_op, max_size=50))
def test_each_eviction_takes_the_leaf_sglang_would_take(
    policy: EvictionPolicy, ps: int, program: list[tuple[Any, ...]]
) -> None:
    ref = Reference(policy, ps)
    h, cache = ref.h, ref.h.cache
    locks: list[tuple[TreeNode, Any]] = []
    for op in program:
        if op[0] == "insert":
            ref.insert(_tokens(op[1], op[2], ps), op[3])
        elif op[0] == "match":
            h.match(_tokens(op[1], op[2], ps))
        elif op[0] == "lock":
            node = h.match(_tokens(op[1], op[2], ps)).last_device_node
            locks.append((node, cache.inc_lock_ref(node)))
        elif op[0] == "unlock" and locks:
            node, receipt = locks.pop(op[1] % len(locks))
            cache.dec_lock_ref(node, receipt.to_dec_params())
        elif op[0] == "evict":
            for _ in range(op[1]):
                expected = ref.victim()
                before = {n.id for n in cache.iter_nodes()}
                freed = cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted
                h.check()
                gone = before - {n.id for n in cache.iter_nodes()}
                if expected is None:
                    assert freed == 0 and not gone
                    break
                assert gone == {expected.id}, (
                    f"{policy.value}: evicted {sorted(gone)}, SGLang takes {expected.id}"
                )
                assert freed == expected.key_len
    for node, receipt in locks:
        cache.dec_lock_ref(node, receipt.to_dec_params())
    h.check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_tlru_history_survives_the_eviction_of_the_tail(ps: int) -> None:
    """A conversation trimmed by T-LRU keeps its high-water mark: it stops being TEL-safe
    after ``threshold - next_prompt_estimate`` tokens instead of being walked down to
    nothing (threshold 5 pages, estimate 2: 3 pages may go)."""
    ref = Reference(EvictionPolicy.TLRU, ps)
    other = [50_000 + i for i in range(4 * ps)]
    ref.insert(other, 0)  # the oldest leaf; history 4 pages, budget 1 page: not TEL-safe
    conv = list(range(8 * ps))
    for n in range(2, 9, 2):  # four turns of 2 pages: nodes of 2 pages, 8 pages deep
        ref.insert(conv[: n * ps], 0)
    cache = ref.h.cache
    # History 8 pages, budget 8 + 2 - 5 = 5: the last turn (its parent ends at 6) is safe.
    assert ref.victim() is not None and list(ref.victim().key) == conv[6 * ps :]  # type: ignore[union-attr]
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 2 * ps
    # Still history 8 (not 6, which would make the budget 3 and the turn ending at 6 safe):
    # nothing is safe, so plain LRU takes ``other``.
    assert ref.victim() is not None and list(ref.victim().key) == other  # type: ignore[union-attr]
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 4 * ps
    ref.h.check()
    assert ref.h.match_len(conv) == 6 * ps and ref.h.match_len(other) == 0


def _leaf(ref: Reference, key: list[int]) -> TreeNode:
    return next(n for n in ref.h.cache.iter_nodes() if list(n.key) == key)


def _evict_one(ref: Reference) -> list[int]:
    """Evict one leaf (after checking that the reference names it); its key."""
    expected = ref.victim()
    assert expected is not None
    key = list(expected.key)
    assert ref.h.cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == len(key)
    ref.h.check()
    assert expected.deleted
    return key


# (policy, what happens after inserting leaves a, b, c in that order, expected victim order)
_SCRIPTS = [
    (EvictionPolicy.LRU, "match a", "bca"),
    (EvictionPolicy.MRU, "match a", "acb"),  # a use makes a leaf the first victim
    (EvictionPolicy.MRU, "match b, match a", "abc"),
    (EvictionPolicy.FIFO, "match a", "abc"),
    (EvictionPolicy.FILO, "match c", "cba"),  # newest inserted first, uses do not count
    (EvictionPolicy.LFU, "insert a, insert a, insert c", "bca"),
    # An insert counts a hit (the first one too): a re-inserted leaf has 2, protected.
    (EvictionPolicy.SLRU, "insert a, match b, match c", "bca"),
    (EvictionPolicy.SLRU, "match a, match b", "cab"),  # all probationary: LRU
]


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize(("policy", "script", "order"), _SCRIPTS)
def test_victim_order_of_a_script(policy: EvictionPolicy, script: str, order: str, ps: int) -> None:
    ref = Reference(policy, ps)
    leaves = {name: [k * 1000 + i for i in range(ps)] for k, name in enumerate("abc", 1)}
    for name in "abc":
        ref.insert(leaves[name], 0)
    for step in script.split(", "):
        verb, name = step.split()
        if verb == "match":
            ref.h.match(leaves[name])
        else:
            ref.insert(leaves[name], 0)
    assert [_evict_one(ref) for _ in order] == [leaves[name] for name in order]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_tlru_split_part_inherits_the_branch_history(ps: int) -> None:
    """The upper part of a split keeps the branch's high-water depth even once the lower part
    is gone (threshold 5 pages, estimate 2: safe when the parent ends >= history - 3)."""
    ref = Reference(EvictionPolicy.TLRU, ps)
    conv = list(range(12 * ps))
    other = [50_000 + i for i in range(4 * ps)]
    ref.insert(conv[: 4 * ps], 0)  # p: [0, 4)
    ref.insert(conv, 0)  # r: [4, 12), history 12
    ref.insert(other, 0)  # history 4: budget 1, not safe
    ref.h.match(conv[: 6 * ps])  # splits r: u [4, 6) | l [6, 12)
    cache = ref.h.cache
    node, receipt = _leaf(ref, other), None
    receipt = cache.inc_lock_ref(node)
    assert _evict_one(ref) == conv[6 * ps :]  # l (the only unlocked leaf)
    cache.dec_lock_ref(node, receipt.to_dec_params())
    ref.h.check()
    # u: its parent ends at 4 < 12 - 3, not safe (it would be with a history of 6): LRU, and
    # ``other`` is older.
    assert _evict_one(ref) == other
    assert _evict_one(ref) == conv[4 * ps : 6 * ps]


def test_new_policies_take_their_parameters_as_given() -> None:
    from urc import CacheConfig
    from urc.errors import ConfigError
    from urc.eviction_policy import SlruStrategy, TlruStrategy, make_strategy

    slru = make_strategy(EvictionPolicy.SLRU, params={"protected_threshold": 4})
    assert isinstance(slru, SlruStrategy)
    tlru = make_strategy(EvictionPolicy.TLRU, params={"threshold": 8})
    assert isinstance(tlru, TlruStrategy)
    for policy, name in (
        (EvictionPolicy.TLRU, "threshold"),
        (EvictionPolicy.TLRU, "next_prompt_estimate"),
        (EvictionPolicy.SLRU, "protected_threshold"),
    ):
        for bad in (-1, 1.5, "2", True):
            with pytest.raises(ConfigError, match=name):
                CacheConfig(eviction_policy=policy, eviction_params={name: bad})
        # A policy's parameter given to another policy is refused, naming what it takes.
        with pytest.raises(ConfigError, match="it takes none"):
            CacheConfig(eviction_policy=EvictionPolicy.LRU, eviction_params={name: 1})
