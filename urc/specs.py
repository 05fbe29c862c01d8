"""Per-component specs: what an auxiliary component needs to know, and the pools it builds.

``CacheConfig.specs`` holds one spec per auxiliary component (FULL needs none: its pool is
the config's ``kv_size``).  A spec checks itself against the config and builds its own pools,
so pool building has no per-component branches::

    CacheConfig.with_specs(SlidingWindowSpec(window=4096), MambaSpec(size=64), kv_size=1 << 20)

is the same config as the flat constructor
``CacheConfig(components=(FULL, SWA, MAMBA), sliding_window_size=4096, mamba_size=64, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from urc.errors import ConfigError
from urc.node import ComponentType

if TYPE_CHECKING:
    from urc.config import CacheConfig, CachePools

__all__ = ["ComponentSpec", "MambaSpec", "SlidingWindowSpec"]


class ComponentSpec(Protocol):
    """An auxiliary component's configuration (frozen)."""

    component_type: ClassVar[ComponentType]

    def validate(self, config: CacheConfig) -> None:
        """Raise :class:`~urc.errors.ConfigError` if the spec does not fit ``config``."""

    def build_pools(self, config: CacheConfig, pools: CachePools) -> None:
        """Allocate this component's pools into ``pools`` (mutates it)."""


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """SWA: ``window`` tokens of sliding-window KV per request; ``kv_size`` SWA slots (the
    config's ``kv_size`` when ``None``)."""

    component_type: ClassVar[ComponentType] = ComponentType.SWA
    window: int
    kv_size: int | None = None

    def validate(self, config: CacheConfig) -> None:
        if self.window <= 0:
            raise ConfigError(f"SWA needs sliding_window_size > 0: {self.window}")
        if self.kv_size is not None and self.kv_size <= 0:
            raise ConfigError(f"swa_kv_size must be positive, got {self.kv_size}")

    def build_pools(self, config: CacheConfig, pools: CachePools) -> None:
        from urc.pools.swa import build_swa_allocator

        # The paired allocator replaces the Full one: each Full slot maps an SWA slot.
        pools.token_allocator, pools.swa = build_swa_allocator(config)


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """Mamba: ``size`` state slots of ``conv_shape`` + ``ssm_shape`` tensors; checkpoints
    every ``chunk_size`` tokens."""

    component_type: ClassVar[ComponentType] = ComponentType.MAMBA
    size: int
    chunk_size: int = 64
    conv_shape: tuple[int, ...] = (4, 8)
    ssm_shape: tuple[int, ...] = (2, 8, 8)

    def validate(self, config: CacheConfig) -> None:
        if self.size <= 0:
            raise ConfigError(f"MAMBA needs mamba_size > 0, got {self.size}")

    def build_pools(self, config: CacheConfig, pools: CachePools) -> None:
        from urc.pools.mamba import build_mamba_pool

        pools.mamba = build_mamba_pool(config)
