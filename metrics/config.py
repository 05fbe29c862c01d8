"""Configuration of the Prometheus exporter: modes, buckets, limits."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import cast

from prometheus_client import values as _client_values
from prometheus_client.utils import floatToGoString

__all__ = [
    "COMMAND_BUCKETS",
    "NAMESPACE",
    "OTHER_ERROR",
    "TRANSFER_BUCKETS",
    "ExportMode",
    "GaugeMultiprocessMode",
    "MetricsConfig",
]


NAMESPACE = "urc"

# 1-2.5-5 steps from 1 us to 1 s: matches and inserts take microseconds, so the client's default
# buckets (5 ms - 10 s) would put every observation in the first bucket.
COMMAND_BUCKETS: tuple[float, ...] = (
    *(float(f"{m}e{e}") for e in range(-6, 0) for m in (1, 2.5, 5)),
    1.0,
)
# Transfers move whole blocks (host memory, disk, network), so they reach into seconds.
TRANSFER_BUCKETS: tuple[float, ...] = (
    *(float(f"{m}e{e}") for e in range(-5, 1) for m in (1, 2.5, 5)),
    10.0,
)

# The client's spelling of a bucket bound in the ``le`` label ("2.5e-06", "1.0", "+Inf").
_le = cast(Callable[[float], str], floatToGoString)

# Label values ``error_type`` takes once ``max_error_types`` distinct classes were seen.
OTHER_ERROR = "other"


class GaugeMultiprocessMode(Enum):
    """How ``prometheus_client`` multiprocess mode combines one gauge across processes."""

    ALL = "all"
    LIVEALL = "liveall"
    SUM = "sum"
    LIVESUM = "livesum"
    MAX = "max"
    LIVEMAX = "livemax"
    MIN = "min"
    LIVEMIN = "livemin"
    MOSTRECENT = "mostrecent"
    LIVEMOSTRECENT = "livemostrecent"


class ExportMode(Enum):
    """How :class:`CacheMetrics` gets its figures into the registry (see the module doc)."""

    AUTO = "auto"  # DIRECT in prometheus_client multiprocess mode, else SCRAPE
    SCRAPE = "scrape"  # plain numbers on the hot path; a collector builds families per scrape
    DIRECT = "direct"  # Gauge/Counter/Histogram objects written per batch and per command

    def resolve(self) -> ExportMode:
        """The concrete mode: ``AUTO`` becomes ``DIRECT`` exactly in multiprocess mode."""
        if self is not ExportMode.AUTO:
            return self
        return ExportMode.DIRECT if _multiprocess_mode() else ExportMode.SCRAPE


def _multiprocess_mode() -> bool:
    # The client picks its value class once, at import, from these variables; either sign
    # means scrape-time collection would only ever see this process.
    return (
        "PROMETHEUS_MULTIPROC_DIR" in os.environ
        or "prometheus_multiproc_dir" in os.environ
        or _client_values.ValueClass is not _client_values.MutexValue
    )


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """Options of :class:`CacheMetrics`.

    ``enabled=False`` registers nothing and makes every observer method return at once (for
    the cheapest "off", give the service ``observer=None``; see :func:`make_observer`).
    Buckets are upper bounds in seconds, strictly increasing and positive (``+Inf`` is added).
    ``max_error_types`` caps the distinct ``error_type`` label values; later classes are
    counted as ``"other"``.  ``mode`` picks the write path (:class:`ExportMode`).
    ``direct_interval_s`` (DIRECT mode, attached to a service): while the service is busy it
    hands the exporter a stats snapshot at most this often, plus one whenever it goes idle and
    one at close, so the written gauges and counters are at most this stale while commands
    flow and exact once the service is idle; ``0`` writes after every batch.  (SCRAPE mode
    pulls a snapshot per scrape and needs no interval.)
    """

    enabled: bool = True
    command_buckets: tuple[float, ...] = COMMAND_BUCKETS
    transfer_buckets: tuple[float, ...] = TRANSFER_BUCKETS
    gauge_multiprocess_mode: GaugeMultiprocessMode = GaugeMultiprocessMode.LIVESUM
    max_error_types: int = 32
    mode: ExportMode = ExportMode.AUTO
    direct_interval_s: float = 0.01

    def __post_init__(self) -> None:
        for name in ("command_buckets", "transfer_buckets"):
            b = getattr(self, name)
            if not b or any(not (x > 0 and math.isfinite(x)) for x in b):
                raise ValueError(f"{name} must be non-empty, finite and positive: {b}")
            if any(x >= y for x, y in itertools.pairwise(b)):
                raise ValueError(f"{name} must be strictly increasing: {b}")
        if self.max_error_types < 1:
            raise ValueError(f"max_error_types must be >= 1, got {self.max_error_types}")
        if not (self.direct_interval_s >= 0 and math.isfinite(self.direct_interval_s)):
            raise ValueError(f"direct_interval_s must be >= 0, got {self.direct_interval_s}")
