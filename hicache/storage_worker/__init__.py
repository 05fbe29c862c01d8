"""The L3 storage tier's background work inside the async service (``StorageWorker``).

A background worker of :class:`~urc.service.AsyncUnifiedRadixCache` (pass it in ``workers=``
next to the :class:`~hicache.controller.HiCacheController`).  It talks to the tree only
through ``svc.call`` and moves page bytes between the host pools and a
:class:`~hicache.storage.StorageBackend`; copies between host pools and staging buffers run in
worker threads.

- **Backup** (``StorageConfig.backup_policy``):

  * ``WRITE_THROUGH``: each host backup commit (the tier event ``host_committed``) queues
    the backed-up node; the worker pins the path's host copies (``host_lock_ref``), asks the
    store how many leading Full pages it already holds, stages the rest (and the other
    components' pages of the same span, see below) and ``put``s them, then unpins.
  * ``ON_HOST_EVICTION``: host eviction (the tier event ``host_evicted``) copies the
    evicted leaf's pages (every component's) into staging memory on the spot (bounded by
    ``max_pending_bytes``) and the worker ``put``s them afterwards.  A node's pages are
    reachable in storage once its ancestors were evicted (and so written) too.
  * ``OFF``: nothing is written (the store is filled by other instances).

- **Prefetch** (:meth:`StorageWorker.prefetch`, and :meth:`StorageWorker.fetch` which also
  loads the result to device through the controller): finds where the key's host copies end
  (pinning that node), asks the store how many further Full pages it holds, reserves host
  slots, ``get``s the pages into staging buffers under the stop policy, then looks up and
  reads the other components' pages of the fetched span (under the same policy), copies what
  arrived into host slots and inserts it as host-only nodes (``urc.host.transfers.insert_host``
  with one :class:`~urc.host.transfers.HostPart` list per auxiliary component).

Keys are the versioned chained page keys of ``hicache.storage.keys`` over the token path from
the root, with the node's namespace (``extra_key``) and the component tag: two namespaces
never share a page, and each component's pages have their own keys:

- **FULL**: one page per ``page_size`` tokens of the path; the Full pages are what a hit is
  made of (leading pages only, as the store counts them).
- **SWA** (per token, like Full): the page key of each page whose SWA host copy exists; a
  page without one (an SWA tombstone on host) is simply not stored.  On a storage hit the SWA
  part of the fetched span is restored where stored, read as the leading and the trailing run
  of stored SWA pages of the span (two ``exists`` calls; a window of SWA above the span's end,
  which the match validator needs, is the trailing run).  The rest of the span, including an
  island of SWA pages between two gaps, comes back as SWA tombstones (a shorter hit, never a
  wrong one).
- **MAMBA** (one state per node position where a state exists): keyed by the page key of the
  last page of the node's span, with the ``mamba`` tag, stored as one "page" (the state's
  conv + temporal bytes).  On a storage hit every page end of the fetched span is a candidate
  (probed with one ``exists`` each, ``batch_pages`` at a time); a state found becomes the
  host state of a new node ending exactly at its position (the new nodes are cut there), a
  position without one has no state.

Auxiliary pages are written for the same span as the Full pages of a job (pages the store
already had under their Full keys are assumed stored with theirs) and only where those Full
pages were stored; they are read only for the Full pages a prefetch fetched.  Absent or
unreadable auxiliary pages are just not restored.

Faults degrade: a store error, a miss or a timeout is a miss (the caller recomputes).  Every
failed storage call (the worker calls the backend with ``raise_errors=True``, so a failure is
never mistaken for a miss) is counted in :attr:`StorageWorkerStats.errors`, reported to an
observer that takes storage errors (:class:`~hicache.storage.stats.StorageErrorObserver`, e.g.
the Prometheus exporter: ``urc_storage_errors_total{backend,op}``) and backs the worker off
(:class:`RetryPolicy`): while backing off, prefetches read as misses without calling the
store, and backups wait; a backup whose write failed is retried (up to
``RetryPolicy.max_attempts`` writes, then dropped and counted in ``dropped_writes``).  No
storage failure ever escapes the worker, so it never fails the service (and the service
survives a failing background worker anyway).  Reserved host slots are freed and pins
released on every path (cancellation included).  Only pages that were read completely and
verified by the codec are ever committed.  EAGLE bigram keys are rejected.

Modules: ``worker`` (:class:`StorageWorker`, which puts the rest together), ``backup``
(the writes), ``prefetch`` (the reads), ``calls`` (the counted calls to the backend),
``context`` (what the writes and the reads share), ``jobs`` (write jobs), ``layout`` (host
pages as byte rows), ``retry`` (backoff), ``stats`` (the counters).
"""

from hicache.storage_worker.layout import HostPageLayout
from hicache.storage_worker.retry import RetryPolicy
from hicache.storage_worker.stats import StorageWorkerStats
from hicache.storage_worker.worker import StorageWorker

__all__ = ["HostPageLayout", "RetryPolicy", "StorageWorker", "StorageWorkerStats"]
