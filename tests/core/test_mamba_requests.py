"""MAMBA request caching: donation of the live state, ping-pong tracking buffers, cleanup.

Every step ends with ``sanity_check()`` and pool conservation (see ``mamba_harness``).
"""

from __future__ import annotations

import pytest
from mamba_harness import (
    MAMBA,
    Server,
    check,
    comp,
    insert_state,
    make,
    match,
    pages,
    pool_of,
    state_at,
    state_is,
)

from urc import (
    Req,
)
from urc.errors import (
    InvalidInputError,
    OutOfMemoryError,
)


# ---------------------------------------------------------------------------- request caching
@pytest.mark.parametrize("ps", [1, 4, 64])
def test_finished_request_without_buffer_donates_its_live_state(ps: int) -> None:
    cache = make(ps)
    srv = Server(cache)
    seq = pages(ps, 1, 2, 3)
    req = srv.start(seq)
    srv.check()
    srv.compute(req, len(seq))
    slot = int(req.mamba_pool_idx)  # type: ignore[arg-type]
    srv.finish(req)
    srv.check()
    node = match(cache, seq).last_device_node
    assert node.key_len == len(seq) and state_at(cache, node) == slot
    assert state_is(cache, slot, seq)
    # The same prompt again: a hit, then mamba_exist -> its own slot is freed on finish.
    req2 = srv.start(seq + pages(ps, 4))
    assert req2.cache_protected_len == len(seq)
    srv.compute(req2, len(seq))  # nothing new computed: its state is still at len(seq)
    req2.kv_committed_len = len(seq)
    srv.finish(req2)
    srv.check()
    assert pool_of(cache).num_tree_owned() == 1


def test_finished_request_with_unaligned_length_caches_no_state() -> None:
    cache = make(4)
    srv = Server(cache)
    seq = [*pages(4, 1, 2), 7, 8]  # 10 tokens: the live state is not at a page boundary
    req = srv.start(seq)
    srv.compute(req, len(seq))
    srv.finish(req)
    srv.check()
    assert cache.total_size() == 8 and pool_of(cache).num_tree_owned() == 0
    assert match(cache, seq).device_indices.shape[0] == 0


@pytest.mark.parametrize("ps", [1, 4, 64])
def test_ping_pong_unfinished_donates_and_refills(ps: int) -> None:
    cache = make(ps, kv_pages=64)
    srv = Server(cache)
    seq = pages(ps, *range(1, 9))  # 8 pages
    req = srv.start(seq, buffer=2)
    srv.check()
    srv.compute(req, 5 * ps + (ps // 2), track=4 * ps)  # snapshot at 4 pages
    buf_before = req.mamba_ping_pong_track_buffer.tolist()  # type: ignore[union-attr]
    keep = (req.mamba_next_track_idx - 1) % 2
    donated = buf_before[keep]
    srv.unfinished(req)
    srv.check()
    # The key was truncated to the snapshot; the tree adopted the tracked slot ...
    assert req.cache_protected_len == 4 * ps and req.last_node is not None
    assert state_at(cache, req.last_node) == donated and state_is(cache, donated, seq[: 4 * ps])
    assert req.last_node.data[MAMBA].lock_ref == 1  # type: ignore[union-attr]
    # ... and the buffer got a fresh slot in its place; the snapshot position was reset.
    buf_after = req.mamba_ping_pong_track_buffer.tolist()  # type: ignore[union-attr]
    assert buf_after[1 - keep] == buf_before[1 - keep] and buf_after[keep] != donated
    assert req.mamba_last_track_seqlen is None
    # More chunks; finish with a snapshot at 8 pages.
    srv.compute(req, 8 * ps, track=8 * ps)
    srv.finish(req)
    srv.check()
    assert pool_of(cache).num_tree_owned() == 2
    r = match(cache, seq)
    assert r.device_indices.shape[0] == 8 * ps
    assert state_is(cache, state_at(cache, r.last_device_node), seq)  # type: ignore[arg-type]


def test_ping_pong_unfinished_over_existing_state_frees_the_donated_slot() -> None:
    cache = make(1)
    srv = Server(cache)
    seq = list(range(1, 9))
    insert_state(cache, seq[:4])
    req = srv.start(seq, buffer=2, reuse=False)  # recomputes from scratch: protected 0
    srv.compute(req, 6, track=4)
    assert req.cache_protected_len == 0
    srv.unfinished(req)  # the node at 4 already has a state: mamba_exist
    srv.check()
    assert req.cache_protected_len == 4 and pool_of(cache).num_tree_owned() == 1
    srv.finish(req, is_insert=False)
    srv.check()


def test_ping_pong_without_snapshot_caches_nothing() -> None:
    cache = make(1)
    srv = Server(cache)
    seq = list(range(1, 9))
    req = srv.start(seq, buffer=1)
    srv.compute(req, 8)
    srv.unfinished(req)  # no snapshot: nothing to cache
    srv.check()
    assert cache.total_size() == 0 and req.cache_protected_len == 0
    srv.finish(req)
    srv.check()
    assert cache.total_size() == 0 and pool_of(cache).available_size() == 20


@pytest.mark.parametrize("ps", [1, 4])
def test_unfinished_without_buffer_forks_the_live_state(ps: int) -> None:
    cache = make(ps)
    srv = Server(cache)
    seq = pages(ps, 1, 2, 3, 4)
    req = srv.start(seq)
    srv.compute(req, 2 * ps)
    live = int(req.mamba_pool_idx)  # type: ignore[arg-type]
    srv.unfinished(req)
    srv.check()
    node = req.last_node
    assert node is not None and req.cache_protected_len == 2 * ps
    fork = state_at(cache, node)
    assert fork is not None and fork != live and state_is(cache, fork, seq[: 2 * ps])
    assert int(req.mamba_pool_idx) == live  # type: ignore[arg-type]
    srv.compute(req, 4 * ps)
    srv.finish(req)
    srv.check()
    assert pool_of(cache).num_tree_owned() == 2


def test_finished_no_insert_frees_every_slot() -> None:
    cache = make(1)
    srv = Server(cache)
    req = srv.start(list(range(1, 9)), buffer=2)
    srv.compute(req, 8, track=8)
    srv.finish(req, is_insert=False)
    srv.check()
    assert pool_of(cache).available_size() == 20 and cache.total_size() == 0


def test_donation_needs_a_slot_and_falls_back_gracefully() -> None:
    cache = make(1, mamba_size=3)
    srv = Server(cache)
    seq = list(range(1, 9))
    req = srv.start(seq, buffer=2)  # holds all three slots; nothing is evictable
    srv.compute(req, 8, track=4)
    srv.unfinished(req)  # no fresh slot: KV is cached, the snapshot is not donated
    srv.check()
    assert req.cache_protected_len == 4 and pool_of(cache).num_tree_owned() == 0
    srv.finish(req)
    srv.check()


def test_alloc_helpers_raise_when_out_of_slots() -> None:
    cache = make(1, mamba_size=2)
    m = comp(cache)
    req = Req("x", [1])
    m.alloc_track_buffer(req, 2)
    other = Req("y", [2])
    with pytest.raises(OutOfMemoryError):
        m.alloc_req_slot(other)
    with pytest.raises(OutOfMemoryError):
        m.alloc_track_buffer(other, 1)
    with pytest.raises(InvalidInputError):
        m.alloc_track_buffer(req, 1)  # already has one
    check(cache, (req,))
    m.free_req_slots(req)
    check(cache)


@pytest.mark.parametrize("ps", [4, 16])
def test_unaligned_track_seqlen_is_aligned_down_to_a_page(ps: int) -> None:
    cache = make(ps, kv_pages=64)
    srv = Server(cache)
    seq = pages(ps, *range(1, 7))  # 6 pages
    req = srv.start(seq, buffer=2)
    srv.compute(req, len(seq), track=4 * ps + ps // 2)  # a snapshot mid-page
    srv.finish(req)
    srv.check()
    assert match(cache, seq).device_indices.shape[0] == 4 * ps  # the state's page boundary
