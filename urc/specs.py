"""Per-component specs: what an auxiliary component needs to know, and the pools it builds.

A config keeps each auxiliary component's spec as given::

    CacheConfig(components=(FULL, SlidingWindowSpec(window=4096), MambaSpec(size=64)))

A spec checks itself (when the config is constructed) and builds its own pools, so pool
building has no per-component branches; the component reads its own spec
(:meth:`urc.config.CacheConfig.spec`).  FULL needs no spec: its pool is the config's
``kv_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import ClassVar, Protocol, runtime_checkable

import torch

from urc.errors import ConfigError
from urc.node import ComponentType
from urc.pools.cache_pools import CachePools
from urc.pools.indices import INDEX_DEVICE
from urc.pools.kv_pool import KVShape
from urc.pools.mamba import MambaPool
from urc.pools.swa import SWAKVPool, SWATokenSlotAllocator

__all__ = ["ComponentSpec", "MambaSpec", "PoolContext", "SlidingWindowSpec"]


@dataclass(frozen=True, slots=True)
class PoolContext:
    """What every pool is sized and placed by: the config's Full slots, page size, device
    and KV row shape."""

    kv_size: int
    page_size: int
    device: torch.device
    kv_shape: KVShape


@runtime_checkable
class ComponentSpec(Protocol):
    """An auxiliary component's configuration (a frozen dataclass), kept as given in
    ``CacheConfig.components`` and read by its component."""

    component_type: ClassVar[ComponentType]

    def validate(self) -> None:
        """Raise :class:`~urc.errors.ConfigError` if the spec is not usable."""

    def build_pools(self, pools: CachePools, ctx: PoolContext) -> None:
        """Allocate this component's pools into ``pools`` (mutates it)."""


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """SWA: ``window`` tokens of sliding-window KV per request; ``kv_size`` SWA slots (the
    config's ``kv_size`` when ``None``)."""

    component_type: ClassVar[ComponentType] = ComponentType.SWA
    window: int
    kv_size: int | None = None

    def validate(self) -> None:
        if not _is_int(self.window) or self.window <= 0:
            raise ConfigError(f"SlidingWindowSpec.window must be a positive int: {self.window!r}")
        if self.kv_size is not None and (not _is_int(self.kv_size) or self.kv_size <= 0):
            raise ConfigError(f"SlidingWindowSpec.kv_size must be positive: {self.kv_size!r}")

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
    size: int
    chunk_size: int = 64
    conv_shape: tuple[int, ...] = (4, 8)
    ssm_shape: tuple[int, ...] = (2, 8, 8)

    def validate(self) -> None:
        for name in ("size", "chunk_size"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"MambaSpec.{name} must be a positive int: {value!r}")
        for name in ("conv_shape", "ssm_shape"):
            shape = getattr(self, name)
            if not shape or not all(_is_int(d) and d > 0 for d in shape):
                raise ConfigError(f"MambaSpec.{name} must be positive dimensions: {shape!r}")

    def build_pools(self, pools: CachePools, ctx: PoolContext) -> None:
        pools.mamba = MambaPool(self.size, self.conv_shape, self.ssm_shape, ctx.device)


def _is_int(value: object) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)
