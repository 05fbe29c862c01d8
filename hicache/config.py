"""``HiCacheConfig``: sizes and policies of the host tier and its background work."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from hicache.host_layout import HostLayout
from hicache.storage.keys import KeyScheme
from hicache.storage.sglang_keys import SGLangNaming
from urc.errors import ConfigError
from urc.host_protocol import WritePolicy
from urc.node import SizeUnit

__all__ = [
    "HiCacheConfig",
    "PrefetchStopPolicy",
    "StorageBackupPolicy",
    "StorageConfig",
]


@dataclass(frozen=True, slots=True)
class HiCacheConfig:
    """Host tier configuration.

    ``host_tokens`` sizes the host KV pool in tokens; when ``None`` it is ``host_ratio`` times
    the device pool.  Mamba host states are ``host_ratio`` times the device states.  Host
    eviction keeps usage between ``low_watermark`` and ``high_watermark`` (fractions of the
    host capacity).  Load-backs shorter than ``load_back_threshold`` tokens are skipped.
    ``max_in_flight`` bounds concurrent backups and load-backs each.  ``host_layout``: how
    the host pools hold KV (:class:`~hicache.host_layout.HostLayout`; default ``None``:
    ``PAGE_FIRST`` for pools on CUDA, ``LAYER_FIRST`` on the CPU).
    """

    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    host_tokens: int | None = None
    host_ratio: float = 2.0
    low_watermark: float = 0.80
    high_watermark: float = 0.95
    load_back_threshold: int = 0
    max_in_flight: int = 4
    backup_batch: int = 16
    host_layout: HostLayout | None = None

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
        if self.host_layout is not None and not isinstance(self.host_layout, HostLayout):
            raise ConfigError(f"host_layout must be a HostLayout, got {self.host_layout!r}")

    def host_size(self, device_size: int, page_size: int, unit: SizeUnit = SizeUnit.TOKENS) -> int:
        """Host slots for a device pool of ``device_size`` (rounded up to whole pages).

        ``host_tokens`` sizes token pools only; a pool counted in another unit (Mamba
        states) is always ``host_ratio`` times its device size."""
        if unit is SizeUnit.TOKENS and self.host_tokens is not None:
            n = self.host_tokens
        else:
            n = int(device_size * self.host_ratio)
        return max(page_size, -(-n // page_size) * page_size)


class StorageBackupPolicy(Enum):
    """When host pages are written to the L3 storage tier."""

    OFF = "off"  # never: storage is only read (another instance fills it)
    WRITE_THROUGH = "write_through"  # as soon as a node's pages land on host
    ON_HOST_EVICTION = "on_host_eviction"  # when host eviction frees a node's pages


class PrefetchStopPolicy(Enum):
    """When a prefetch from storage stops reading and commits what arrived."""

    BEST_EFFORT = "best_effort"  # when the caller's ``stop`` event fires (or the timeout)
    WAIT_COMPLETE = "wait_complete"  # every page the store reported (backend timeouts only)
    TIMEOUT = "timeout"  # after ``timeout_base_s + pages * timeout_per_page_s``


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """L3 storage tier configuration (see ``hicache.storage_worker``).

    Prefetches read pages in batches of ``batch_pages``; a key whose uncached part is shorter
    than ``prefetch_threshold_pages`` pages is not looked up.  ``max_pending_writes`` bounds
    the nodes waiting for a write-through put and ``max_pending_bytes`` the page bytes staged
    for puts on host eviction; work beyond either bound is dropped (and counted).
    ``flush_timeout_s`` bounds a flush of the queued writes (the worker's ``flush`` and
    ``close``): what is still queued then is dropped and counted.  ``write_concurrency``
    staged writes (on host eviction) are put at once.

    ``key_scheme``: urc's own versioned keys and page bytes (``KeyScheme.URC``, the default),
    or SGLang HiCache's (``KeyScheme.SGLANG``: its page hashes, named with ``sglang_naming``,
    its ``page_first`` page payload), so that SGLang replicas pointed at the same store
    reuse this cache's pages and the other way round.  The SGLang scheme stores Full
    (MHA KV) pages only: a cache with other components is refused by the worker.
    """

    backup_policy: StorageBackupPolicy = StorageBackupPolicy.WRITE_THROUGH
    prefetch_policy: PrefetchStopPolicy = PrefetchStopPolicy.TIMEOUT
    timeout_base_s: float = 1.0
    timeout_per_page_s: float = 0.25
    prefetch_threshold_pages: int = 1
    batch_pages: int = 16
    max_pending_writes: int = 1024
    max_pending_bytes: int = 64 << 20
    flush_timeout_s: float = 30.0
    write_concurrency: int = 4
    key_scheme: KeyScheme = KeyScheme.URC
    sglang_naming: SGLangNaming = field(default_factory=SGLangNaming)

    def __post_init__(self) -> None:
        if not self.flush_timeout_s > 0:
            raise ConfigError(f"flush_timeout_s must be > 0, got {self.flush_timeout_s}")
        if self.timeout_base_s <= 0 or self.timeout_per_page_s < 0:
            raise ConfigError(f"invalid prefetch timeouts in {self}")
        bounds = (
            self.prefetch_threshold_pages,
            self.batch_pages,
            self.max_pending_writes,
            self.write_concurrency,
        )
        if min(bounds) < 1:
            raise ConfigError(f"invalid storage bounds in {self}")
        if self.max_pending_bytes < 0:
            raise ConfigError(f"max_pending_bytes must be >= 0, got {self.max_pending_bytes}")

    def prefetch_timeout(self, pages: int) -> float:
        """Seconds a ``TIMEOUT`` prefetch of ``pages`` pages may take."""
        return self.timeout_base_s + pages * self.timeout_per_page_s
