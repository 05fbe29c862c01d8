"""Test helpers for reuse hints and the policies that use them (``tests/core/test_reuse_hint.py``,
``tests/core/test_return_time_eviction.py``): a small cache, a hinted insert checked after
the step, and sessions as distinct prompts."""

from __future__ import annotations

from typing import Any

import torch

from urc import (
    CacheConfig,
    ComponentType,
    EvictionPolicy,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    UnifiedRadixCache,
    build_cache,
)
from urc.reuse_hint import ReuseHint

__all__ = ["PS", "hint_cache", "insert", "session", "survivors"]

PS = 4
"""The page size of :func:`hint_cache`'s caches."""


def hint_cache(policy: EvictionPolicy, **kw: Any) -> UnifiedRadixCache:
    """A ``PS``-page cache of 64 pages (``kw``: more ``CacheConfig`` fields) with ``policy``."""
    kw.setdefault("kv_size", 64 * PS)
    return build_cache(CacheConfig(page_size=PS, max_num_reqs=4, eviction_policy=policy, **kw))


def insert(cache: UnifiedRadixCache, tokens: list[int], hint: ReuseHint | None = None) -> None:
    """Insert ``tokens`` (what the cache holds of them reused, the rest freshly allocated)
    with ``hint``; then ``sanity_check()`` and Full pool conservation."""
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    prefix = m.device_indices
    own = cache.token_to_kv_pool_allocator.alloc(len(tokens) - prefix.shape[0])
    assert own is not None, f"{len(tokens) - prefix.shape[0]} slots not free"
    cache.insert(
        InsertParams(
            key=RadixKey(tokens),
            value=torch.cat([prefix, own]),
            prev_prefix_len=prefix.shape[0],
            reuse_hint=hint,
        )
    )
    cache.sanity_check()
    cache.check_pools({ComponentType.FULL: 0})


def session(n: int, pages: int = 2) -> list[int]:
    """Session ``n``'s prompt, ``pages`` pages long (sessions share no token)."""
    return [n * 1000 + i for i in range(pages * PS)]


def survivors(cache: UnifiedRadixCache, sessions: list[int]) -> list[int]:
    """Those of ``sessions`` whose (two-page) prompt still hits on device."""
    out = []
    for s in sessions:
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(session(s))))
        if m.device_indices.shape[0]:
            out.append(s)
    return out
