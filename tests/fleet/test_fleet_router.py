"""The router's parts without sockets: the policies' choices, the event index, the prefix
hasher (SGLang's block hashes, reused across a session's prompts)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from urc.apps.fleet.index import PrefixHasher, ReplicaIndex
from urc.apps.fleet.policy import Router, RouterPolicy, RoutingParams
from urc.kv_events import hash_to_int64, page_digests


def _router(policy: RouterPolicy, n: int = 4, **kw: float) -> Router:
    return Router(policy, n, RoutingParams(**kw))  # type: ignore[arg-type]


def test_round_robin_takes_replicas_in_turn() -> None:
    r = _router(RouterPolicy.ROUND_ROBIN, 3)
    assert [r.choose(0, 10, [0, 0, 0], "k") for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_picks_the_lightest_and_forgets_load_past_the_window() -> None:
    r = _router(RouterPolicy.LEAST_LOADED, 3, load_window_s=10.0)
    picks = []
    for i, tokens in enumerate([100, 50, 10, 5]):
        c = r.choose(i, tokens, [0, 0, 0], "k")
        r.routed(i, c, tokens)
        picks.append(c)
    assert picks == [0, 1, 2, 2]  # 2 holds 10 (then 15): still the lightest
    # 11 s later every routed prompt has left the window: all loads are 0 again.
    assert r.choose(11_000, 1, [0, 0, 0], "k") == 0


def test_session_affinity_is_sticky_and_spreads_keys() -> None:
    r = _router(RouterPolicy.SESSION_AFFINITY, 4)
    first = {f"s{i}": r.choose(0, 1, [0] * 4, f"s{i}") for i in range(200)}
    again = {k: r.choose(1, 1, [100, 0, 0, 0], k) for k in first}  # overlap is ignored
    assert again == first
    counts = [list(first.values()).count(n) for n in range(4)]
    assert min(counts) >= 25, counts  # rendezvous hashing spreads 200 keys over 4


@pytest.mark.parametrize(
    ("overlaps", "loads", "weight", "expected"),
    [
        ([0, 800, 0, 0], [0, 0, 0, 0], 1.0, 1),  # equal load: the overlap wins
        ([0, 800, 0, 0], [0, 900, 0, 0], 1.0, 0),  # the load costs more than the overlap saves
        ([0, 800, 0, 0], [0, 700, 0, 0], 1.0, 1),  # ... or less
        ([0, 800, 0, 0], [0, 900, 0, 0], 2.0, 1),  # a heavier overlap weight keeps it
        ([0, 800, 0, 0], [0, 1, 0, 0], 0.0, 0),  # weight 0: pure load balancing
        ([300, 300, 0, 0], [0, 0, 0, 0], 1.0, 0),  # ties: the lowest index
    ],
)
def test_kv_aware_trades_overlap_against_load(
    overlaps: list[int], loads: list[int], weight: float, expected: int
) -> None:
    r = _router(RouterPolicy.KV_AWARE, 4, overlap_weight=weight)
    for replica, load in enumerate(loads):
        if load:
            r.routed(0, replica, load)
    assert r.choose(1, 1000, overlaps, "k") == expected


def test_random_is_seeded_and_reaches_every_replica() -> None:
    picks = [_router(RouterPolicy.RANDOM, 4, seed=7) for _ in range(2)]
    a = [picks[0].choose(0, 1, [0] * 4, "k") for _ in range(100)]
    b = [picks[1].choose(0, 1, [0] * 4, "k") for _ in range(100)]
    assert a == b and set(a) == {0, 1, 2, 3}


def test_a_fleet_needs_a_replica() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        Router(RouterPolicy.ROUND_ROBIN, 0, RoutingParams())


def test_the_index_follows_stores_removals_and_clears_per_medium() -> None:
    idx = ReplicaIndex()
    idx.apply(
        [
            {"type": "BlockStored", "block_hashes": [1, 2, 3], "medium": "GPU"},
            {"type": "BlockStored", "block_hashes": [4], "parent_block_hash": 3},  # GPU
            {"type": "BlockStored", "block_hashes": [1, 2], "medium": "CPU_PINNED"},
            {"type": "BlockRemoved", "block_hashes": [2, 3], "medium": "GPU"},
            {"type": "BlockStored", "block_hashes": [9], "medium": "DISK"},
        ]
    )
    assert (idx.device, idx.host, idx.ignored) == ({1, 4}, {1, 2}, 1)
    assert idx.overlap([1, 2, 3, 4]) == 2  # 1 on both tiers, 2 on host, 3 nowhere
    assert idx.overlap([5, 1]) == 0
    idx.apply([{"type": "AllBlocksCleared"}])
    assert idx.device == set() and idx.host == set()


def _reference(tokens: list[int], ps: int) -> list[int]:
    full = len(tokens) // ps * ps
    return [hash_to_int64(d) for d in page_digests(tokens[:full], None, ps)]


@given(
    st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=40), min_size=1, max_size=8),
    st.sampled_from([1, 4, 16]),
)
def test_the_hasher_gives_sglang_hashes_however_a_session_prompts_change(
    prompts: list[list[int]], ps: int
) -> None:
    hasher = PrefixHasher(ps, sessions=2)
    for i, prompt in enumerate(prompts):
        session = "abc"[i % 3]  # three sessions through a memo of two: some are dropped
        assert hasher.hashes(prompt, session) == _reference(prompt, ps)
        assert hasher.hashes(prompt) == _reference(prompt, ps)


def test_the_hasher_hashes_only_a_session_prompt_new_pages() -> None:
    hasher = PrefixHasher(4)
    hasher.hashes(list(range(400)), "s")
    before = hasher.hashed
    hasher.hashes([*range(400), *range(1000, 1040)], "s")
    assert hasher.hashed - before == 10
