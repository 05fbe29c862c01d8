"""Unified Radix Cache: one prefix tree for full-attention KV, sliding-window KV and Mamba state.

The synchronous core is :class:`UnifiedRadixCache` (SGLang-compatible surface); build one with
:func:`build_cache` from a :class:`CacheConfig`; the async service is
:class:`AsyncUnifiedRadixCache`.

The names below are imported on first use (PEP 562), so ``import urc`` -- and ``urc --help``
-- does not pay for torch and anyio until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "UnifiedRadixCache": "urc.cache",
    "CacheConfig": "urc.config",
    "CachePools": "urc.pools.cache_pools",
    "EvictionPolicy": "urc.eviction_policy",
    "build_cache": "urc.cache",
    "build_pools": "urc.config",
    "ConfigError": "urc.errors",
    "DoubleFreeError": "urc.errors",
    "InvalidIndicesError": "urc.errors",
    "InvalidInputError": "urc.errors",
    "InvalidLockError": "urc.errors",
    "KeyValueMismatchError": "urc.errors",
    "LeaseError": "urc.errors",
    "OutOfMemoryError": "urc.errors",
    "PoolError": "urc.errors",
    "ServiceClosedError": "urc.errors",
    "ServiceError": "urc.errors",
    "ServiceFailedError": "urc.errors",
    "URCError": "urc.errors",
    "RadixKey": "urc.key",
    "DecLockRefParams": "urc.params",
    "DecLockRefResult": "urc.params",
    "EvictParams": "urc.params",
    "EvictResult": "urc.params",
    "IncLockRefResult": "urc.params",
    "InsertParams": "urc.params",
    "InsertResult": "urc.params",
    "MatchPrefixParams": "urc.params",
    "MatchResult": "urc.params",
    "KVShape": "urc.pools.kv_pool",
    "MambaSpec": "urc.specs",
    "SlidingWindowSpec": "urc.specs",
    "WalkImpl": "urc.fastpath",
    "Req": "urc.req",
    "ComponentType": "urc.node",
    "Tier": "urc.node",
    "TreeNode": "urc.node",
    "CommandKind": "urc.service",
    "InsertOutcome": "urc.service",
    "MatchOutcome": "urc.service",
    "Lease": "urc.service",
    "NodeHandle": "urc.service",
    "ServiceObserver": "urc.service",
    "TransferKind": "urc.service",
    "AsyncUnifiedRadixCache": "urc.service",
    "BackgroundWorker": "urc.service",
    "ServiceState": "urc.service",
}

# ``_EXPORTS`` is the list of public names; ``__all__`` and the ``TYPE_CHECKING`` imports
# below (for linters and type checkers) repeat it, and ``tests/test_public_api.py`` checks
# that the three agree.
__all__ = [
    "AsyncUnifiedRadixCache",
    "BackgroundWorker",
    "CacheConfig",
    "CachePools",
    "CommandKind",
    "ComponentType",
    "ConfigError",
    "DecLockRefParams",
    "DecLockRefResult",
    "DoubleFreeError",
    "EvictParams",
    "EvictResult",
    "EvictionPolicy",
    "IncLockRefResult",
    "InsertOutcome",
    "InsertParams",
    "InsertResult",
    "InvalidIndicesError",
    "InvalidInputError",
    "InvalidLockError",
    "KVShape",
    "KeyValueMismatchError",
    "Lease",
    "LeaseError",
    "MambaSpec",
    "MatchOutcome",
    "MatchPrefixParams",
    "MatchResult",
    "NodeHandle",
    "OutOfMemoryError",
    "PoolError",
    "RadixKey",
    "Req",
    "ServiceClosedError",
    "ServiceError",
    "ServiceFailedError",
    "ServiceObserver",
    "ServiceState",
    "SlidingWindowSpec",
    "Tier",
    "TransferKind",
    "TreeNode",
    "URCError",
    "UnifiedRadixCache",
    "WalkImpl",
    "build_cache",
    "build_pools",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'urc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from urc.cache import (
        UnifiedRadixCache,
        build_cache,
    )
    from urc.config import CacheConfig, build_pools
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
    from urc.eviction_policy import EvictionPolicy
    from urc.fastpath import WalkImpl
    from urc.key import (
        RadixKey,
    )
    from urc.node import ComponentType, Tier, TreeNode
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
    from urc.pools.cache_pools import CachePools
    from urc.pools.kv_pool import (
        KVShape,
    )
    from urc.req import (
        Req,
    )
    from urc.service import (
        AsyncUnifiedRadixCache,
        BackgroundWorker,
        CommandKind,
        InsertOutcome,
        Lease,
        MatchOutcome,
        NodeHandle,
        ServiceObserver,
        ServiceState,
        TransferKind,
    )
    from urc.specs import MambaSpec, SlidingWindowSpec
