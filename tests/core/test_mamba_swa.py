"""Mamba next to SWA: an early window release drops the co-located Mamba lock, and Mamba locks
only where SWA can."""

from __future__ import annotations

import pytest
from mamba_harness import (
    FULL,
    MAMBA,
    insert_state,
    match,
    pool_of,
    state_at,
)

from urc import (
    CacheConfig,
    ComponentType,
    InsertParams,
    RadixKey,
    UnifiedRadixCache,
    build_cache,
)
from urc.specs import MambaSpec, SlidingWindowSpec


# ---------------------------------------------------------------------------- scenarios
# ---------------------------------------------------------------------------- with SWA
def _has_swa() -> bool:
    try:
        from urc.components import component_class

        component_class(ComponentType.SWA)
    except ImportError:
        return False
    return True


needs_swa = pytest.mark.skipif(not _has_swa(), reason="the SWA component is not in this tree")


def make_swa(ps: int = 1, window: int = 4) -> UnifiedRadixCache:
    return build_cache(
        CacheConfig(
            components=(
                FULL,
                SlidingWindowSpec(window),
                MambaSpec(size=20, chunk_size=4 * ps),
            ),
            page_size=ps,
            kv_size=128 * ps,
            max_num_reqs=10,
            max_context_len=64 * ps,
        )
    )


@needs_swa
def test_swa_early_release_drops_the_co_located_mamba_lock() -> None:
    cache = make_swa()
    insert_state(cache, list(range(1, 9)))
    node = match(cache, list(range(1, 9))).last_device_node
    receipt = cache.inc_lock_ref(node)
    assert node.data[MAMBA].lock_ref == 1  # type: ignore[union-attr]
    params = receipt.to_dec_params()
    cache.dec_swa_lock_only(node, params)
    assert node.data[MAMBA].lock_ref == 0 and node.data[FULL].lock_ref == 1  # type: ignore[union-attr]
    assert (cache.mamba_protected_size(), cache.mamba_evictable_size()) == (0, 1)
    cache.sanity_check()
    # The state is evictable again; the final release (skip_swa set) releases Full only.
    cache.dec_lock_ref(node, params)
    assert node.data[FULL].lock_ref == 0  # type: ignore[union-attr]
    cache.sanity_check()
    cache.check_pools()


@needs_swa
def test_no_mamba_lock_where_swa_cannot_lock() -> None:
    """A state on an SWA tombstone (its window was freed while the request ran) is not locked:
    a Mamba lock there would exceed the SWA lock (full >= swa >= mamba)."""
    cache = make_swa(window=4)
    seq = list(range(1, 9))
    value = cache.token_to_kv_pool_allocator.alloc(8)
    t = pool_of(cache).alloc(1)
    assert value is not None and t is not None
    cache.insert(InsertParams(RadixKey(seq), value, mamba_value=t, swa_evicted_seqlen=8))
    leaf = next(n for n in cache.iter_nodes() if not n.children)
    assert state_at(cache, leaf) is not None and leaf.data[ComponentType.SWA].value is None  # type: ignore[union-attr]
    receipt = cache.inc_lock_ref(leaf)
    assert leaf.data[MAMBA].lock_ref == 0  # type: ignore[union-attr]
    assert leaf.id in receipt.skip_lock_node_ids[MAMBA]
    cache.sanity_check()
    cache.dec_lock_ref(leaf, receipt.to_dec_params())
    cache.sanity_check()
    cache.check_pools()
