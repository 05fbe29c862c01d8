"""Prometheus counters of a KV-event publisher (:class:`urc.service.KVEventPublisher`):
batches and events published and dropped (its queue was full), replay requests.

Read at scrape time from the publisher's ``stats`` (never written by the publisher)::

    KVPublisherMetrics(registry, publisher)

Names: ``urc_kv_event_batches_published_total``, ``urc_kv_events_published_total``,
``urc_kv_event_batches_dropped_total``, ``urc_kv_events_dropped_total``,
``urc_kv_event_replay_requests_total``, ``urc_kv_event_replay_requests_refused_total``,
``urc_kv_event_replays_abandoned_total``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from metrics.config import NAMESPACE
from urc.service import KVEventPublisher, KVPublisherStats

__all__ = ["KVPublisherMetrics"]

# (name without namespace and ``_total``, KVPublisherStats field, help)
_COUNTERS = (
    ("kv_event_batches_published", "batches_published", "KV event batches sent on the PUB socket"),
    ("kv_events_published", "events_published", "KV events sent on the PUB socket"),
    (
        "kv_event_batches_dropped",
        "batches_dropped",
        "KV event batches dropped: the queue was full, or a subscriber's queue at the HWM",
    ),
    (
        "kv_events_dropped",
        "events_dropped",
        "KV events dropped: the queue was full, or a subscriber's queue at the HWM",
    ),
    ("kv_event_replay_requests", "replay_requests", "KV event replay requests read"),
    (
        "kv_event_replay_requests_refused",
        "replay_requests_refused",
        "KV event replay requests refused: a repeat while the client's replay runs, or too "
        "many clients",
    ),
    (
        "kv_event_replays_abandoned",
        "replays_abandoned",
        "KV event replays dropped: the client stopped reading or left",
    ),
)


class KVPublisherMetrics:
    """Registers a collector on ``registry`` that reports ``publisher``'s counters at each
    scrape (``ValueError`` from the registry if these names are registered already)."""

    def __init__(self, registry: CollectorRegistry, publisher: KVEventPublisher) -> None:
        self._publisher = publisher
        registry.register(self)

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(f"{NAMESPACE}_{n}", doc) for n, _, doc in _COUNTERS]

    def collect(self) -> list[Metric]:
        stats: KVPublisherStats = self._publisher.stats
        return [
            CounterMetricFamily(f"{NAMESPACE}_{n}", doc, value=getattr(stats, field))
            for n, field, doc in _COUNTERS
        ]
