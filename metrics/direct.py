"""DIRECT mode: the actor writes prometheus_client metrics after every batch (works in
prometheus multiprocess mode)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from enum import Enum
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from metrics.config import ExportMode, MetricsConfig
from metrics.exporter import CacheMetrics, register_mode
from metrics.spec import (
    _BACKED_UP,
    _ERRORS,
    _EVICTED,
    _HIT_TOKENS,
    _IN_FLIGHT,
    _INSERTED,
    _LATENCY,
    _LOADED_BACK,
    _MATCH_REQUESTS,
    _NODES,
    _QUERY_TOKENS,
    _QUEUE_WAIT,
    _QUEUED,
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
from urc.service import CommandKind, StatsSource, TransferKind
from urc.stats import CacheStats, ComponentStats

__all__: list[str] = []


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


@register_mode(ExportMode.DIRECT)
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
        self._prev_hits: dict[Tier, int] = {}
        self._prev_evicted: dict[tuple[ComponentType, Tier], int] = {}
        self._units: dict[ComponentType, str] = {}
        self._series: dict[tuple[ComponentType, Tier], _SizeSeries] = {}
        self._hit_children: dict[Tier, Any] = {}
        self._evicted_children: dict[tuple[ComponentType, Tier], Any] = {}
        self._error_children: dict[tuple[str, str], Any] = {}
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
        # Children made once, keyed by the enum's value: an Enum's own hash is a Python call.
        self._latency = {k._value_: latency.labels(k.value) for k in CommandKind}
        self._latency_family = latency
        self._queue_wait = make(_QUEUE_WAIT, cfg.command_buckets)
        self._storage_errors = make(_STORAGE_ERRORS)

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
        child = self._latency.get(kind._value_)
        if child is None:  # a kind added to the enum after this exporter was built
            child = self._latency[kind._value_] = self._latency_family.labels(kind.value)
        # Clocks are monotonic, but a negative value would corrupt ``_sum``; clamp defensively.
        child.observe(latency_s if latency_s > 0.0 else 0.0)
        self._queue_wait.observe(queue_wait_s if queue_wait_s > 0.0 else 0.0)
        if error is not None:
            name = _error_label(
                type(error).__name__, self._error_types, self.config.max_error_types
            )
            key = (kind._value_, name)
            err = self._error_children.get(key)
            if err is None:
                err = self._error_children[key] = self._errors.labels(kind.value, name)
            err.inc()

    def attach(self, source: StatsSource) -> float | None:
        """Snapshots are pushed (``on_batch``) at most every ``direct_interval_s`` while the
        service is busy, and whenever it goes idle."""
        return self.config.direct_interval_s

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

    def _advance_hits(self, hits: Mapping[Tier, int]) -> None:
        prev = self._prev_hits
        children = self._hit_children
        for tier, cur in hits.items():
            old = prev.get(tier, 0)
            if cur != old:
                child = children.get(tier)
                if child is None:
                    child = children[tier] = self._hit_tokens.labels(_label(tier))
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

    def on_storage_error(self, backend: str, op: Enum) -> None:
        self._storage_errors.labels(backend, str(op.value)).inc()

    # ------------------------------------------------------------------ in-flight transfers
    def transfer_started(self, kind: TransferKind) -> None:
        self._in_flight[kind].inc()

    def transfer_finished(self, kind: TransferKind) -> None:
        self._in_flight[kind].dec()

    def set_transfers_in_flight(self, kind: TransferKind, count: int) -> None:
        self._in_flight[kind].set(count)
