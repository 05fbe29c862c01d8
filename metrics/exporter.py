"""``CacheMetrics``: a :class:`~urc.service.ServiceObserver` that publishes Prometheus metrics.

The async service calls the observer from its actor task (see
:class:`~urc.service.ServiceObserver`); this class turns those calls into metrics on an injectable
:class:`~prometheus_client.CollectorRegistry` (default: the global ``REGISTRY``).

Everything lives under the ``urc_`` namespace, in base units, with bounded labels only:
``component`` in ``full|swa|mamba``, ``tier`` in ``device|host|storage``, ``kind`` a
:class:`~urc.service.CommandKind` or :class:`~urc.service.TransferKind` value and
``error_type`` an exception class name (capped, see :attr:`MetricsConfig.max_error_types`).

Units are never mixed in one series: Full and SWA sizes are tokens (``*_tokens``), Mamba sizes
are state slots (``*_states``), so ``sum by (tier)`` over any one metric is meaningful.

Gauges (the figures of the latest ``CacheStats`` snapshot -- pulled from the service at
scrape time, or passed to :meth:`CacheMetrics.on_batch` -- or of the in-flight transfer calls):

====================================================  ==========================================
``urc_cache_evictable_tokens{component,tier}``        Full/SWA tokens on unlocked nodes
``urc_cache_evictable_states{component,tier}``        Mamba state slots on unlocked nodes
``urc_cache_protected_tokens{component,tier}``        Full/SWA tokens on locked nodes
``urc_cache_protected_states{component,tier}``        Mamba state slots on locked nodes
``urc_pool_capacity_tokens|states{component,tier}``   pool capacity
``urc_pool_used_tokens|states{component,tier}``       capacity - free (includes request-held)
``urc_pool_free_tokens|states{component,tier}``       free slots
``urc_tree_nodes``                                    nodes in the radix tree (root excluded)
``urc_service_queued_commands``                       commands waiting for the actor
``urc_transfers_in_flight{kind}``                     transfers started and not yet finished
====================================================  ==========================================

Counters (``_total``; the snapshot's cumulative counters, or events):
``urc_match_requests_total``, ``urc_match_query_tokens_total``,
``urc_match_hit_tokens_total{tier}``, ``urc_inserted_tokens_total``,
``urc_evicted_tokens_total{component,tier}``, ``urc_evicted_states_total{component,tier}``,
``urc_backed_up_tokens_total``, ``urc_loaded_back_tokens_total``,
``urc_transfers_total{kind}``, ``urc_transfer_tokens_total{kind}``,
``urc_transfer_bytes_total{kind}`` (L3 reads/writes are ``kind="storage_read|storage_write"``;
the transfers are those background workers run: under ``write_back`` the backups made at
eviction are synchronous, no transfer, and count in ``urc_backed_up_tokens_total`` only,
which counts every token backed up),
``urc_command_errors_total{kind,error_type}``,
``urc_storage_errors_total{backend,op}`` (failed L3 storage calls -- store errors and
timeouts -- reported by a ``hicache.storage_worker.StorageWorker`` given this exporter as its
``observer``; ``backend`` is the backend's ``name``, ``op`` in ``exists|get|put|delete``).

Histograms (seconds, microsecond-scale buckets): ``urc_command_duration_seconds{kind}``
(time applying a command), ``urc_command_queue_wait_seconds`` (send -> taken by the actor),
``urc_transfer_duration_seconds{kind}`` (backup, load-back and L3 reads/writes).

Two ways of getting there (:class:`ExportMode`, chosen by :attr:`MetricsConfig.mode`):

- ``SCRAPE`` (the default in a single process): the observer methods only touch plain Python
  numbers -- ``on_command`` bumps its own histogram bucket counts (a ``bisect`` into the
  bounds) -- and a custom collector registered on the registry builds every family at scrape
  time from a snapshot and those counts.  Attached to a service
  (:meth:`CacheMetrics.attach`), the exporter pulls that snapshot from the service at scrape
  time (taken on the service's event loop, between two commands), so the actor builds no
  ``CacheStats`` per batch and the gauges equal the cache's figures at the moment of the
  scrape; used without a service, it keeps the snapshot last passed to :meth:`on_batch`.  This
  keeps the observer to a fraction of a microsecond per command; every ``prometheus_client``
  ``inc``/``set``/``observe`` costs about 1 us.
- ``DIRECT`` (chosen automatically in ``prometheus_client`` multiprocess mode, i.e. when
  ``PROMETHEUS_MULTIPROC_DIR`` is set): classic ``Gauge``/``Counter``/``Histogram`` objects,
  written per command and per snapshot (only the values that changed).  Attached to a
  service, it asks for a snapshot at most every :attr:`MetricsConfig.direct_interval_s` while
  the service is busy, and always when it goes idle and at close.  A custom collector only
  ever sees the scraping process, so multiprocess mode needs the values in the client's files.
  Gauges are created with :attr:`MetricsConfig.gauge_multiprocess_mode` (default ``livesum``:
  each process owns its own cache, and the sum over live processes is the fleet figure; use
  ``mostrecent``/``all`` for other set-ups).  Serve such a registry through
  ``prometheus_client.multiprocess.MultiProcessCollector`` and call
  ``multiprocess.mark_process_dead(pid)`` when a worker exits, as the client docs say.

Both modes export the same names, labels, HELP texts and values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry

from metrics.config import ExportMode, MetricsConfig
from urc.service import CommandKind, StatsSource, TransferKind
from urc.stats import CacheStats

__all__ = ["CacheMetrics", "make_observer", "register_mode"]


# ---------------------------------------------------------------------------- the exporter
_M = TypeVar("_M", bound="CacheMetrics")
# The write path of each export mode, registered by its module (``metrics.direct``,
# ``metrics.scrape``; the package imports both), so this module imports neither.
_IMPLEMENTATIONS: dict[ExportMode, type[CacheMetrics]] = {}


def register_mode(mode: ExportMode) -> Callable[[type[_M]], type[_M]]:
    """Class decorator: ``CacheMetrics(config=...)`` builds this class for ``mode``."""

    def register(cls: type[_M]) -> type[_M]:
        _IMPLEMENTATIONS[mode] = cls
        return cls

    return register


class CacheMetrics:
    """Prometheus exporter for one cache; implements :class:`~urc.service.ServiceObserver`.

    ``CacheMetrics(registry, config)`` returns an instance of the subclass implementing
    ``config.mode`` resolved (:attr:`mode` says which; both behave identically from outside).

    Contract:

    - Registers its metrics on ``registry`` at construction (``ValueError`` from the client if
      another exporter already registered them there: use one registry per cache, or call
      :meth:`unregister` first).
    - :meth:`attach` (called by the service on start) hands it the service's snapshot source;
      from then on the figures come from there (see the module doc), not from :meth:`on_batch`
      calls.  One exporter per service.
    - Gauges equal the figures of the latest snapshot (pulled, or given to :meth:`on_batch`);
      cumulative counters equal the snapshot's counters (the first snapshot counts from
      zero).  A counter seen going backwards means the source was replaced or reset: the new
      value is counted as the increase since that reset (Prometheus counters never
      decrease).  The DIRECT mode sees every snapshot it is given; the SCRAPE mode compares
      the values of consecutive scrapes, so what the old source gained after the last scrape
      before the reset is not counted.
    - :meth:`on_command` observes latency and queue wait once per command and counts errors.
    - :meth:`on_storage_error` counts a failed L3 storage call (any thread).
    - :meth:`on_transfer` counts a completed transfer; :meth:`transfer_started` /
      :meth:`transfer_finished` (or :meth:`track_transfer`) maintain the in-flight gauge.
    - Observer methods never raise on well-typed input.

    Call :meth:`on_command` and :meth:`on_batch` from one thread at a time (the actor); the
    transfer methods may be called from any thread, and scrapes may run in any thread.
    """

    mode: ExportMode

    def __new__(
        cls, registry: CollectorRegistry = REGISTRY, config: MetricsConfig | None = None
    ) -> CacheMetrics:
        if cls is CacheMetrics:
            cfg = config if config is not None else MetricsConfig()
            if not cfg.enabled:
                cls = _DisabledMetrics
            else:
                mode = cfg.mode.resolve()
                impl = _IMPLEMENTATIONS.get(mode)
                if impl is None:  # the package's __init__ registers both modes
                    raise RuntimeError(f"no CacheMetrics implementation registered for {mode}")
                cls = impl
        return super().__new__(cls)

    def __init__(
        self,
        registry: CollectorRegistry = REGISTRY,
        config: MetricsConfig | None = None,
    ) -> None:
        self.config = config if config is not None else MetricsConfig()
        self.registry = registry
        self.enabled = self.config.enabled
        self.mode = self.config.mode.resolve()

    def unregister(self) -> None:
        """Remove this exporter's metrics from its registry (idempotent)."""

    # ------------------------------------------------------------------ ServiceObserver
    def attach(self, source: StatsSource) -> float | None:
        """The service starts (:class:`~urc.service.PullingObserver`): keep ``source``;
        returns how often the service should call :meth:`on_batch` (``None``: never)."""
        return None

    def on_command(
        self,
        kind: CommandKind,
        queue_wait_s: float,
        latency_s: float,
        error: BaseException | None,
    ) -> None:
        """Observe one applied command's latency and queue wait; count ``error`` if any."""

    def on_batch(self, stats: CacheStats, queued: int) -> None:
        """Take ``stats`` as the current figures and ``queued`` as the queue length."""

    def on_transfer(self, kind: TransferKind, tokens: int, nbytes: int, seconds: float) -> None:
        """Count one completed transfer of ``tokens`` tokens / ``nbytes`` bytes."""

    def on_storage_error(self, backend: str, op: Enum) -> None:
        """Count one failed storage call of ``backend`` (a backend's ``name``); ``op`` is a
        ``hicache.storage.stats.StorageOp`` (its value is the label)."""

    # ------------------------------------------------------------------ in-flight transfers
    def transfer_started(self, kind: TransferKind) -> None:
        """A background worker started a transfer (raises the in-flight gauge by one)."""

    def transfer_finished(self, kind: TransferKind) -> None:
        """A transfer started with :meth:`transfer_started` ended (success or failure)."""

    def set_transfers_in_flight(self, kind: TransferKind, count: int) -> None:
        """Set the in-flight gauge of ``kind`` (for workers that keep their own count)."""

    @contextmanager
    def track_transfer(self, kind: TransferKind) -> Iterator[None]:
        """Count a transfer as in flight for the duration of the ``with`` block."""
        self.transfer_started(kind)
        try:
            yield
        finally:
            self.transfer_finished(kind)


class _DisabledMetrics(CacheMetrics):
    """``enabled=False``: registers nothing; every method is the base class's no-op."""


def make_observer(
    config: MetricsConfig | None = None, registry: CollectorRegistry = REGISTRY
) -> CacheMetrics | None:
    """A :class:`CacheMetrics` for the service's ``observer=``, or ``None`` when disabled.

    ``None`` is the cheapest "off": the service then skips the observer calls entirely.
    """
    config = config if config is not None else MetricsConfig()
    return CacheMetrics(registry, config) if config.enabled else None
