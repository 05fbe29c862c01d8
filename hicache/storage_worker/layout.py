"""Host pages as flat byte rows: the unit a storage page holds, per component of a cache."""

from __future__ import annotations

import torch

from hicache.host_pool import HostPool
from hicache.host_tier import HostMemoryTier
from hicache.storage.keys import StorageComponent
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError
from urc.node import ComponentType, SizeUnit

__all__ = ["STORAGE_COMPONENT", "HostPageLayout", "PageLayouts"]

# The storage key tag of each component the storage tier can store.
STORAGE_COMPONENT = {
    ComponentType.FULL: StorageComponent.FULL,
    ComponentType.SWA: StorageComponent.SWA,
    ComponentType.MAMBA: StorageComponent.MAMBA,
}


class HostPageLayout:
    """Whole pages of a host pool as flat byte rows (the unit a storage page holds).

    A Mamba host pool has pages of one slot: a row is one state (conv + temporal bytes).

    A page of ``page_size`` slots spans every host buffer; its bytes are the concatenation,
    buffer by buffer, of ``[outer, page_bytes_in_buffer]`` blocks.  Host pools are
    ``page_first`` (:mod:`hicache.host_pool`), so a KV page's row is its K block
    ``[page_size, layers, heads, dim]`` then its V block: SGLang's ``page_first`` data page.
    :meth:`gather` copies pages out into a ``[pages, page_bytes]`` uint8 tensor;
    :meth:`scatter` copies rows back.
    """

    def __init__(self, pool: HostPool) -> None:
        self.page_size = pool.page_size
        self.views: list[torch.Tensor] = []
        for buf, dim in pool.host_buffers:
            outer = 1
            for d in buf.shape[:dim]:
                outer *= d
            units = buf.shape[dim] // self.page_size
            self.views.append(buf.view(outer, units, -1).view(torch.uint8))
        self.page_bytes = sum(v.shape[0] * v.shape[2] for v in self.views)

    def units(self, host_indices: torch.Tensor) -> torch.Tensor:
        """Page numbers of page-aligned host slot indices."""
        ps = self.page_size
        return host_indices if ps == 1 else torch.div(host_indices[::ps], ps, rounding_mode="floor")

    def gather(self, host_indices: torch.Tensor) -> torch.Tensor:
        """The pages of ``host_indices`` as ``[pages, page_bytes]`` uint8 rows (a copy)."""
        units = self.units(host_indices)
        n = int(units.shape[0])
        out = torch.empty((n, self.page_bytes), dtype=torch.uint8)
        off = 0
        for v in self.views:
            o, _, b = v.shape
            out[:, off : off + o * b].view(n, o, b).copy_(v.index_select(1, units).permute(1, 0, 2))
            off += o * b
        return out

    def scatter(self, rows: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Copy ``[pages, page_bytes]`` rows into the pages of ``host_indices``."""
        units = self.units(host_indices)
        n = int(units.shape[0])
        off = 0
        for v in self.views:
            o, _, b = v.shape
            v.index_copy_(1, units, rows[:, off : off + o * b].reshape(n, o, b).permute(1, 0, 2))
            off += o * b


class PageLayouts:
    """The page layout of every component's host pool for one cache.

    ``by_type[ct]`` is a component's layout, ``full`` the Full one; ``aux`` lists the
    auxiliary components (all but Full) and ``per_token[ct]`` whether a component holds
    per-token data (else per-position states, one host unit each).  Raises
    :class:`~urc.errors.ConfigError` for a component the storage tier cannot store.
    """

    __slots__ = ("aux", "by_type", "full", "page_size", "per_token")

    def __init__(self, cache: UnifiedRadixCache, tier: HostMemoryTier) -> None:
        for c in cache.components:
            if c.component_type not in STORAGE_COMPONENT or c.component_type not in tier.pools:
                raise ConfigError(f"the storage tier cannot store {c.component_type.name}")
        self.by_type = {
            c.component_type: HostPageLayout(tier.pools[c.component_type]) for c in cache.components
        }
        self.full = self.by_type[ComponentType.FULL]
        self.aux = [
            c.component_type for c in cache.components if c.component_type is not ComponentType.FULL
        ]
        self.per_token = {c.component_type: c.unit is SizeUnit.TOKENS for c in cache.components}
        self.page_size = cache.page_size
