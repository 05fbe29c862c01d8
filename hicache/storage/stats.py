"""Counters every storage backend keeps, and their immutable snapshot."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StatsCounter", "StorageStats"]


@dataclass(frozen=True)
class StorageStats:
    """A snapshot of a backend's counters since it was created.

    ``reads``/``writes`` count pages read into buffers / stored; ``errors`` counts failed
    operations other than timeouts (connection refused, I/O error); ``timeouts`` counts
    operations that ran past their deadline; ``corrupt`` counts stored pages that failed the
    header or checksum check.
    """

    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    timeouts: int = 0
    corrupt: int = 0


class StatsCounter:
    """Mutable counters owned by one backend; ``snapshot()`` freezes them into ``StorageStats``.

    Only the event loop thread updates it, so plain integer fields need no lock.
    """

    __slots__ = ("bytes_read", "bytes_written", "corrupt", "errors", "reads", "timeouts", "writes")

    def __init__(self) -> None:
        self.reads = 0
        self.writes = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.errors = 0
        self.timeouts = 0
        self.corrupt = 0

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
        )
