"""Observability hook of the async service (the contract ``metrics/`` codes against).

The service calls an optional :class:`ServiceObserver` from inside its actor task.  With no
observer the only cost is an ``is None`` check per command and per batch.

Contract:

- :meth:`ServiceObserver.on_command` is called by the actor once for every command it took
  from the queue, after applying it (also when applying raised; ``error`` is then the
  exception the caller receives).  ``queue_wait_s`` runs from the moment the caller sent the
  command to the moment the actor took it; ``latency_s`` is the time spent applying it.
- :meth:`ServiceObserver.on_batch` gets a fresh ``cache.stats()`` snapshot and the number of
  commands still queued.  A plain observer gets it after every batch of commands (all the
  commands the actor found queued in one wake-up) and once more at close.
- An observer that also implements :class:`PullingObserver` is handed a
  :class:`StatsSource` when the service starts (:meth:`PullingObserver.attach`) and says how
  often it wants ``on_batch``: ``None`` -- never, it pulls a snapshot from the source when it
  needs one (e.g. at scrape time), so the actor builds no snapshot per batch; a number ``s``
  -- after a batch at most every ``s`` seconds while the service is busy, plus after the last
  batch before the actor goes idle and once at close, so the figures it was given are never
  staler than ``s`` and are exact whenever the service is idle or closed; ``0`` -- after
  every batch, like a plain observer.
- :meth:`ServiceObserver.on_transfer` is called by background workers (HiCache) after each
  completed data transfer.

Observers run on the event loop inside the actor: they must be fast, must not block and must
not raise (an exception escaping an observer is treated as a failure of the actor).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

from urc.service._commands import CommandKind
from urc.stats import CacheStats

__all__ = [
    "CommandKind",
    "PullingObserver",
    "ServiceObserver",
    "ServiceSnapshot",
    "StatsSource",
    "TransferKind",
]


class TransferKind(Enum):
    """Direction of a data transfer between tiers."""

    BACKUP = "backup"  # device -> host
    LOAD_BACK = "load_back"  # host -> device
    STORAGE_READ = "storage_read"  # storage (L3) -> host
    STORAGE_WRITE = "storage_write"  # host -> storage (L3)


@runtime_checkable
class ServiceObserver(Protocol):
    """Receives per-command timings, stats snapshots and transfer events."""

    def on_command(
        self,
        kind: CommandKind,
        queue_wait_s: float,
        latency_s: float,
        error: BaseException | None,
    ) -> None:
        """One command was applied (``error`` is what it raised, else ``None``)."""

    def on_batch(self, stats: CacheStats, queued: int) -> None:
        """A batch of commands was applied; ``queued`` commands are still waiting."""

    def on_transfer(self, kind: TransferKind, tokens: int, nbytes: int, seconds: float) -> None:
        """A background transfer of ``tokens`` tokens (``nbytes`` bytes) took ``seconds``."""


@dataclass(frozen=True, slots=True)
class ServiceSnapshot:
    """The service's figures at one moment between two commands.

    ``seq`` increases with every snapshot a source hands out, so a consumer that received two
    snapshots in different threads can tell which is newer.
    """

    stats: CacheStats
    queued: int
    seq: int


class StatsSource(Protocol):
    """Where a :class:`PullingObserver` gets a snapshot when it needs one."""

    def snapshot(self) -> ServiceSnapshot:
        """The figures as of now: never taken in the middle of a command.

        Callable from any thread.  On the service's event loop thread it is taken at once;
        from another thread it is taken on the loop (this call waits for it, a bounded
        time, then falls back to the newest snapshot taken so far).  After the service has
        closed it returns the snapshot taken at close.
        """
        ...


@runtime_checkable
class PullingObserver(ServiceObserver, Protocol):
    """A :class:`ServiceObserver` that pulls snapshots instead of receiving one per batch."""

    def attach(self, source: StatsSource) -> float | None:
        """The service starts: keep ``source``; return how often ``on_batch`` is wanted
        (``None``: never; seconds: at most that often while busy, see the module doc)."""
        ...
