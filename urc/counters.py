"""``CacheCounters``: the cumulative event counters the core increments as it works."""

from __future__ import annotations

from dataclasses import dataclass, field

from urc.node import ComponentType, Tier

__all__ = ["CacheCounters"]


@dataclass(slots=True)
class CacheCounters:
    """Cumulative event counters the core increments (monotonic; never reset by reads).

    ``hit_tokens`` is indexed by :class:`~urc.node.Tier` (every tier present); ``evicted`` by
    (component, tier) in that component's unit.
    """

    match_requests: int = 0
    query_tokens: int = 0
    hit_tokens: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    inserted_tokens: int = 0
    evicted: dict[tuple[ComponentType, Tier], int] = field(default_factory=dict)
    backed_up_tokens: int = 0
    loaded_back_tokens: int = 0
