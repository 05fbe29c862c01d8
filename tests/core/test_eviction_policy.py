"""Eviction strategies (``urc.eviction_policy``) and partial-leaf eviction.

The random-sequence invariants of every strategy are in ``test_cache_properties`` (FULL) and
``test_mamba_properties`` (FULL+MAMBA, FULL+SWA+MAMBA); here: what each strategy evicts first.
"""

from __future__ import annotations

import pytest
from cache_harness import Harness, seq

from urc import CacheConfig, EvictionPolicy, EvictParams, TreeNode
from urc.errors import ConfigError
from urc.eviction_policy import ForkAwareStrategy, LruStrategy, make_strategy

PAGE_SIZES = [1, 4, 16]


def _evict(h: Harness, n: int) -> int:
    freed = h.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted
    h.check()
    return freed


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_partial_leaf_eviction_frees_at_most_the_pages_asked_for(ps: int) -> None:
    h = Harness(ps, partial_leaf_eviction=True)
    tokens = seq(0, 10, ps)
    h.insert(tokens)
    assert _evict(h, 2 * ps + 1) == 3 * ps  # rounded up to whole pages, not the whole leaf
    assert h.match_len(tokens) == 7 * ps  # the head stays cached and matchable


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_whole_leaf_eviction_frees_the_whole_leaf(ps: int) -> None:
    h = Harness(ps)
    h.insert(seq(0, 10, ps))
    assert _evict(h, 1) == 10 * ps  # SGLang's behaviour: whole leaves


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_partial_eviction_keeps_the_heads_age(ps: int) -> None:
    """Splitting a victim is not a use: its head stays the least recently used leaf."""
    h = Harness(ps, partial_leaf_eviction=True)
    old, new = seq(0, 4, ps), seq(1000, 4, ps)
    h.insert(old)
    h.insert(new)
    assert _evict(h, ps) == ps  # the tail page of ``old``
    assert _evict(h, 3 * ps) == 3 * ps  # ``old``'s head goes next, not ``new``
    assert h.match_len(old) == 0 and h.match_len(new) == 4 * ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_evict_never_frees_locked_prefix_with_partial_eviction(ps: int) -> None:
    h = Harness(ps, partial_leaf_eviction=True)
    tokens = seq(0, 6, ps)
    h.insert(tokens)
    m = h.match(tokens[: 2 * ps])
    receipt = h.cache.inc_lock_ref(m.last_device_node)
    assert _evict(h, 1 << 20) == 4 * ps
    assert h.match_len(tokens) == 2 * ps
    h.cache.dec_lock_ref(m.last_device_node, receipt.to_dec_params())
    assert _evict(h, 1 << 20) == 2 * ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_fork_aware_evicts_the_branch_a_fork_left_first(ps: int) -> None:
    """A conversation's next turn forks from its previous prompt: the old tail goes first,
    before an older, unrelated leaf that LRU would take."""
    h = Harness(ps, eviction_policy=EvictionPolicy.FORK_AWARE)
    other = seq(5000, 3, ps)
    turn1 = seq(0, 3, ps) + seq(100, 2, ps)
    turn2 = seq(0, 3, ps) + seq(200, 2, ps)
    h.insert(other)
    h.insert(turn1)
    h.insert(turn2, prev_prefix_len=0)
    assert _evict(h, 2 * ps) == 2 * ps
    assert h.match_len(turn1) == 3 * ps  # its own tail is gone, the shared part stays
    assert h.match_len(other) == 3 * ps and h.match_len(turn2) == 5 * ps


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.FORK_AWARE])
def test_children_of_a_widely_shared_prefix_are_not_superseded(policy: EvictionPolicy) -> None:
    """Only a fork from one child to two marks the older branch; once a prefix has three
    children (a system prompt), each is ordered by recency as under LRU."""
    h = Harness(4, eviction_policy=policy)
    unrelated, system = seq(9000, 2, 4), seq(0, 2, 4)
    h.insert(unrelated)  # the oldest leaf
    for i in range(3):
        h.insert(system + seq(1000 * (i + 1), 2, 4))
    assert _evict(h, 8) == 8
    assert h.match_len(unrelated) == 0 and h.match_len(system + seq(1000, 2, 4)) == 16


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_fork_aware_is_lru_on_a_workload_without_forks(ps: int) -> None:
    """Conversations that only ever extend their previous prompt: the same evictions."""
    survivors = {}
    for policy in (EvictionPolicy.LRU, EvictionPolicy.FORK_AWARE):
        h = Harness(ps, kv_size=24 * ps, eviction_policy=policy)
        contexts = [seq(10_000 * (u + 1), 1, ps) for u in range(4)]
        for step in range(30):
            u = (step * 7) % 4
            contexts[u] = contexts[u] + seq(10_000 * (u + 1) + 100 * step, 1, ps)
            if h.cache.token_to_kv_pool_allocator.available_size() < len(contexts[u]):
                _evict(h, len(contexts[u]))
            h.insert(contexts[u])
        survivors[policy] = [h.match_len(c) for c in contexts]
    assert survivors[EvictionPolicy.LRU] == survivors[EvictionPolicy.FORK_AWARE]


class _Future:
    def __init__(self, next_use: dict[int, int]) -> None:
        self.table = next_use

    def next_use(self, node: TreeNode) -> int:
        return self.table.get(node.key[0], 1 << 30)


def test_belady_evicts_the_furthest_next_use_first() -> None:
    future = _Future({0: 5, 100: 50, 200: 9})
    h = Harness(1, eviction_policy=EvictionPolicy.BELADY, next_use=future)
    for start in (0, 100, 200):
        h.insert(seq(start, 4, 1))
    assert _evict(h, 4) == 4
    assert [h.match_len(seq(s, 4, 1)) for s in (0, 100, 200)] == [4, 0, 4]


def test_belady_rekeys_a_leaf_whose_next_use_moved_on_release() -> None:
    future = _Future({0: 5, 100: 50})
    h = Harness(1, eviction_policy=EvictionPolicy.BELADY, next_use=future)
    h.insert(seq(0, 4, 1))
    h.insert(seq(100, 4, 1))
    m = h.match(seq(0, 4, 1))
    receipt = h.cache.inc_lock_ref(m.last_device_node)
    future.table[0] = 500  # used now: its next use is far away
    h.cache.dec_lock_ref(m.last_device_node, receipt.to_dec_params())
    h.check()
    assert _evict(h, 4) == 4
    assert h.match_len(seq(0, 4, 1)) == 0 and h.match_len(seq(100, 4, 1)) == 4


def test_belady_needs_an_oracle_and_only_belady_takes_one() -> None:
    with pytest.raises(ConfigError):
        CacheConfig(eviction_policy=EvictionPolicy.BELADY)
    with pytest.raises(ConfigError):
        CacheConfig(next_use=_Future({}))
    with pytest.raises(ConfigError):
        make_strategy(EvictionPolicy.BELADY)
    with pytest.raises(ConfigError):
        make_strategy(EvictionPolicy.LRU, _Future({}))


def test_every_policy_has_a_strategy() -> None:
    for policy in EvictionPolicy:
        oracle = _Future({}) if policy is EvictionPolicy.BELADY else None
        assert callable(make_strategy(policy, oracle).key_function())
    assert isinstance(make_strategy(EvictionPolicy.LRU), LruStrategy)
    assert isinstance(make_strategy(EvictionPolicy.FORK_AWARE), ForkAwareStrategy)


def test_belady_rekeys_the_lower_half_of_a_split() -> None:
    """A split moves a node's first token: a key read from it changes, so the lower half
    needs a fresh heap entry (else it hides behind its old key)."""
    future = _Future({0: 5, 4: 1000, 100: 100})
    h = Harness(1, eviction_policy=EvictionPolicy.BELADY, next_use=future)
    h.insert(list(range(8)))
    h.insert(seq(100, 4, 1))
    h.match([0, 1, 2, 3, 99])  # splits [0, 8) at 4: the lower half starts with token 4
    assert _evict(h, 4) == 4
    assert h.match_len(list(range(8))) == 4 and h.match_len(seq(100, 4, 1)) == 4


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_fork_aware_partial_eviction_keeps_taking_the_left_branch(ps: int) -> None:
    """A left branch evicted a page at a time stays first in line until it is gone."""
    h = Harness(ps, eviction_policy=EvictionPolicy.FORK_AWARE, partial_leaf_eviction=True)
    other = seq(5000, 3, ps)
    turn1 = seq(0, 2, ps) + seq(100, 3, ps)
    turn2 = seq(0, 2, ps) + seq(200, 3, ps)
    h.insert(other)
    h.insert(turn1)
    h.insert(turn2)
    for _ in range(3):  # (no match in between: a match is a use, and unmarks the branch)
        assert _evict(h, ps) == ps
    assert h.match_len(turn1) == 2 * ps  # the whole left tail, and nothing else
    assert h.match_len(other) == 3 * ps and h.match_len(turn2) == 5 * ps
