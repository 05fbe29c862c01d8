"""A urc replica storing its L3 pages under SGLang's key scheme, for the interop tests.

Full only, any page size, real KV bytes (float16, 3 layers, 2 heads, head dim 4), write-through
host backup and a storage worker with ``StorageConfig(key_scheme=KeyScheme.SGLANG)``.
:func:`sglang_payloads` states SGLang's ``page_first`` page layout independently of urc's
converter: page ``p`` of device data ``kv[2, layers, tokens, heads, dim]`` is
``kv[:, :, p*ps:(p+1)*ps]`` as ``[2, page_size, layers, heads, dim]``, flattened (SGLang's
``MHATokenToKVPoolHost.get_data_page`` on a ``[2, slots, layers, heads, dim]`` buffer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import torch
from cache_harness import pins
from storage_harness import put_random_kv, wait_host_backups

import hicache
from hicache.config import HiCacheConfig, StorageConfig
from hicache.storage.base import StorageBackend
from hicache.storage.keys import KeyScheme
from hicache.storage.sglang_keys import SGLangNaming
from urc import CacheConfig, ComponentType, KVShape, RadixKey, build_cache
from urc.cache import UnifiedRadixCache
from urc.host_protocol import WritePolicy
from urc.service import AsyncUnifiedRadixCache

SHAPE = KVShape(num_layers=3, num_heads=2, head_dim=4, dtype=torch.float16)
FULL = ComponentType.FULL


class Replica:
    """One urc cache + host tier + storage worker over ``store`` (``svc`` not entered)."""

    def __init__(self, store: StorageBackend, page_size: int, naming: SGLangNaming) -> None:
        self.page_size = page_size
        self.cache: UnifiedRadixCache = build_cache(
            CacheConfig(page_size=page_size, kv_size=8 * max(page_size, 16), kv_shape=SHAPE)
        )
        config = StorageConfig(key_scheme=KeyScheme.SGLANG, sglang_naming=naming)
        hc = hicache.attach(
            self.cache,
            HiCacheConfig(
                write_policy=WritePolicy.WRITE_THROUGH, host_tokens=16 * max(page_size, 16)
            ),
            store,
            storage_config=config,
        )
        assert hc.storage is not None
        self.worker = hc.storage
        self.store = store
        self.svc = AsyncUnifiedRadixCache(self.cache, workers=hc.workers)

    @property
    def kv(self) -> torch.Tensor:
        pool = self.cache.pools.kv_pool
        assert pool is not None
        return pool.kv

    async def put(self, tokens: list[int], ns: tuple[str, ...] | None = None) -> torch.Tensor:
        """Insert ``tokens`` with random KV bytes and wait until storage has them; returns
        the bytes (``[2, layers, tokens, heads, dim]``)."""
        data = await put_random_kv(self.svc, self.kv, tokens, ns, SHAPE.dtype)
        await wait_host_backups(self.svc)
        await self.worker.flush()
        return data

    async def fetch(
        self, tokens: list[int], ns: tuple[str, ...] | None = None
    ) -> tuple[int, torch.Tensor]:
        """Fetch ``tokens`` from storage to device; returns the tokens fetched and the
        device bytes of the matched prefix."""
        got = await self.worker.fetch(self.svc, RadixKey(tokens, ns))
        m = await self.svc.match(RadixKey(tokens, ns))
        assert m.prefix_len == got, (m.prefix_len, got)
        return got, self.kv[:, :, m.device_indices].clone()

    async def check(self) -> None:
        await self.svc.sanity_check()
        assert await self.svc.call(pins) == 0


@asynccontextmanager
async def replica(
    store: StorageBackend, page_size: int, naming: SGLangNaming
) -> AsyncIterator[Replica]:
    """A running :class:`Replica`; checks the tree and the pools on the way out."""
    r = Replica(store, page_size, naming)
    async with r.svc:
        with anyio.fail_after(60):
            yield r
            await r.worker.flush()
            await r.check()
    r.cache.sanity_check()
    r.cache.check_pools({FULL: 0}, {FULL: 0})


def sglang_payloads(data: torch.Tensor, page_size: int) -> list[torch.Tensor]:
    """SGLang's ``page_first`` payload of each whole page of device data ``data``."""
    pages = data.shape[2] // page_size
    return [
        data[:, :, p * page_size : (p + 1) * page_size]
        .permute(0, 2, 1, 3, 4)
        .contiguous()
        .flatten()
        for p in range(pages)
    ]


def tokens_of(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (n,), generator=generator).tolist()
