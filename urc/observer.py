"""Observability hook of the async service (the contract ``metrics/`` codes against).

The service calls an optional :class:`ServiceObserver` from inside its actor task.  With no
observer the only cost is an ``is None`` check per command and per batch.

Contract:

- :meth:`ServiceObserver.on_command` is called by the actor once for every command it took
  from the queue, after applying it (also when applying raised; ``error`` is then the
  exception the caller receives).  ``queue_wait_s`` runs from the moment the caller sent the
  command to the moment the actor took it; ``latency_s`` is the time spent applying it.
- :meth:`ServiceObserver.on_batch` is called by the actor after each batch of commands (all the
  commands it found queued in one wake-up) with a fresh ``cache.stats()`` snapshot and the
  number of commands still queued.
- :meth:`ServiceObserver.on_transfer` is called by background workers (HiCache) after each
  completed data transfer.

Observers run on the event loop inside the actor: they must be fast, must not block and must
not raise (an exception escaping an observer is treated as a failure of the actor).
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol, runtime_checkable

from urc.commands import CommandKind
from urc.stats import CacheStats

__all__ = ["CommandKind", "ServiceObserver", "TransferKind"]


class TransferKind(Enum):
    """Direction of a data transfer between tiers."""

    BACKUP = "backup"  # device -> host
    LOAD_BACK = "load_back"  # host -> device
    STORAGE_READ = "storage_read"  # storage (L3) -> host
    STORAGE_WRITE = "storage_write"  # host -> storage (L3)


@runtime_checkable
class ServiceObserver(Protocol):
    """Receives per-command timings, per-batch stats snapshots and transfer events."""

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
