"""The metric table: every family the exporter publishes (name, type, HELP, labels)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from metrics.config import NAMESPACE, OTHER_ERROR
from urc.components import component_class
from urc.node import ComponentType
from urc.stats import CacheStats, ComponentStats

__all__: list[str] = []


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
_BACKED_UP = _spec(
    "counter",
    "backed_up_tokens",
    "Tokens backed up device -> host by every path: the HiCache controller's background "
    "backups (write_through) and the synchronous ones made at eviction (write_back).",
)
_LOADED_BACK = _spec("counter", "loaded_back_tokens", "Tokens loaded back host -> device.")
_TRANSFERS = _spec(
    "counter",
    "transfers",
    "Completed data transfers run by background workers: kind=backup|load_back the HiCache "
    "controller's (write_through backups; write_back backups are made synchronously at "
    "eviction, are no transfer here and count in urc_backed_up_tokens_total only), "
    "kind=storage_read|storage_write the L3 reads/writes.",
    ("kind",),
)
_TRANSFER_TOKENS = _spec(
    "counter",
    "transfer_tokens",
    "Tokens moved by completed transfers, as reported by workers (the transfers of "
    "urc_transfers_total: write_back backups are not among them).",
    ("kind",),
)
_TRANSFER_BYTES = _spec(
    "counter",
    "transfer_bytes",
    "Bytes moved by completed transfers (those of urc_transfers_total).",
    ("kind",),
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
_STORAGE_ERRORS = _spec(
    "counter",
    "storage_errors",
    "Failed L3 storage calls (store errors and timeouts), by backend and operation.",
    ("backend", "op"),
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
    _STORAGE_ERRORS,
)


def _label(value: Enum) -> str:
    """Label value of a component/tier enum: its lower-case name ("full", "device")."""
    return value.name.lower()


def _unit_of(component: ComponentType) -> str:
    # Used only for counters of a component not (yet) seen in a snapshot's ``components``:
    # the unit its class declares.
    return component_class(component).unit.value


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
