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
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from urc.errors import ConfigError
from urc.node import ComponentType

if TYPE_CHECKING:
    from urc.config import CacheConfig, CachePools

__all__ = ["SPEC_TYPES", "ComponentSpec", "MambaSpec", "SlidingWindowSpec"]


class ComponentSpec(Protocol):
    """An auxiliary component's configuration (frozen)."""

    component_type: ClassVar[ComponentType]

    @classmethod
    def from_config(cls, config: CacheConfig) -> ComponentSpec:
        """The spec the flat fields of ``config`` describe."""

    def config_fields(self) -> dict[str, Any]:
        """The flat ``CacheConfig`` fields that describe this spec."""

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

    @classmethod
    def from_config(cls, config: CacheConfig) -> SlidingWindowSpec:
        return cls(config.sliding_window_size or 0, config.swa_kv_size)

    def config_fields(self) -> dict[str, Any]:
        return {"sliding_window_size": self.window, "swa_kv_size": self.kv_size}

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

    @classmethod
    def from_config(cls, config: CacheConfig) -> MambaSpec:
        return cls(
            config.mamba_size,
            config.mamba_chunk_size,
            config.mamba_conv_shape,
            config.mamba_ssm_shape,
        )

    def config_fields(self) -> dict[str, Any]:
        return {
            "mamba_size": self.size,
            "mamba_chunk_size": self.chunk_size,
            "mamba_conv_shape": self.conv_shape,
            "mamba_ssm_shape": self.ssm_shape,
        }

    def validate(self, config: CacheConfig) -> None:
        if self.size <= 0:
            raise ConfigError(f"MAMBA needs mamba_size > 0, got {self.size}")

    def build_pools(self, config: CacheConfig, pools: CachePools) -> None:
        from urc.pools.mamba import build_mamba_pool

        pools.mamba = build_mamba_pool(config)


# The spec class of each auxiliary component type.
SPEC_TYPES: dict[ComponentType, type[SlidingWindowSpec] | type[MambaSpec]] = {
    ComponentType.SWA: SlidingWindowSpec,
    ComponentType.MAMBA: MambaSpec,
}
