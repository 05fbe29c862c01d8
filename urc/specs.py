"""Per-component specs: what an auxiliary component needs to know, and the pools it builds.

A config names its components as types or as specs; a spec checks itself and builds its own
pools, so pool building has no per-component branches::

    CacheConfig(components=(FULL, SlidingWindowSpec(window=4096), MambaSpec(size=64)))

is the same config as the flat spelling (kept as a convenience: a spec maps its fields onto
the config's flat fields, :attr:`ComponentSpec.FIELDS`, and back)
``CacheConfig(components=(FULL, SWA, MAMBA), sliding_window_size=4096, mamba_size=64)``.
FULL needs no spec: its pool is the config's ``kv_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from urc.errors import ConfigError
from urc.node import ComponentType
from urc.pools.cache_pools import CachePools
from urc.pools.indices import INDEX_DEVICE
from urc.pools.kv_pool import KVShape
from urc.pools.mamba import MambaPool
from urc.pools.swa import SWAKVPool, SWATokenSlotAllocator

__all__ = ["SPEC_TYPES", "ComponentSpec", "MambaSpec", "PoolContext", "SlidingWindowSpec"]


@dataclass(frozen=True, slots=True)
class PoolContext:
    """What every pool is sized and placed by: the config's Full slots, page size, device
    and KV row shape."""

    kv_size: int
    page_size: int
    device: torch.device
    kv_shape: KVShape


class ComponentSpec(Protocol):
    """An auxiliary component's configuration (frozen)."""

    component_type: ClassVar[ComponentType]
    #: spec attribute -> the flat ``CacheConfig`` field that spells it
    FIELDS: ClassVar[dict[str, str]]

    def validate(self) -> None:
        """Raise :class:`~urc.errors.ConfigError` if the spec is not usable."""

    def build_pools(self, pools: CachePools, ctx: PoolContext) -> None:
        """Allocate this component's pools into ``pools`` (mutates it)."""


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """SWA: ``window`` tokens of sliding-window KV per request; ``kv_size`` SWA slots (the
    config's ``kv_size`` when ``None``)."""

    component_type: ClassVar[ComponentType] = ComponentType.SWA
    FIELDS: ClassVar[dict[str, str]] = {"window": "sliding_window_size", "kv_size": "swa_kv_size"}
    window: int
    kv_size: int | None = None

    def validate(self) -> None:
        if self.window is None or self.window <= 0:
            raise ConfigError(f"SWA needs sliding_window_size > 0: {self.window}")
        if self.kv_size is not None and self.kv_size <= 0:
            raise ConfigError(f"swa_kv_size must be positive, got {self.kv_size}")

    def build_pools(self, pools: CachePools, ctx: PoolContext) -> None:
        # The paired allocator replaces the Full one: each Full slot maps an SWA slot.
        allocator = SWATokenSlotAllocator(ctx.kv_size, self.kv_size, ctx.page_size, INDEX_DEVICE)
        pools.token_allocator = allocator
        pools.swa = SWAKVPool(allocator, ctx.kv_shape, ctx.device)


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """Mamba: ``size`` state slots of ``conv_shape`` + ``ssm_shape`` tensors; checkpoints
    every ``chunk_size`` tokens."""

    component_type: ClassVar[ComponentType] = ComponentType.MAMBA
    FIELDS: ClassVar[dict[str, str]] = {
        "size": "mamba_size",
        "chunk_size": "mamba_chunk_size",
        "conv_shape": "mamba_conv_shape",
        "ssm_shape": "mamba_ssm_shape",
    }
    size: int
    chunk_size: int = 64
    conv_shape: tuple[int, ...] = (4, 8)
    ssm_shape: tuple[int, ...] = (2, 8, 8)

    def validate(self) -> None:
        if self.size <= 0:
            raise ConfigError(f"MAMBA needs mamba_size > 0, got {self.size}")

    def build_pools(self, pools: CachePools, ctx: PoolContext) -> None:
        pools.mamba = MambaPool(self.size, self.conv_shape, self.ssm_shape, ctx.device)


# The spec class of each auxiliary component type.
SPEC_TYPES: dict[ComponentType, type[SlidingWindowSpec] | type[MambaSpec]] = {
    ComponentType.SWA: SlidingWindowSpec,
    ComponentType.MAMBA: MambaSpec,
}
