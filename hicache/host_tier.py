"""``HostMemoryTier``: the host tier (HiCache L2) the core moves data through.

One :class:`~hicache.host_pool.HostPool` per component mirrors that component's device pool
(Full KV, SWA KV, Mamba states).  It implements the core's ``urc.host_protocol.HostTier`` protocol:
allocation bookkeeping is called from the tree's owner only; ``backup``/``load`` copy bytes and
may run in a worker thread (each copy touches only the slots of its own transfer) and return
the transfer's completion (:mod:`hicache.transfer_engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hicache.config import HiCacheConfig
from hicache.host_pool import HostPool
from hicache.transfer_engine import Completion, Lane, TransferEngine
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError
from urc.node import ComponentType, SizeUnit

__all__ = ["HostMemoryTier", "attach_hicache"]


class HostMemoryTier:
    """Host pools for every component of a cache (see the module docstring)."""

    def __init__(self, pools: dict[ComponentType, HostPool]) -> None:
        self.pools = pools

    @classmethod
    def for_cache(
        cls,
        cache: UnifiedRadixCache,
        config: HiCacheConfig,
        engine: TransferEngine | None = None,
    ) -> HostMemoryTier:
        """Mirror every device pool of ``cache`` with the sizes ``config`` asks for;
        ``engine``: where the copies run (default: the one for the pools' device)."""
        pools: dict[ComponentType, HostPool] = {}
        for c in cache.components:
            buffers = c.host_mirror_buffers()
            if buffers is None:
                raise ConfigError(f"{c.component_type.name} has no device buffers to mirror")
            page = cache.page_size if c.unit is SizeUnit.TOKENS else 1
            size = config.host_size(c.pool_capacity(), page, c.unit)
            pools[c.component_type] = HostPool(
                buffers, size, page, engine=engine, layout=config.host_layout
            )
        return cls(pools)

    def host_capacity(self, ct: ComponentType) -> int:
        return self.pools[ct].size

    def host_available(self, ct: ComponentType) -> int:
        return self.pools[ct].allocator.available_size()

    def host_alloc(self, ct: ComponentType, n: int) -> torch.Tensor | None:
        return self.pools[ct].allocator.alloc(n)

    def host_free(self, ct: ComponentType, indices: torch.Tensor) -> None:
        self.pools[ct].allocator.free(indices)

    def backup(self, ct: ComponentType, device: torch.Tensor, host: torch.Tensor) -> Completion:
        return self.pools[ct].backup(device, host)

    def load(self, ct: ComponentType, host: torch.Tensor, device: torch.Tensor) -> Completion:
        return self.pools[ct].load(host, device)

    def load_buffers(
        self,
        ct: ComponentType,
        host: torch.Tensor,
        device: torch.Tensor,
        buffers: Sequence[int] | None = None,
    ) -> None:
        """Copy ``ct``'s host slots back to device for the device buffers numbered
        ``buffers`` only, on the calling thread (:meth:`HostPool.load_buffers`)."""
        self.pools[ct].load_buffers(host, device, buffers)

    def submit(self, lane: Lane, work: Callable[[], Any]) -> Completion:
        """Run ``work`` on the pools' transfer engine, on ``lane`` (its worker thread on a
        :class:`~hicache.transfer_engine.ThreadTransferEngine`); returns its completion."""
        return next(iter(self.pools.values())).engine.submit(lane, work)

    def usage(self, ct: ComponentType = ComponentType.FULL) -> float:
        """Fraction of ``ct``'s host pool in use."""
        pool = self.pools[ct]
        return 1.0 - pool.allocator.available_size() / pool.size


def attach_hicache(
    cache: UnifiedRadixCache, config: HiCacheConfig, engine: TransferEngine | None = None
) -> HostMemoryTier:
    """Build the host tier for ``cache`` (copies on ``engine``: see
    :meth:`HostMemoryTier.for_cache`) and attach it with ``config.write_policy``."""
    tier = HostMemoryTier.for_cache(cache, config, engine)
    cache.attach_host_tier(tier, config.write_policy)
    return tier
