"""Host pages as flat byte rows: the unit a storage page holds, per component of a cache."""

from __future__ import annotations

import torch

from hicache._cpu_copy import runs
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
    buffer by buffer, of ``[split, page_size, mid, inner]`` blocks: ``PAGE_FIRST`` order
    whatever the pool's :class:`~hicache.host_layout.HostLayout`
    (:meth:`~hicache.host_pool.HostPool.page_views`), so pools of either layout read each
    other's pages.  A KV page's row is its K block ``[page_size, layers, heads, dim]`` then
    its V block: SGLang's ``page_first`` data page.  :meth:`gather` copies pages out into a
    ``[pages, page_bytes]`` uint8 tensor; :meth:`scatter` copies rows back.
    """

    def __init__(self, pool: HostPool) -> None:
        self.page_size = pool.page_size
        self.views = pool.page_views()  # [split, units, page_size, mid, inner bytes] each
        self.page_bytes = sum(v[:, 0].numel() for v in self.views)
        # Each buffer's block of a row, copied in the widest words its offset and sizes allow
        # (a byte-wise strided copy runs at a tenth of the speed).
        self._blocks: list[tuple[int, int, torch.Tensor]] = []
        off = 0
        for v in self.views:
            size = v[:, 0].numel()
            word = next(w for w in (8, 4, 2, 1) if (off | self.page_bytes | v.shape[4]) % w == 0)
            self._blocks.append((off // word, size // word, v.view(_WORDS[word])))
            off += size

    def units(self, host_indices: torch.Tensor) -> torch.Tensor:
        """Page numbers of page-aligned host slot indices."""
        ps = self.page_size
        return host_indices if ps == 1 else torch.div(host_indices[::ps], ps, rounding_mode="floor")

    def gather(self, host_indices: torch.Tensor) -> torch.Tensor:
        """The pages of ``host_indices`` as ``[pages, page_bytes]`` uint8 rows (a copy)."""
        unit_runs = runs(self.units(host_indices).numpy())
        n = sum(length for _, length, _ in unit_runs)
        out = torch.empty((n, self.page_bytes), dtype=torch.uint8)
        for off, size, v in self._blocks:
            block = out.view(v.dtype)[:, off : off + size].view(n, v.shape[0], *v.shape[2:])
            for pos, length, start in unit_runs:  # one strided copy per run of host pages
                block[pos : pos + length].copy_(v[:, start : start + length].transpose(0, 1))
        return out

    def scatter(self, rows: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Copy ``[pages, page_bytes]`` rows into the pages of ``host_indices``."""
        unit_runs = runs(self.units(host_indices).numpy())
        n = int(rows.shape[0])
        for off, size, v in self._blocks:
            block = rows.view(v.dtype)[:, off : off + size].view(n, v.shape[0], *v.shape[2:])
            for pos, length, start in unit_runs:
                v[:, start : start + length].copy_(block[pos : pos + length].transpose(0, 1))


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


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
