"""Device pools and allocators (token slots, KV tensors, request rows)."""

from __future__ import annotations

from urc.pools.allocator import TokenSlotAllocator
from urc.pools.kv_pool import KVPool, KVShape
from urc.pools.req_to_token import ReqToTokenPool

__all__ = ["KVPool", "KVShape", "ReqToTokenPool", "TokenSlotAllocator"]
