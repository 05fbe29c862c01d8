"""The HiCache round trip the transfer-engine, host-sync and CUDA tests run on one cache:
insert two sharing keys, back everything up, evict it, forget the device bytes, load both
back.  Device bytes are snapshotted before and after (compare them outside any guard)."""

from __future__ import annotations

from hicache_harness import (
    Snapshot,
    check,
    demote_all,
    insert,
    match,
    path_to,
    seq,
    snapshot,
    zero_device,
)

from urc import UnifiedRadixCache

__all__ = ["round_trip"]


def round_trip(cache: UnifiedRadixCache, ps: int) -> list[tuple[Snapshot, Snapshot]]:
    """``(before, after)`` device snapshots of both keys (``check`` after every step)."""
    a = seq(0, 8, ps)
    b = a[: 4 * ps] + seq(1000, 4, ps)
    assert insert(cache, a) and insert(cache, b)
    before = []
    for tokens in (a, b):
        m = match(cache, tokens)
        assert m.device_indices.shape[0] == len(tokens)
        before.append(snapshot(cache, m.last_device_node))
    if cache.supports_mamba():
        assert all(s.mamba for s in before)
    if cache.supports_swa():
        assert all(any(s.swa_mask) for s in before)
    demote_all(cache)
    zero_device(cache)
    after = []
    for tokens in (a, b):
        m = match(cache, tokens)
        host_only = sum(n.key_len for n in path_to(m.best_match_node) if n.evicted)
        assert host_only == (len(tokens) if tokens is a else 4 * ps)
        assert cache.load_back(m.best_match_node) == host_only
        check(cache)
        m = match(cache, tokens)
        assert m.device_indices.shape[0] == len(tokens) and m.host_hit_length == 0
        after.append(snapshot(cache, m.last_device_node))
    return list(zip(before, after, strict=True))
