"""urc.gc_keys: the tree's keys (packed arrays, bigram lists) stay off the cyclic GC (when
the C helper is built)."""

from __future__ import annotations

import gc
from array import array

import pytest
import torch

from urc import CacheConfig, EvictParams, InsertParams, RadixKey, build_cache
from urc.gc_keys import _keep_tracked, untrack_key

try:
    import urc._native._gckeys  # noqa: F401

    BUILT = True
except ImportError:
    BUILT = False

needs_native = pytest.mark.skipif(not BUILT, reason="urc._native._gckeys not built")


@needs_native
def test_untrack_key_takes_lists_and_arrays_off_the_gc_and_leaves_other_objects_alone() -> None:
    for key in ([1, 2, 3], array("q", [1, 2, 3])):
        assert gc.is_tracked(key)
        untrack_key(key)
        assert not gc.is_tracked(key)
    pair = ([],)
    untrack_key(pair)  # not a list: left as it is
    assert gc.is_tracked(pair)


def test_fallback_keeps_keys_tracked() -> None:
    key = [1, 2, 3]
    _keep_tracked(key)
    assert gc.is_tracked(key)


@needs_native
@pytest.mark.parametrize("page_size", [1, 4])
def test_node_keys_are_untracked_after_insert_split_and_collection(page_size: int) -> None:
    """New leaves, both halves of a split, and the tree stays sound through collections."""
    cache = build_cache(CacheConfig(page_size=page_size, kv_size=64 * page_size))
    alloc = cache.token_to_kv_pool_allocator
    ps = page_size

    def insert(tokens: list[int]) -> None:
        value = alloc.alloc(len(tokens))
        assert value is not None
        cache.insert(InsertParams(key=RadixKey(tokens), value=value))
        gc.collect()
        cache.sanity_check()

    insert(list(range(1000, 1000 + 8 * ps)))
    insert(list(range(1000, 1000 + 4 * ps)) + list(range(5000, 5000 + 4 * ps)))  # a split
    nodes = [n for n in cache.iter_nodes() if n.parent is not None]
    assert len(nodes) == 3
    assert not any(gc.is_tracked(n.key) for n in nodes)
    freed = cache.evict(EvictParams(num_tokens=8 * ps)).num_tokens_evicted
    assert freed == 8 * ps
    gc.collect()
    cache.sanity_check()
    assert isinstance(cache.token_to_kv_pool_allocator.alloc(ps), torch.Tensor)
