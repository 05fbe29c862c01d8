"""Prometheus metrics for the Unified Radix Cache (docs/architecture.md §5).

``metrics`` reads the core's ``CacheStats`` snapshots and the service's observer events; the
core never imports ``prometheus_client``.  Typical use::

    from prometheus_client import CollectorRegistry
    from metrics import CacheMetrics, MetricsServer

    registry = CollectorRegistry()
    service = AsyncUnifiedRadixCache(cache, observer=CacheMetrics(registry))
    async with MetricsServer(registry) as server:   # http://127.0.0.1:<port>/metrics
        ...

See :mod:`metrics.exporter` for the metric names and units and the two write paths
(:class:`ExportMode`: scrape-time collection by default, direct writes in ``prometheus_client``
multiprocess mode), :mod:`metrics.http` for the endpoint, and
``examples/grafana-dashboard.json`` for a dashboard.
"""

from __future__ import annotations

from metrics import direct, scrape  # noqa: F401  (they register their export modes)
from metrics.config import (
    COMMAND_BUCKETS,
    NAMESPACE,
    TRANSFER_BUCKETS,
    ExportMode,
    GaugeMultiprocessMode,
    MetricsConfig,
)
from metrics.exporter import CacheMetrics, make_observer
from metrics.http import (
    MetricsServer,
    MetricsServerConfig,
    SyncMetricsServer,
    start_metrics_http_server,
)

__all__ = [
    "COMMAND_BUCKETS",
    "NAMESPACE",
    "TRANSFER_BUCKETS",
    "CacheMetrics",
    "ExportMode",
    "GaugeMultiprocessMode",
    "MetricsConfig",
    "MetricsServer",
    "MetricsServerConfig",
    "SyncMetricsServer",
    "make_observer",
    "start_metrics_http_server",
]
