"""SCRAPE mode: the actor only updates plain numbers; a collector builds every family at
scrape time (single process)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Hashable, Mapping, Sequence
from enum import Enum

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client import metrics as _client_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample

from metrics.config import ExportMode, MetricsConfig, _le
from metrics.exporter import CacheMetrics, register_mode
from metrics.spec import (
    _ALL_SPECS,
    _ERRORS,
    _EVICTED,
    _HIT_TOKENS,
    _IN_FLIGHT,
    _LATENCY,
    _NODES,
    _QUEUE_WAIT,
    _QUEUED,
    _SCALAR_COUNTERS,
    _SIZE,
    _STORAGE_ERRORS,
    _TRANSFER_BYTES,
    _TRANSFER_SECONDS,
    _TRANSFER_TOKENS,
    _TRANSFERS,
    _error_label,
    _label,
    _scalars,
    _size_values,
    _Spec,
    _unit_of,
)
from urc.node import ComponentType, Tier
from urc.service import CommandKind, ServiceSnapshot, StatsSource, TransferKind
from urc.stats import CacheStats

__all__: list[str] = []

# ---------------------------------------------------------------------------- SCRAPE mode
# A scrape in another thread retries its copy of the actor's numbers while the actor is in
# the middle of an update (see ``_ScrapeMetrics._read_commands``); after this many tries it
# takes what it has.  Under the GIL the actor finishes an update within one switch interval.
_MAX_READ_TRIES = 1000


@register_mode(ExportMode.SCRAPE)
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
        # Attached to a service: where scrapes pull their snapshot, and the newest one a
        # scrape processed (under ``_scrape_lock``).
        self._source: StatsSource | None = None
        self._pulled: ServiceSnapshot | None = None
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
        self._storage_errors: dict[tuple[str, str], int] = {}  # (backend, op) -> failures
        # Scrape-side state (under ``_scrape_lock``): last figures of every series seen, so a
        # series stays exported once it appeared, and reset detection for the counters.
        self._scrape_lock = threading.Lock()
        self._sizes: dict[tuple[ComponentType, Tier], tuple[str, tuple[int, ...]]] = {}
        self._units: dict[ComponentType, str] = {}
        self._monotonic: dict[Hashable, list[int]] = {}  # key -> [last raw value, offset]
        self._hit_tiers: dict[Tier, None] = {}
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

    def attach(self, source: StatsSource) -> float | None:
        """Pull a snapshot from ``source`` at every scrape; no ``on_batch`` wanted."""
        with self._scrape_lock:
            self._source = source
            self._pulled = None
        return None

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

    def on_storage_error(self, backend: str, op: Enum) -> None:
        key = (backend, str(op.value))
        with self._tlock:
            self._storage_errors[key] = self._storage_errors.get(key, 0) + 1

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
        """Every family, built from a snapshot (pulled from the attached service now, else the
        latest given to :meth:`on_batch`) and the accumulated numbers."""
        # Outside the locks: from another thread this waits for the service's event loop,
        # which may itself be scraping.
        source = self._source
        snap = source.snapshot() if source is not None else None
        with self._tlock:
            transfers = {k: tuple(v) for k, v in self._transfers.items()}
            transfer_hists = {k: tuple(v) for k, v in self._transfer_hists.items()}
            in_flight = dict(self._in_flight)
            storage_errors = dict(self._storage_errors)
        # Under the scrape lock: concurrent scrapes must process snapshots in order, or an
        # older one processed last would look like a counter reset.
        with self._scrape_lock:
            if snap is not None and self._source is source:
                pulled = self._pulled
                if pulled is not None and pulled.seq > snap.seq:
                    snap = pulled  # a concurrent scrape already processed a newer one
                self._pulled = snap
                stats: CacheStats | None = snap.stats
                queued = snap.queued
            else:
                stats, queued = self._latest
            latency, wait, errors = self._read_commands()
            return self._families(stats, queued, latency, wait, errors, transfers,
                                  transfer_hists, in_flight, storage_errors)  # fmt: skip

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
        storage_errors: Mapping[tuple[str, str], int],
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
            for hit_tier, n in stats.hit_tokens.items():
                self._hit_tiers[hit_tier] = None
                self._counter_value(("hit", hit_tier), n)
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
        for hit_tier in self._hit_tiers:
            value = float(self._last_counter_value(("hit", hit_tier)))
            cfam.add_metric([_label(hit_tier)], value, created)
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
            _add_hist(hfam, _TRANSFER_SECONDS.labels, [kind], self._tles, h, created)

        fams[_ERRORS.name] = cfam = _counter(_ERRORS)
        for (kind, error_type), n in errors.items():
            cfam.add_metric([kind, error_type], float(n), created)
        fams[_LATENCY.name] = hfam = _histogram(_LATENCY)
        for kind, h in latency:
            _add_hist(hfam, _LATENCY.labels, [kind], self._cles, h, created)
        fams[_QUEUE_WAIT.name] = hfam = _histogram(_QUEUE_WAIT)
        _add_hist(hfam, _QUEUE_WAIT.labels, [], self._cles, wait, created)
        fams[_STORAGE_ERRORS.name] = cfam = _counter(_STORAGE_ERRORS)
        for (backend, op), n in storage_errors.items():
            cfam.add_metric([backend, op], float(n), created)
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
    names: Sequence[str],
    labels: list[str],
    les: tuple[str, ...],
    hist: tuple[float, ...],
    created: float | None,
) -> None:
    """Add one series: ``hist`` holds per-bucket counts (``+Inf`` last), then the sum."""
    buckets = list(zip(les, itertools.accumulate(hist[:-1]), strict=True))
    fam.add_metric(labels, buckets, hist[-1])
    if created is not None:  # as prometheus_client's own Histogram exposes
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
