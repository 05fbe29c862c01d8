"""``HiCacheConfig``: sizes and policies of the host tier and its background work."""

from __future__ import annotations

from dataclasses import dataclass

from urc.errors import ConfigError
from urc.tiers import WritePolicy

__all__ = ["HiCacheConfig"]


@dataclass(frozen=True, slots=True)
class HiCacheConfig:
    """Host tier configuration.

    ``host_tokens`` sizes the host KV pool in tokens; when ``None`` it is ``host_ratio`` times
    the device pool.  Mamba host states are ``host_ratio`` times the device states.  Host
    eviction keeps usage between ``low_watermark`` and ``high_watermark`` (fractions of the
    host capacity).  Load-backs shorter than ``load_back_threshold`` tokens are skipped.
    ``max_in_flight`` bounds concurrent backups and load-backs each.
    """

    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    host_tokens: int | None = None
    host_ratio: float = 2.0
    low_watermark: float = 0.80
    high_watermark: float = 0.95
    load_back_threshold: int = 0
    max_in_flight: int = 4
    backup_batch: int = 16

    def __post_init__(self) -> None:
        if self.host_tokens is not None and self.host_tokens <= 0:
            raise ConfigError(f"host_tokens must be positive, got {self.host_tokens}")
        if self.host_ratio <= 0:
            raise ConfigError(f"host_ratio must be positive, got {self.host_ratio}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(
                f"need 0 < low_watermark <= high_watermark <= 1, got "
                f"{self.low_watermark}, {self.high_watermark}"
            )
        if self.load_back_threshold < 0 or self.max_in_flight <= 0 or self.backup_batch <= 0:
            raise ConfigError(f"invalid thresholds in {self}")

    def host_size(self, device_size: int, page_size: int) -> int:
        """Host slots for a device pool of ``device_size`` (rounded up to whole pages)."""
        n = self.host_tokens if self.host_tokens is not None else int(device_size * self.host_ratio)
        return max(page_size, -(-n // page_size) * page_size)
