"""Plain snapshots of a cache's sizes and cumulative counters (no Prometheus here).

``UnifiedRadixCache.stats()`` builds a :class:`CacheStats` from integer counters the core keeps
incrementally, so taking one costs O(components), never a tree walk.  Exporters (``metrics/``)
turn snapshots into gauges and counter deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from urc.node import ComponentType, SizeUnit, Tier

if TYPE_CHECKING:
    from urc.components.base import TreeComponent
    from urc.state import CacheState

__all__ = ["CacheStats", "ComponentStats", "StatsSnapshotter"]


@dataclass(frozen=True, slots=True)
class ComponentStats:
    """One component's sizes on one tier, in ``unit`` ("tokens" or "states")."""

    component: ComponentType
    tier: Tier
    unit: SizeUnit
    evictable: int
    protected: int
    capacity: int
    available: int

    @property
    def used(self) -> int:
        return self.capacity - self.available


@dataclass(slots=True)
class CacheStats:
    """A consistent snapshot: per-(component, tier) sizes, node count and counters.

    Treat it as read-only (it is not frozen only because building frozen dataclasses costs
    about a microsecond, paid after every batch of service commands)."""

    components: tuple[ComponentStats, ...]
    num_nodes: int
    match_requests: int
    query_tokens: int
    hit_tokens: dict[Tier, int]
    inserted_tokens: int
    evicted: dict[tuple[ComponentType, Tier], int]
    backed_up_tokens: int
    loaded_back_tokens: int

    def component(self, ct: ComponentType, tier: Tier = Tier.DEVICE) -> ComponentStats | None:
        for s in self.components:
            if s.component is ct and s.tier is tier:
                return s
        return None


class StatsSnapshotter:
    """Takes :class:`CacheStats` snapshots of one cache; O(components) each.

    The per-component part is rebuilt only when a size changed (the service takes a snapshot
    after every batch, and most batches change no size): the last figures and what was built
    from them are kept here."""

    __slots__ = ("_components", "_figs", "_state")

    def __init__(self, state: CacheState) -> None:
        self._state = state
        self._figs: list[int] = []
        self._components: tuple[ComponentStats, ...] = ()

    def take(self) -> CacheStats:
        """A snapshot of the cache now (reads only)."""
        state = self._state
        tiered = state.host_tier is not None
        figs: list[int] = []
        for c in state.components:
            figs += (c.evictable_size, c.protected_size, c.pool_available())
            if tiered:
                figs += (c.host_evictable_size, c.host_protected_size, c.host_available())
        if figs != self._figs:
            self._figs = figs
            self._components = _component_stats(state)
        k = state.counters
        return CacheStats(
            self._components,
            state.tree.num_nodes,
            k.match_requests,
            k.query_tokens,
            dict(k.hit_tokens),
            k.inserted_tokens,
            dict(k.evicted),
            k.backed_up_tokens,
            k.loaded_back_tokens,
        )


def _component_stats(state: CacheState) -> tuple[ComponentStats, ...]:
    tiers = (Tier.DEVICE, Tier.HOST) if state.host_tier is not None else (Tier.DEVICE,)
    return tuple(_stats_of(c, tier) for tier in tiers for c in state.components)


def _stats_of(c: TreeComponent, tier: Tier) -> ComponentStats:
    if tier is Tier.DEVICE:
        sizes = (c.evictable_size, c.protected_size, c.pool_capacity(), c.pool_available())
    else:
        host = c.host_evictable_size, c.host_protected_size
        sizes = (*host, c.host_capacity(), c.host_available())
    return ComponentStats(c.component_type, tier, c.unit, *sizes)
