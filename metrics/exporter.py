"""``CacheMetrics``: a :class:`~urc.observer.ServiceObserver` that publishes Prometheus metrics.

The async service calls the observer from its actor task (see :mod:`urc.observer`); this class
turns those calls into metrics on an injectable :class:`~prometheus_client.CollectorRegistry`
(default: the global ``REGISTRY``).

Everything lives under the ``urc_`` namespace, in base units, with bounded labels only:
``component`` in ``full|swa|mamba``, ``tier`` in ``device|host|storage``, ``kind`` a
:class:`~urc.commands.CommandKind` or :class:`~urc.observer.TransferKind` value and
``error_type`` an exception class name (capped, see :attr:`MetricsConfig.max_error_types`).

Units are never mixed in one series: Full and SWA sizes are tokens (``*_tokens``), Mamba sizes
are state slots (``*_states``), so ``sum by (tier)`` over any one metric is meaningful.

Gauges (the figures of the latest ``CacheStats`` snapshot passed to
:meth:`CacheMetrics.on_batch`, or of the in-flight transfer calls):

====================================================  ==========================================
``urc_cache_evictable_tokens{component,tier}``        Full/SWA tokens on unlocked nodes
``urc_cache_evictable_states{component,tier}``        Mamba state slots on unlocked nodes
``urc_cache_protected_tokens{component,tier}``        Full/SWA tokens on locked nodes
``urc_cache_protected_states{component,tier}``        Mamba state slots on locked nodes
``urc_pool_capacity_tokens|states{component,tier}``   pool capacity
``urc_pool_used_tokens|states{component,tier}``       capacity - free (includes request-held)
``urc_pool_free_tokens|states{component,tier}``       free slots
``urc_tree_nodes``                                    nodes in the radix tree (root excluded)
``urc_service_queued_commands``                       commands waiting after the last batch
``urc_transfers_in_flight{kind}``                     transfers started and not yet finished
====================================================  ==========================================

Counters (``_total``; the snapshot's cumulative counters, or events):
``urc_match_requests_total``, ``urc_match_query_tokens_total``,
``urc_match_hit_tokens_total{tier}``, ``urc_inserted_tokens_total``,
``urc_evicted_tokens_total{component,tier}``, ``urc_evicted_states_total{component,tier}``,
``urc_backed_up_tokens_total``, ``urc_loaded_back_tokens_total``,
``urc_transfers_total{kind}``, ``urc_transfer_tokens_total{kind}``,
``urc_transfer_bytes_total{kind}`` (L3 reads/writes are ``kind="storage_read|storage_write"``),
``urc_command_errors_total{kind,error_type}``.

Histograms (seconds, microsecond-scale buckets): ``urc_command_duration_seconds{kind}``
(time applying a command), ``urc_command_queue_wait_seconds`` (send -> taken by the actor),
``urc_transfer_duration_seconds{kind}`` (backup, load-back and L3 reads/writes).

Two ways of getting there (:class:`ExportMode`, chosen by :attr:`MetricsConfig.mode`):

- ``SCRAPE`` (the default in a single process): the observer methods only touch plain Python
  numbers -- ``on_batch`` keeps a reference to the snapshot (O(1)), ``on_command`` bumps its own
  histogram bucket counts (a ``bisect`` into the bounds) -- and a custom collector registered
  on the registry builds every family at scrape time from the latest snapshot and those
  counts.  This keeps the observer to a fraction of a microsecond per command; every
  ``prometheus_client`` ``inc``/``set``/``observe`` costs about 1 us.
- ``DIRECT`` (chosen automatically in ``prometheus_client`` multiprocess mode, i.e. when
  ``PROMETHEUS_MULTIPROC_DIR`` is set): classic ``Gauge``/``Counter``/``Histogram`` objects,
  written per batch (only the values that changed) and per command.  A custom collector only
  ever sees the scraping process, so multiprocess mode needs the values in the client's files.
  Gauges are created with :attr:`MetricsConfig.gauge_multiprocess_mode` (default ``livesum``:
  each process owns its own cache, and the sum over live processes is the fleet figure; use
  ``mostrecent``/``all`` for other set-ups).  Serve such a registry through
  ``prometheus_client.multiprocess.MultiProcessCollector`` and call
  ``multiprocess.mark_process_dead(pid)`` when a worker exits, as the client docs say.

Both modes export the same names, labels, HELP texts and values.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import metrics as _client_metrics
from prometheus_client import values as _client_values
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from urc.commands import CommandKind
from urc.observer import TransferKind
from urc.stats import CacheStats, ComponentStats
from urc.tree import ComponentType, Tier

__all__ = [
    "COMMAND_BUCKETS",
    "NAMESPACE",
    "TRANSFER_BUCKETS",
    "CacheMetrics",
    "ExportMode",
    "GaugeMultiprocessMode",
    "MetricsConfig",
    "make_observer",
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
    """

    enabled: bool = True
    command_buckets: tuple[float, ...] = COMMAND_BUCKETS
    transfer_buckets: tuple[float, ...] = TRANSFER_BUCKETS
    gauge_multiprocess_mode: GaugeMultiprocessMode = GaugeMultiprocessMode.LIVESUM
    max_error_types: int = 32
    mode: ExportMode = ExportMode.AUTO

    def __post_init__(self) -> None:
        for name in ("command_buckets", "transfer_buckets"):
            b = getattr(self, name)
            if not b or any(not (x > 0 and math.isfinite(x)) for x in b):
                raise ValueError(f"{name} must be non-empty, finite and positive: {b}")
            if any(x >= y for x, y in itertools.pairwise(b)):
                raise ValueError(f"{name} must be strictly increasing: {b}")
        if self.max_error_types < 1:
            raise ValueError(f"max_error_types must be >= 1, got {self.max_error_types}")


# ---------------------------------------------------------------------------- metric table
@dataclass(frozen=True, slots=True)
class _Spec:
    """One metric family: both modes build theirs from this table, so they cannot drift."""

    type: str  # "gauge" | "counter" | "histogram"
    name: str  # full name; counters without the ``_total`` suffix
    doc: str
    labels: tuple[str, ...] = ()


def _spec(type_: str, name: str, doc: str, labels: tuple[str, ...] = ()) -> _Spec:
    return _Spec(type_, f"{NAMESPACE}_{name}", doc, labels)


_CT = ("component", "tier")
_SIZE_WHAT = {
    "tokens": "tokens (Full and SWA components)",
    "states": "Mamba state slots (one per cached state; not tokens)",
}
# Per unit: evictable, protected, capacity, used, free (the order of ``_size_values``).
_SIZE = {
    unit: (
        _spec("gauge", f"cache_evictable_{unit}", f"Cached {what} on unlocked nodes.", _CT),
        _spec("gauge", f"cache_protected_{unit}", f"Cached {what} on locked nodes.", _CT),
        _spec("gauge", f"pool_capacity_{unit}", f"Pool capacity in {what}.", _CT),
        _spec(
            "gauge",
            f"pool_used_{unit}",
            f"Pool slots in use in {what} (tree plus request-held; capacity - free).",
            _CT,
        ),
        _spec("gauge", f"pool_free_{unit}", f"Free pool slots in {what}.", _CT),
    )
    for unit, what in _SIZE_WHAT.items()
}
_NODES = _spec("gauge", "tree_nodes", "Nodes in the radix tree (root excluded).")
_QUEUED = _spec(
    "gauge", "service_queued_commands", "Commands still queued after the actor's last batch."
)
_IN_FLIGHT = _spec(
    "gauge", "transfers_in_flight", "Data transfers started and not yet finished.", ("kind",)
)
_MATCH_REQUESTS = _spec("counter", "match_requests", "Prefix match requests.")
_QUERY_TOKENS = _spec("counter", "match_query_tokens", "Tokens looked up by prefix matches.")
_HIT_TOKENS = _spec(
    "counter",
    "match_hit_tokens",
    "Tokens of prefix matches found cached, by the tier that held them.",
    ("tier",),
)
_INSERTED = _spec("counter", "inserted_tokens", "Tokens newly added to the tree by inserts.")
_EVICTED = {
    "tokens": _spec("counter", "evicted_tokens", "Tokens evicted (Full and SWA components).", _CT),
    "states": _spec("counter", "evicted_states", "Mamba state slots evicted (not tokens).", _CT),
}
_BACKED_UP = _spec("counter", "backed_up_tokens", "Tokens backed up device -> host.")
_LOADED_BACK = _spec("counter", "loaded_back_tokens", "Tokens loaded back host -> device.")
_TRANSFERS = _spec(
    "counter",
    "transfers",
    "Completed data transfers (kind=storage_read|storage_write are the L3 reads/writes).",
    ("kind",),
)
_TRANSFER_TOKENS = _spec(
    "counter",
    "transfer_tokens",
    "Tokens moved by completed transfers, as reported by workers.",
    ("kind",),
)
_TRANSFER_BYTES = _spec(
    "counter", "transfer_bytes", "Bytes moved by completed transfers.", ("kind",)
)
_TRANSFER_SECONDS = _spec(
    "histogram",
    "transfer_duration_seconds",
    "Duration of completed transfers (backup, load-back, L3 read/write).",
    ("kind",),
)
_ERRORS = _spec(
    "counter",
    "command_errors",
    "Commands that raised, by command kind and exception class name.",
    ("kind", "error_type"),
)
_LATENCY = _spec(
    "histogram",
    "command_duration_seconds",
    "Time the actor spent applying a command (command latency), by command kind.",
    ("kind",),
)
_QUEUE_WAIT = _spec(
    "histogram",
    "command_queue_wait_seconds",
    "Time from a command being sent to the actor taking it from the queue.",
)
# The snapshot's scalar cumulative counters, in the order of ``_scalars``.
_SCALAR_COUNTERS = (_MATCH_REQUESTS, _QUERY_TOKENS, _INSERTED, _BACKED_UP, _LOADED_BACK)
# Every family, in exposition order.
_ALL_SPECS: tuple[_Spec, ...] = (
    *_SIZE["tokens"],
    *_SIZE["states"],
    _NODES,
    _QUEUED,
    _IN_FLIGHT,
    _MATCH_REQUESTS,
    _QUERY_TOKENS,
    _HIT_TOKENS,
    _INSERTED,
    _EVICTED["tokens"],
    _EVICTED["states"],
    _BACKED_UP,
    _LOADED_BACK,
    _TRANSFERS,
    _TRANSFER_TOKENS,
    _TRANSFER_BYTES,
    _TRANSFER_SECONDS,
    _ERRORS,
    _LATENCY,
    _QUEUE_WAIT,
)


def _label(value: Enum) -> str:
    """Label value of a component/tier enum: its lower-case name ("full", "device")."""
    return value.name.lower()


def _unit_of(component: ComponentType) -> str:
    # Used only for counters of a component not (yet) seen in a snapshot's ``components``.
    return "states" if component is ComponentType.MAMBA else "tokens"


def _size_values(cs: ComponentStats) -> tuple[int, int, int, int, int]:
    return (cs.evictable, cs.protected, cs.capacity, cs.capacity - cs.available, cs.available)


def _scalars(stats: CacheStats) -> tuple[int, int, int, int, int]:
    return (
        stats.match_requests,
        stats.query_tokens,
        stats.inserted_tokens,
        stats.backed_up_tokens,
        stats.loaded_back_tokens,
    )


def _error_label(name: str, seen: set[str], cap: int) -> str:
    """``name``, or ``"other"`` once ``cap`` distinct names were seen (records new names)."""
    if name not in seen:
        if len(seen) >= cap:
            return OTHER_ERROR  # bounded cardinality, whatever callers raise
        seen.add(name)
    return name


# ---------------------------------------------------------------------------- the exporter
class CacheMetrics:
    """Prometheus exporter for one cache; implements :class:`~urc.observer.ServiceObserver`.

    ``CacheMetrics(registry, config)`` returns an instance of the subclass implementing
    ``config.mode`` resolved (:attr:`mode` says which; both behave identically from outside).

    Contract:

    - Registers its metrics on ``registry`` at construction (``ValueError`` from the client if
      another exporter already registered them there: use one registry per cache, or call
      :meth:`unregister` first).
    - Gauges equal the figures of the latest snapshot given to :meth:`on_batch`; cumulative
      counters equal the snapshot's counters (the first snapshot counts from zero).  A counter
      seen going backwards means the source was replaced or reset: the new value is counted as
      the increase since that reset (Prometheus counters never decrease).  The DIRECT mode
      sees every snapshot; the SCRAPE mode compares the values of consecutive scrapes, so
      what the old source gained after the last scrape before the reset is not counted.
    - :meth:`on_command` observes latency and queue wait once per command and counts errors.
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
            elif cfg.mode.resolve() is ExportMode.DIRECT:
                cls = _DirectMetrics
            else:
                cls = _ScrapeMetrics
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


# ---------------------------------------------------------------------------- SCRAPE mode
# A scrape in another thread retries its copy of the actor's numbers while the actor is in
# the middle of an update (see ``_ScrapeMetrics._read_commands``); after this many tries it
# takes what it has.  Under the GIL the actor finishes an update within one switch interval.
_MAX_READ_TRIES = 1000


class _ScrapeMetrics(CacheMetrics):
    """SCRAPE mode: plain numbers on the hot path, families built by a collector per scrape.

    Thread-safety.  The actor is the only writer of the command histograms and error counts;
    it brackets each update with two increments of ``_gen`` (a sequence lock: odd while an
    update is under way).  A scrape copies those small lists -- each copy is one C call,
    atomic under the GIL -- and retries when ``_gen`` was odd or moved meanwhile, so it sees
    every observation whole (bucket, sum and count agree).  The snapshot and queue length are
    published as one tuple (an atomic store).  Transfer figures, which any thread may write,
    and the scrape-side bookkeeping take ordinary locks; the actor never does.
    """

    def __init__(
        self, registry: CollectorRegistry = REGISTRY, config: MetricsConfig | None = None
    ) -> None:
        super().__init__(registry, config)
        cfg = self.config
        self._cbounds = cfg.command_buckets
        self._tbounds = cfg.transfer_buckets
        self._cles = (*(_le(b) for b in self._cbounds), "+Inf")
        self._tles = (*(_le(b) for b in self._tbounds), "+Inf")
        self._created = time.time()
        # Actor-written state.  A histogram is a list: bucket counts (the last is +Inf), sum.
        self._gen = 0
        self._latest: tuple[CacheStats | None, int] = (None, 0)
        # Keyed by the enum's value (``_value_``): an Enum's own hash is a Python-level call.
        self._latency: dict[str, list[float]] = {
            k._value_: self._new_hist(self._cbounds) for k in CommandKind
        }
        self._wait = self._new_hist(self._cbounds)
        self._errors: dict[tuple[str, str], int] = {}
        self._error_types: set[str] = set()
        # Transfer state, written from any thread under ``_tlock``.
        self._tlock = threading.Lock()
        self._transfers: dict[str, list[float]] = {
            k.value: [0.0, 0.0, 0.0] for k in TransferKind
        }  # count, tokens, bytes
        self._transfer_hists: dict[str, list[float]] = {
            k.value: self._new_hist(self._tbounds) for k in TransferKind
        }
        self._in_flight: dict[str, int] = {k.value: 0 for k in TransferKind}
        # Scrape-side state (under ``_scrape_lock``): last figures of every series seen, so a
        # series stays exported once it appeared, and reset detection for the counters.
        self._scrape_lock = threading.Lock()
        self._sizes: dict[tuple[ComponentType, Tier], tuple[str, tuple[int, ...]]] = {}
        self._units: dict[ComponentType, str] = {}
        self._monotonic: dict[Hashable, list[int]] = {}  # key -> [last raw value, offset]
        self._hit_tiers: dict[str, None] = {}
        self._evicted_keys: dict[tuple[ComponentType, Tier], None] = {}
        self._collector = _Collector(self)
        registry.register(self._collector)

    @staticmethod
    def _new_hist(bounds: tuple[float, ...]) -> list[float]:
        return [0.0] * (len(bounds) + 2)

    def unregister(self) -> None:
        with contextlib.suppress(KeyError):  # already removed
            self.registry.unregister(self._collector)

    # ------------------------------------------------------------------ hot path (actor)
    def on_command(
        self,
        kind: CommandKind,
        queue_wait_s: float,
        latency_s: float,
        error: BaseException | None,
    ) -> None:
        self._gen += 1
        try:
            h = self._latency.get(kind._value_)
            if h is None:  # a kind added to the enum after this exporter was built
                h = self._latency[kind._value_] = self._new_hist(self._cbounds)
            bounds = self._cbounds
            # Clocks are monotonic, but a negative value would corrupt the sum: clamp to 0.
            if latency_s > 0.0:
                h[bisect_left(bounds, latency_s)] += 1
                h[-1] += latency_s
            else:
                h[0] += 1
            h = self._wait
            if queue_wait_s > 0.0:
                h[bisect_left(bounds, queue_wait_s)] += 1
                h[-1] += queue_wait_s
            else:
                h[0] += 1
            if error is not None:
                name = _error_label(
                    type(error).__name__, self._error_types, self.config.max_error_types
                )
                key = (kind._value_, name)
                self._errors[key] = self._errors.get(key, 0) + 1
        finally:
            self._gen += 1

    def on_batch(self, stats: CacheStats, queued: int) -> None:
        self._latest = (stats, queued)

    # ------------------------------------------------------------------ transfers (any thread)
    def on_transfer(self, kind: TransferKind, tokens: int, nbytes: int, seconds: float) -> None:
        key = kind.value
        with self._tlock:
            t = self._transfers[key]
            t[0] += 1
            if tokens > 0:
                t[1] += tokens
            if nbytes > 0:
                t[2] += nbytes
            h = self._transfer_hists[key]
            if seconds > 0.0:
                h[bisect_left(self._tbounds, seconds)] += 1
                h[-1] += seconds
            else:
                h[0] += 1

    def transfer_started(self, kind: TransferKind) -> None:
        with self._tlock:
            self._in_flight[kind.value] += 1

    def transfer_finished(self, kind: TransferKind) -> None:
        with self._tlock:
            self._in_flight[kind.value] -= 1

    def set_transfers_in_flight(self, kind: TransferKind, count: int) -> None:
        with self._tlock:
            self._in_flight[kind.value] = count

    # ------------------------------------------------------------------ scrape
    def _read_commands(
        self,
    ) -> tuple[list[tuple[str, tuple[float, ...]]], tuple[float, ...], dict[tuple[str, str], int]]:
        """A consistent copy of the actor's command histograms and error counts."""
        for _ in range(_MAX_READ_TRIES):
            gen = self._gen
            if not gen & 1:
                copies = self._copy_commands()
                if self._gen == gen:
                    return copies
            time.sleep(0)  # the actor (another thread) is mid-update: let it finish
        return self._copy_commands()  # unreachable in practice: take what is there

    def _copy_commands(
        self,
    ) -> tuple[list[tuple[str, tuple[float, ...]]], tuple[float, ...], dict[tuple[str, str], int]]:
        # Each list/dict copy is one C call (atomic under the GIL); ``list(items())`` guards
        # against a kind added meanwhile.
        latency = [(k, tuple(h)) for k, h in list(self._latency.items())]
        return latency, tuple(self._wait), dict(self._errors)

    def _counter_value(self, key: Hashable, raw: int) -> int:
        """``raw`` plus what earlier incarnations of the source counted (reset detection)."""
        state = self._monotonic.get(key)
        if state is None:
            self._monotonic[key] = [raw, 0]
            return raw
        if raw < state[0]:  # went backwards: the source was reset or replaced
            state[1] += state[0]
        state[0] = raw
        return raw + state[1]

    def _last_counter_value(self, key: Hashable) -> int:
        last, offset = self._monotonic[key]
        return last + offset

    def collect(self) -> list[Metric]:
        """Every family, built from the latest snapshot and the accumulated numbers."""
        with self._tlock:
            transfers = {k: tuple(v) for k, v in self._transfers.items()}
            transfer_hists = {k: tuple(v) for k, v in self._transfer_hists.items()}
            in_flight = dict(self._in_flight)
        # Under the scrape lock: concurrent scrapes must take snapshots in order, or an older
        # one processed last would look like a counter reset.
        with self._scrape_lock:
            stats, queued = self._latest
            latency, wait, errors = self._read_commands()
            return self._families(stats, queued, latency, wait, errors, transfers,
                                  transfer_hists, in_flight)  # fmt: skip

    def _families(
        self,
        stats: CacheStats | None,
        queued: int,
        latency: list[tuple[str, tuple[float, ...]]],
        wait: tuple[float, ...],
        errors: Mapping[tuple[str, str], int],
        transfers: Mapping[str, tuple[float, ...]],
        transfer_hists: Mapping[str, tuple[float, ...]],
        in_flight: Mapping[str, int],
    ) -> list[Metric]:
        created = self._created if getattr(_client_metrics, "_use_created", True) else None
        scalars = (0, 0, 0, 0, 0)
        num_nodes = 0
        if stats is not None:
            for cs in stats.components:
                if cs.component not in self._units:
                    self._units[cs.component] = (
                        cs.unit if cs.unit in _SIZE else _unit_of(cs.component)
                    )
                self._sizes[(cs.component, cs.tier)] = (
                    self._units[cs.component],
                    _size_values(cs),
                )
            scalars = _scalars(stats)
            num_nodes = stats.num_nodes
            for tier_name, n in stats.hit_tokens.items():
                self._hit_tiers[tier_name] = None
                self._counter_value(("hit", tier_name), n)
            for key, n in stats.evicted.items():
                self._evicted_keys[key] = None
                self._counter_value(("evicted", key), n)

        fams: dict[str, Metric] = {}
        size = {unit: [_gauge(s) for s in specs] for unit, specs in _SIZE.items()}
        for (component, tier), (unit, values) in self._sizes.items():
            labels = [_label(component), _label(tier)]
            for fam, v in zip(size[unit], values, strict=True):
                fam.add_metric(labels, float(v))
        for fam in (*size["tokens"], *size["states"]):
            fams[fam.name] = fam
        fams[_NODES.name] = _gauge(_NODES, float(num_nodes))
        fams[_QUEUED.name] = _gauge(_QUEUED, float(queued))
        fams[_IN_FLIGHT.name] = fam = _gauge(_IN_FLIGHT)
        for kind, n in in_flight.items():
            fam.add_metric([kind], float(n))

        for spec, raw in zip(_SCALAR_COUNTERS, scalars, strict=True):
            fams[spec.name] = cfam = _counter(spec)
            cfam.add_metric([], float(self._counter_value(spec.name, raw)), created)
        fams[_HIT_TOKENS.name] = cfam = _counter(_HIT_TOKENS)
        for tier_name in self._hit_tiers:
            value = float(self._last_counter_value(("hit", tier_name)))
            cfam.add_metric([tier_name], value, created)
        evicted = {unit: _counter(spec) for unit, spec in _EVICTED.items()}
        for key in self._evicted_keys:
            component, tier = key
            evicted[self._units.get(component) or _unit_of(component)].add_metric(
                [_label(component), _label(tier)],
                float(self._last_counter_value(("evicted", key))),
                created,
            )
        for cfam in evicted.values():
            fams[cfam.name] = cfam

        for spec, i in ((_TRANSFERS, 0), (_TRANSFER_TOKENS, 1), (_TRANSFER_BYTES, 2)):
            fams[spec.name] = cfam = _counter(spec)
            for kind, figures in transfers.items():
                cfam.add_metric([kind], figures[i], created)
        fams[_TRANSFER_SECONDS.name] = hfam = _histogram(_TRANSFER_SECONDS)
        for kind, h in transfer_hists.items():
            _add_hist(hfam, [kind], self._tles, h, created)

        fams[_ERRORS.name] = cfam = _counter(_ERRORS)
        for (kind, error_type), n in errors.items():
            cfam.add_metric([kind, error_type], float(n), created)
        fams[_LATENCY.name] = hfam = _histogram(_LATENCY)
        for kind, h in latency:
            _add_hist(hfam, [kind], self._cles, h, created)
        fams[_QUEUE_WAIT.name] = hfam = _histogram(_QUEUE_WAIT)
        _add_hist(hfam, [], self._cles, wait, created)
        return [fams[s.name] for s in _ALL_SPECS]


def _gauge(spec: _Spec, value: float | None = None) -> GaugeMetricFamily:
    if value is not None:
        return GaugeMetricFamily(spec.name, spec.doc, value=value)
    return GaugeMetricFamily(spec.name, spec.doc, labels=spec.labels)


def _counter(spec: _Spec) -> CounterMetricFamily:
    return CounterMetricFamily(spec.name, spec.doc, labels=spec.labels)


def _histogram(spec: _Spec) -> HistogramMetricFamily:
    return HistogramMetricFamily(spec.name, spec.doc, labels=spec.labels)


def _add_hist(
    fam: HistogramMetricFamily,
    labels: list[str],
    les: tuple[str, ...],
    hist: tuple[float, ...],
    created: float | None,
) -> None:
    """Add one series: ``hist`` holds per-bucket counts (``+Inf`` last), then the sum."""
    buckets = list(zip(les, itertools.accumulate(hist[:-1]), strict=True))
    fam.add_metric(labels, buckets, hist[-1])
    if created is not None:  # as prometheus_client's own Histogram exposes
        names = fam._labelnames
        fam.samples.append(
            Sample(f"{fam.name}_created", dict(zip(names, labels, strict=True)), created)
        )


class _Collector:
    """What :class:`_ScrapeMetrics` registers: ``describe`` gives the names (so a second
    exporter on the same registry is refused), ``collect`` builds the families."""

    def __init__(self, owner: _ScrapeMetrics) -> None:
        self._collect: Callable[[], list[Metric]] = owner.collect

    def describe(self) -> list[Metric]:
        return [Metric(s.name, s.doc, s.type) for s in _ALL_SPECS]

    def collect(self) -> list[Metric]:
        return self._collect()


# ---------------------------------------------------------------------------- DIRECT mode
class _SizeSeries:
    """The five size gauges of one (component, tier), with the values last set."""

    __slots__ = ("gauges", "last")

    def __init__(self, gauges: tuple[Any, ...]) -> None:
        self.gauges = gauges
        self.last: tuple[int, ...] | None = None

    def update(self, cs: ComponentStats) -> None:
        values = _size_values(cs)
        last = self.last
        if values == last:  # the common case between batches of matches: nothing to write
            return
        if last is None:
            for g, v in zip(self.gauges, values, strict=True):
                g.set(v)
        else:
            for g, v, old in zip(self.gauges, values, last, strict=True):
                if v != old:
                    g.set(v)
        self.last = values


class _DirectMetrics(CacheMetrics):
    """DIRECT mode: ``prometheus_client`` metric objects written per batch and per command.

    :meth:`on_batch` sets only the gauges whose value changed and advances every cumulative
    counter by ``snapshot - previous snapshot`` (a decrease is a reset: the new value is the
    increase).  Works in multiprocess mode: plain ``set``/``inc``/``observe`` only.
    """

    def __init__(
        self, registry: CollectorRegistry = REGISTRY, config: MetricsConfig | None = None
    ) -> None:
        super().__init__(registry, config)
        self._collectors: list[Any] = []
        # Previous snapshot's cumulative counters (scalars, hit tokens by tier, evictions).
        self._prev_scalars = (0, 0, 0, 0, 0)
        self._prev_hits: dict[str, int] = {}
        self._prev_evicted: dict[tuple[ComponentType, Tier], int] = {}
        self._units: dict[ComponentType, str] = {}
        self._series: dict[tuple[ComponentType, Tier], _SizeSeries] = {}
        self._hit_children: dict[str, Any] = {}
        self._evicted_children: dict[tuple[ComponentType, Tier], Any] = {}
        self._error_children: dict[tuple[CommandKind, str], Any] = {}
        self._error_types: set[str] = set()
        self._last_nodes = -1
        self._last_queued = -1
        self._build()

    # ------------------------------------------------------------------ registration
    def _make(self, spec: _Spec, buckets: tuple[float, ...] = ()) -> Any:
        m: Any
        if spec.type == "gauge":
            m = Gauge(
                spec.name,
                spec.doc,
                spec.labels,
                registry=self.registry,
                multiprocess_mode=self.config.gauge_multiprocess_mode.value,
            )
        elif spec.type == "counter":
            m = Counter(spec.name, spec.doc, spec.labels, registry=self.registry)
        else:
            m = Histogram(spec.name, spec.doc, spec.labels, registry=self.registry,
                          buckets=buckets)  # fmt: skip
        self._collectors.append(m)
        return m

    def _build(self) -> None:
        cfg = self.config
        make = self._make
        self._size_gauges = {unit: tuple(make(s) for s in specs) for unit, specs in _SIZE.items()}
        self._nodes = make(_NODES)
        self._queued = make(_QUEUED)
        in_flight = make(_IN_FLIGHT)
        self._in_flight = {k: in_flight.labels(k.value) for k in TransferKind}
        match_requests = make(_MATCH_REQUESTS)
        query_tokens = make(_QUERY_TOKENS)
        self._hit_tokens = make(_HIT_TOKENS)
        inserted = make(_INSERTED)
        self._evicted = {unit: make(spec) for unit, spec in _EVICTED.items()}
        backed_up = make(_BACKED_UP)
        loaded_back = make(_LOADED_BACK)
        # In the order of ``_scalars``.
        self._scalar_counters = (match_requests, query_tokens, inserted, backed_up, loaded_back)
        transfers = make(_TRANSFERS)
        transfer_tokens = make(_TRANSFER_TOKENS)
        transfer_bytes = make(_TRANSFER_BYTES)
        transfer_seconds = make(_TRANSFER_SECONDS, cfg.transfer_buckets)
        self._transfer_children = {
            k: (
                transfers.labels(k.value),
                transfer_tokens.labels(k.value),
                transfer_bytes.labels(k.value),
                transfer_seconds.labels(k.value),
            )
            for k in TransferKind
        }
        self._errors = make(_ERRORS)
        latency = make(_LATENCY, cfg.command_buckets)
        self._latency = {k: latency.labels(k.value) for k in CommandKind}
        self._latency_family = latency
        self._queue_wait = make(_QUEUE_WAIT, cfg.command_buckets)

    def unregister(self) -> None:
        for c in self._collectors:
            with contextlib.suppress(KeyError):  # already removed
                self.registry.unregister(c)
        self._collectors.clear()

    # ------------------------------------------------------------------ ServiceObserver
    def on_command(
        self,
        kind: CommandKind,
        queue_wait_s: float,
        latency_s: float,
        error: BaseException | None,
    ) -> None:
        child = self._latency.get(kind)
        if child is None:  # a kind added to the enum after this exporter was built
            child = self._latency[kind] = self._latency_family.labels(kind.value)
        # Clocks are monotonic, but a negative value would corrupt ``_sum``; clamp defensively.
        child.observe(latency_s if latency_s > 0.0 else 0.0)
        self._queue_wait.observe(queue_wait_s if queue_wait_s > 0.0 else 0.0)
        if error is not None:
            name = _error_label(
                type(error).__name__, self._error_types, self.config.max_error_types
            )
            key = (kind, name)
            err = self._error_children.get(key)
            if err is None:
                err = self._error_children[key] = self._errors.labels(kind.value, name)
            err.inc()

    def on_batch(self, stats: CacheStats, queued: int) -> None:
        """Set every gauge from ``stats`` and advance counters by the snapshot deltas."""
        series = self._series
        for cs in stats.components:
            s = series.get((cs.component, cs.tier))
            if s is None:
                s = self._new_series(cs)
            s.update(cs)
        if stats.num_nodes != self._last_nodes:
            self._nodes.set(stats.num_nodes)
            self._last_nodes = stats.num_nodes
        if queued != self._last_queued:
            self._queued.set(queued)
            self._last_queued = queued

        scalars = _scalars(stats)
        prev = self._prev_scalars
        if scalars != prev:
            for counter, cur, old in zip(self._scalar_counters, scalars, prev, strict=True):
                if cur != old:
                    counter.inc(cur - old if cur > old else cur)
            self._prev_scalars = scalars
        if stats.hit_tokens != self._prev_hits:
            self._advance_hits(stats.hit_tokens)
        if stats.evicted != self._prev_evicted:
            self._advance_evicted(stats.evicted)

    def _new_series(self, cs: ComponentStats) -> _SizeSeries:
        unit = cs.unit if cs.unit in self._size_gauges else _unit_of(cs.component)
        self._units[cs.component] = unit
        labels = (_label(cs.component), _label(cs.tier))
        s = _SizeSeries(tuple(g.labels(*labels) for g in self._size_gauges[unit]))
        self._series[(cs.component, cs.tier)] = s
        return s

    def _advance_hits(self, hits: Mapping[str, int]) -> None:
        prev = self._prev_hits
        children = self._hit_children
        for tier, cur in hits.items():
            old = prev.get(tier, 0)
            if cur != old:
                child = children.get(tier)
                if child is None:
                    child = children[tier] = self._hit_tokens.labels(tier)
                child.inc(cur - old if cur > old else cur)
        self._prev_hits = dict(hits)

    def _advance_evicted(self, evicted: Mapping[tuple[ComponentType, Tier], int]) -> None:
        prev = self._prev_evicted
        children = self._evicted_children
        for key, cur in evicted.items():
            old = prev.get(key, 0)
            if cur != old:
                child = children.get(key)
                if child is None:
                    component, tier = key
                    unit = self._units.get(component) or _unit_of(component)
                    child = children[key] = self._evicted[unit].labels(
                        _label(component), _label(tier)
                    )
                child.inc(cur - old if cur > old else cur)
        self._prev_evicted = dict(evicted)

    def on_transfer(self, kind: TransferKind, tokens: int, nbytes: int, seconds: float) -> None:
        count, tok, byt, duration = self._transfer_children[kind]
        count.inc()
        if tokens > 0:
            tok.inc(tokens)
        if nbytes > 0:
            byt.inc(nbytes)
        duration.observe(seconds if seconds > 0.0 else 0.0)

    # ------------------------------------------------------------------ in-flight transfers
    def transfer_started(self, kind: TransferKind) -> None:
        self._in_flight[kind].inc()

    def transfer_finished(self, kind: TransferKind) -> None:
        self._in_flight[kind].dec()

    def set_transfers_in_flight(self, kind: TransferKind, count: int) -> None:
        self._in_flight[kind].set(count)


def make_observer(
    config: MetricsConfig | None = None, registry: CollectorRegistry = REGISTRY
) -> CacheMetrics | None:
    """A :class:`CacheMetrics` for the service's ``observer=``, or ``None`` when disabled.

    ``None`` is the cheapest "off": the service then skips the observer calls entirely.
    """
    config = config if config is not None else MetricsConfig()
    return CacheMetrics(registry, config) if config.enabled else None
