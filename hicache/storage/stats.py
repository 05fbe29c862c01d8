"""Counters every storage backend keeps, and their immutable snapshot; the operations they
count failures of (:class:`StorageOp`), and who can be told of each failure
(:class:`StorageErrorObserver`, e.g. the Prometheus exporter)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, runtime_checkable

__all__ = ["StatsCounter", "StorageErrorObserver", "StorageOp", "StorageStats"]


class StorageOp(Enum):
    """A public storage operation (the ``op`` label of failure counts)."""

    EXISTS = "exists"
    GET = "get"
    PUT = "put"
    DELETE = "delete"
    CLEAR = "clear"


@runtime_checkable
class StorageErrorObserver(Protocol):
    """Told of every failed storage call (an error or a timeout) of a worker's backend:
    ``backend`` is the backend's ``name`` (``file``, ``valkey``, ``mooncake``)."""

    def on_storage_error(self, backend: str, op: Enum) -> None: ...


@dataclass(frozen=True)
class StorageStats:
    """A snapshot of a backend's counters since it was created.

    ``reads``/``writes`` count pages read into buffers / stored; ``errors`` counts failed
    operations other than timeouts (connection refused, I/O error); ``timeouts`` counts
    operations that ran past their deadline; ``corrupt`` counts stored pages that failed the
    header or checksum check; ``failures`` counts failed public calls (errors and timeouts)
    by operation.
    """

    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    timeouts: int = 0
    corrupt: int = 0
    failures: Mapping[StorageOp, int] = field(default_factory=dict)


class StatsCounter:
    """Mutable counters owned by one backend; ``snapshot()`` freezes them into ``StorageStats``.

    Only the event loop thread updates it, so plain integer fields need no lock.
    """

    __slots__ = (
        "bytes_read",
        "bytes_written",
        "corrupt",
        "errors",
        "failures",
        "reads",
        "timeouts",
        "writes",
    )

    def __init__(self) -> None:
        self.reads = 0
        self.writes = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.errors = 0
        self.timeouts = 0
        self.corrupt = 0
        self.failures: dict[StorageOp, int] = {}

    def record_failure(self, op: StorageOp) -> None:
        """Count one failed public call of ``op``."""
        self.failures[op] = self.failures.get(op, 0) + 1

    def record_read(self, nbytes: int) -> None:
        """Count one page read into a buffer."""
        self.reads += 1
        self.bytes_read += nbytes

    def record_write(self, nbytes: int) -> None:
        """Count one page stored."""
        self.writes += 1
        self.bytes_written += nbytes

    def snapshot(self) -> StorageStats:
        """Return the current values; later updates do not change the returned object."""
        return StorageStats(
            reads=self.reads,
            writes=self.writes,
            bytes_read=self.bytes_read,
            bytes_written=self.bytes_written,
            errors=self.errors,
            timeouts=self.timeouts,
            corrupt=self.corrupt,
            failures=dict(self.failures),
        )
