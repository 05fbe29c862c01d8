"""``StorageWorkerStats``: the cumulative counters of one storage worker."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StorageWorkerStats"]


@dataclass(slots=True)
class StorageWorkerStats:
    """Cumulative counters of one worker (pages are storage pages of any component: Full and
    SWA pages of ``page_size`` tokens, Mamba states).

    ``prefetch_hit_tokens`` counts tokens inserted on host from storage (also added to the
    cache's ``hit_tokens[Tier.STORAGE]``); ``prefetch_misses`` prefetches that brought nothing
    (no page stored, a failure, or a timeout before the first page); ``prefetch_timeouts``
    prefetches stopped by their deadline; ``errors`` storage calls that failed (an error or
    a timeout of the store, or a storage error raised for the call); ``retried_writes``
    backups queued again after a failed write; ``dropped_writes`` backups skipped because a
    bound was reached or their writes kept failing (or a detach gave them up);
    ``cancelled_prefetches`` prefetches a detach gave back (cancelled past its drain
    deadline: their host slots freed, their pins released, a miss for their caller).
    """

    pages_written: int = 0
    pages_read: int = 0
    prefetches: int = 0
    prefetch_hit_tokens: int = 0
    prefetch_misses: int = 0
    prefetch_timeouts: int = 0
    errors: int = 0
    retried_writes: int = 0
    dropped_writes: int = 0
    cancelled_prefetches: int = 0
