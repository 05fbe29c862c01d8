"""``CachePools``: the device pools one cache frees into and copies from."""

from __future__ import annotations

from dataclasses import dataclass

from urc.pools.allocator import TokenSlotAllocator
from urc.pools.kv_pool import KVPool
from urc.pools.mamba import MambaPool
from urc.pools.req_to_token import ReqToTokenPool
from urc.pools.swa import SWAKVPool

__all__ = ["CachePools"]


@dataclass(slots=True)
class CachePools:
    """The device pools a cache frees into and copies from.

    ``token_allocator`` hands out Full KV slots (for hybrid SWA models it is the paired
    allocator that also takes an SWA slot per token).  ``swa`` and ``mamba`` hold the
    auxiliary pools of those components (``None`` when absent); each component's spec
    builds its own (:meth:`urc.specs.SlidingWindowSpec.build_pools`).
    """

    token_allocator: TokenSlotAllocator
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool | None = None
    swa: SWAKVPool | None = None
    mamba: MambaPool | None = None
