"""An allocation larger than the whole pool is refused before anything is evicted (issue 50
item 8): sync ``cache.alloc_tokens`` and the service's ``alloc`` raise OutOfMemoryError and
the cached tree stays as it was."""

from __future__ import annotations

import anyio
import pytest

from urc import (
    CacheConfig,
    ComponentType,
    InsertParams,
    MatchPrefixParams,
    OutOfMemoryError,
    RadixKey,
    build_cache,
)
from urc.service import AsyncUnifiedRadixCache
from urc.specs import SlidingWindowSpec

FULL = ComponentType.FULL
SWA = ComponentType.SWA
KV = 1024

CONFIGS = {
    "full": {},
    "swa": {"components": (FULL, SlidingWindowSpec(window=8))},
}


def _fill(cache: object, page_size: int) -> list[list[int]]:
    """Cache 8 unlocked sequences of 64 tokens; returns them."""
    seqs = []
    for i in range(8):
        toks = [i * 1000 + j for j in range(64)]
        v = cache.token_to_kv_pool_allocator.alloc(64)  # type: ignore[attr-defined]
        assert v is not None
        cache.insert(InsertParams(key=RadixKey(toks), value=v))  # type: ignore[attr-defined]
        seqs.append(toks)
    cache.sanity_check()  # type: ignore[attr-defined]
    return seqs


def _cached(cache: object, seqs: list[list[int]]) -> int:
    return sum(
        int(
            cache.match_prefix(  # type: ignore[attr-defined]
                MatchPrefixParams(key=RadixKey(s))
            ).device_indices.shape[0]
        )
        for s in seqs
    )


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("n", [KV + 1, 5000, 70_000])
def test_alloc_larger_than_pool_raises_and_evicts_nothing(
    kind: str, page_size: int, n: int
) -> None:
    cache = build_cache(CacheConfig(page_size=page_size, kv_size=KV, **CONFIGS[kind]))  # type: ignore[arg-type]
    seqs = _fill(cache, page_size)
    before = _cached(cache, seqs)
    assert before == 8 * 64
    with pytest.raises(OutOfMemoryError, match="larger than the whole pool"):
        cache.alloc_tokens(n)
    cache.sanity_check()
    cache.check_pools({FULL: 0})
    assert _cached(cache, seqs) == before  # nothing was evicted


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_that_fits_an_empty_pool_still_evicts(page_size: int) -> None:
    """The refusal is only for what cannot fit at all: the whole pool is still allocatable."""
    cache = build_cache(CacheConfig(page_size=page_size, kv_size=KV))
    seqs = _fill(cache, page_size)
    v = cache.alloc_tokens(KV)
    assert v is not None and v.shape[0] == KV
    assert _cached(cache, seqs) == 0
    cache.token_to_kv_pool_allocator.free(v)
    cache.sanity_check()
    cache.check_pools({FULL: 0})


@pytest.mark.asyncio
async def test_service_alloc_larger_than_pool_raises_and_keeps_cache() -> None:
    with anyio.fail_after(30):
        async with AsyncUnifiedRadixCache(CacheConfig(kv_size=KV, max_num_reqs=8)) as svc:
            toks = list(range(512))
            v = await svc.alloc(512)
            await svc.insert(toks, v)
            with pytest.raises(OutOfMemoryError, match="larger than the whole pool"):
                await svc.alloc(5000)
            assert (await svc.match(toks)).prefix_len == 512
            await svc.sanity_check({FULL: 0})
