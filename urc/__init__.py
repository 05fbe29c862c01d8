"""Unified Radix Cache: one prefix tree for full-attention KV, sliding-window KV and Mamba state.

The synchronous core is :class:`UnifiedRadixCache` (SGLang-compatible surface); build one with
:func:`build_cache` from a :class:`CacheConfig`.
"""

from __future__ import annotations

from urc.cache import UnifiedRadixCache
from urc.config import CacheConfig, CachePools, EvictionPolicy, build_cache, build_pools
from urc.errors import (
    ConfigError,
    DoubleFreeError,
    InvalidIndicesError,
    InvalidInputError,
    InvalidLockError,
    KeyValueMismatchError,
    LeaseError,
    OutOfMemoryError,
    PoolError,
    ServiceClosedError,
    ServiceError,
    ServiceFailedError,
    URCError,
)
from urc.key import RadixKey
from urc.params import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from urc.pools.kv_pool import KVShape
from urc.req import Req
from urc.tree import ComponentType, Tier, TreeNode

__all__ = [
    "CacheConfig",
    "CachePools",
    "ComponentType",
    "ConfigError",
    "DecLockRefParams",
    "DecLockRefResult",
    "DoubleFreeError",
    "EvictParams",
    "EvictResult",
    "EvictionPolicy",
    "IncLockRefResult",
    "InsertParams",
    "InsertResult",
    "InvalidIndicesError",
    "InvalidInputError",
    "InvalidLockError",
    "KVShape",
    "KeyValueMismatchError",
    "LeaseError",
    "MatchPrefixParams",
    "MatchResult",
    "OutOfMemoryError",
    "PoolError",
    "RadixKey",
    "Req",
    "ServiceClosedError",
    "ServiceError",
    "ServiceFailedError",
    "Tier",
    "TreeNode",
    "URCError",
    "UnifiedRadixCache",
    "build_cache",
    "build_pools",
]

# The async service (issue 5).
from urc.commands import CommandKind, InsertOutcome, MatchOutcome
from urc.lease import Lease, NodeHandle
from urc.observer import ServiceObserver, TransferKind
from urc.service import AsyncUnifiedRadixCache, BackgroundWorker, ServiceState

__all__ += [
    "AsyncUnifiedRadixCache",
    "BackgroundWorker",
    "CommandKind",
    "InsertOutcome",
    "Lease",
    "MatchOutcome",
    "NodeHandle",
    "ServiceObserver",
    "ServiceState",
    "TransferKind",
]
