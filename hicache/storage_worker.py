"""``StorageWorker``: the L3 storage tier's background work inside the async service.

A background worker of :class:`~urc.service.AsyncUnifiedRadixCache` (pass it in ``workers=``
next to the :class:`~hicache.controller.HiCacheController`).  It talks to the tree only
through ``svc.call`` and moves page bytes between the host pools and a
:class:`~hicache.storage.StorageBackend`; copies between host pools and staging buffers run in
worker threads.

- **Backup** (``StorageConfig.backup_policy``):

  * ``WRITE_THROUGH``: each host backup commit (the core's ``host_commit_listener``) queues
    the backed-up node; the worker pins the path's host copies (``host_lock_ref``), asks the
    store how many leading Full pages it already holds, stages the rest (and the other
    components' pages of the same span, see below) and ``put``s them, then unpins.
  * ``ON_HOST_EVICTION``: host eviction (the core's ``host_evict_listener``) copies the
    evicted leaf's pages (every component's) into staging memory on the spot (bounded by
    ``max_pending_bytes``) and the worker ``put``s them afterwards.  A node's pages are
    reachable in storage once its ancestors were evicted (and so written) too.
  * ``OFF``: nothing is written (the store is filled by other instances).

- **Prefetch** (:meth:`StorageWorker.prefetch`, and :meth:`StorageWorker.fetch` which also
  loads the result to device through the controller): finds where the key's host copies end
  (pinning that node), asks the store how many further Full pages it holds, reserves host
  slots, ``get``s the pages into staging buffers under the stop policy, then looks up and
  reads the other components' pages of the fetched span (under the same policy), copies what
  arrived into host slots and inserts it as host-only nodes (``urc.tiering.insert_host``
  with one :class:`~urc.tiering.HostPart` list per auxiliary component).

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
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import torch

from hicache.config import PrefetchStopPolicy, StorageBackupPolicy, StorageConfig
from hicache.host_pool import HostPool
from hicache.storage.base import StorageBackend
from hicache.storage.errors import StorageError
from hicache.storage.keys import StorageComponent, page_keys
from hicache.storage.stats import StorageErrorObserver, StorageOp
from hicache.tier import HostMemoryTier
from urc import tiering
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError
from urc.key import RadixKey
from urc.observer import ServiceObserver, TransferKind
from urc.tiering import HostPart
from urc.tree import ComponentType, SizeUnit, TreeNode

if TYPE_CHECKING:
    from hicache.controller import HiCacheController
    from urc.service import AsyncUnifiedRadixCache

__all__ = ["HostPageLayout", "RetryPolicy", "StorageWorker", "StorageWorkerStats"]

_log = logging.getLogger(__name__)
FULL = ComponentType.FULL
_STORAGE_COMPONENT = {
    ComponentType.FULL: StorageComponent.FULL,
    ComponentType.SWA: StorageComponent.SWA,
    ComponentType.MAMBA: StorageComponent.MAMBA,
}


class HostPageLayout:
    """Whole pages of a host pool as flat byte rows (the unit a storage page holds).

    A Mamba host pool has pages of one slot: a row is one state (conv + temporal bytes).

    A page of ``page_size`` slots spans every host buffer; its bytes are the concatenation,
    buffer by buffer, of ``[outer, page_bytes_in_buffer]`` blocks.  :meth:`gather` copies
    pages out into a ``[pages, page_bytes]`` uint8 tensor; :meth:`scatter` copies rows back.
    """

    def __init__(self, pool: HostPool) -> None:
        self.page_size = pool.page_size
        self.views: list[torch.Tensor] = []
        for buf, dim in pool.host_buffers:
            outer = 1
            for d in buf.shape[:dim]:
                outer *= d
            units = buf.shape[dim] // self.page_size
            self.views.append(buf.view(outer, units, -1).view(torch.uint8))
        self.page_bytes = sum(v.shape[0] * v.shape[2] for v in self.views)

    def units(self, host_indices: torch.Tensor) -> torch.Tensor:
        """Page numbers of page-aligned host slot indices."""
        ps = self.page_size
        return host_indices if ps == 1 else torch.div(host_indices[::ps], ps, rounding_mode="floor")

    def gather(self, host_indices: torch.Tensor) -> torch.Tensor:
        """The pages of ``host_indices`` as ``[pages, page_bytes]`` uint8 rows (a copy)."""
        units = self.units(host_indices)
        n = int(units.shape[0])
        out = torch.empty((n, self.page_bytes), dtype=torch.uint8)
        off = 0
        for v in self.views:
            o, _, b = v.shape
            out[:, off : off + o * b].view(n, o, b).copy_(v.index_select(1, units).permute(1, 0, 2))
            off += o * b
        return out

    def scatter(self, rows: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Copy ``[pages, page_bytes]`` rows into the pages of ``host_indices``."""
        units = self.units(host_indices)
        n = int(units.shape[0])
        off = 0
        for v in self.views:
            o, _, b = v.shape
            v.index_copy_(1, units, rows[:, off : off + o * b].reshape(n, o, b).permute(1, 0, 2))
            off += o * b


@dataclass(slots=True)
class StorageWorkerStats:
    """Cumulative counters of one worker (pages are storage pages of any component: Full and
    SWA pages of ``page_size`` tokens, Mamba states).

    ``prefetch_hit_tokens`` counts tokens inserted on host from storage (also added to the
    cache's ``hit_tokens["storage"]``); ``prefetch_misses`` prefetches that brought nothing
    (no page stored, a failure, or a timeout before the first page); ``prefetch_timeouts``
    prefetches stopped by their deadline; ``errors`` storage calls that failed (an error or
    a timeout of the store, or a storage error raised for the call); ``retried_writes``
    backups queued again after a failed write; ``dropped_writes`` backups skipped because a
    bound was reached or their writes kept failing.
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


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How the worker backs off after a failed storage call: the first failure pauses
    storage calls for ``initial_s``, each further one in a row multiplies the pause by
    ``multiplier`` up to ``max_s``; a success ends it.  A backup is written at most
    ``max_attempts`` times."""

    initial_s: float = 0.05
    max_s: float = 2.0
    multiplier: float = 2.0
    max_attempts: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.multiplier < 1 or self.max_attempts < 1:
            raise ConfigError(f"invalid retry policy: {self}")


class _Backoff:
    """The worker's pause after failed storage calls (see :class:`RetryPolicy`)."""

    __slots__ = ("delay", "policy", "until")

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.delay = 0.0
        self.until = 0.0

    def failed(self) -> None:
        p = self.policy
        self.delay = p.initial_s if self.delay == 0.0 else min(self.delay * p.multiplier, p.max_s)
        self.until = time.monotonic() + self.delay

    def succeeded(self) -> None:
        self.delay = 0.0
        self.until = 0.0

    @property
    def active(self) -> bool:
        """Whether storage calls are paused now."""
        return self.until > 0.0 and time.monotonic() < self.until

    async def wait(self) -> None:
        """Sleep until the pause is over."""
        remaining = self.until - time.monotonic()
        if remaining > 0:
            await anyio.sleep(remaining)


@dataclass(slots=True, eq=False)
class _Aux:
    """An auxiliary component's pages of a write job.  ``pages`` are page numbers along the
    path (per-token data: the page's own tokens; a state: the page its position ends); their
    host units (``page_size`` per page for per-token data, one per state) are in ``host``
    (pinned by the job) or already staged as ``rows``."""

    ct: ComponentType
    pages: list[int]
    host: torch.Tensor | None = None
    rows: torch.Tensor | None = None


@dataclass(slots=True, eq=False)
class _WriteJob:
    """Full pages ``[first_page, ...)`` of ``tokens`` to put: read from ``host`` (pinned by
    ``pins``) or already staged in ``rows``; ``aux``: other components' pages of the path."""

    tokens: list[Any]
    namespace: Any
    first_page: int
    host: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    pins: list[tuple[TreeNode, int]] = field(default_factory=list)
    aux: list[_Aux] = field(default_factory=list)
    nbytes: int = 0  # staged bytes (on host eviction)
    attempts: int = 0  # failed writes so far (staged jobs)


@dataclass(slots=True, eq=False)
class _Prefetch:
    start: int  # token position where the key's host copies end
    anchor: TreeNode  # the node there, host-locked (the root: not locked)
    anchor_len: int
    tokens: list[Any]


# An auxiliary component's pages read by a prefetch: indexes into the fetched span's pages
# (a state: the page its position ends) and their staged rows.
_AuxRead = dict[ComponentType, tuple[list[int], torch.Tensor]]


def _path(node: TreeNode) -> list[TreeNode]:
    nodes: list[TreeNode] = []
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes


def _runs(idx: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive values of the sorted ``idx``: ``(first, length)`` each."""
    runs: list[tuple[int, int]] = []
    for i in idx:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class StorageWorker:
    """Backup to and prefetch from an L3 store for one cache (see the module docstring).

    Build it after :func:`~hicache.tier.attach_hicache`; ``controller`` (optional) is used
    by :meth:`fetch` to load prefetched pages on to device.
    """

    def __init__(
        self,
        cache: UnifiedRadixCache,
        tier: HostMemoryTier,
        storage: StorageBackend,
        config: StorageConfig | None = None,
        *,
        controller: HiCacheController | None = None,
        observer: ServiceObserver | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        if cache.is_eagle:
            raise ConfigError("the storage tier does not support EAGLE bigram keys")
        for c in cache.components:
            if c.component_type not in _STORAGE_COMPONENT or c.component_type not in tier.pools:
                raise ConfigError(f"the storage tier cannot store {c.component_type.name}")
        self.cache = cache
        self.tier = tier
        self.storage = storage
        self.config = config or StorageConfig()
        self.controller = controller
        self.observer = observer
        self._error_sink: StorageErrorObserver | None = None
        sink: object = observer  # a ServiceObserver that may also take storage errors
        if isinstance(sink, StorageErrorObserver):
            self._error_sink = sink
        self.retry = retry or RetryPolicy()
        self._backoff = _Backoff(self.retry)
        self._attempts: dict[int, int] = {}  # write-through: failed writes per node id
        self.layouts = {
            c.component_type: HostPageLayout(tier.pools[c.component_type]) for c in cache.components
        }
        self.layout = self.layouts[FULL]
        # Auxiliary components, and whether each holds per-token data (else: per-position
        # states, one host unit each).
        self.aux = [c.component_type for c in cache.components if c.component_type is not FULL]
        self._per_token = {c.component_type: c.unit is SizeUnit.TOKENS for c in cache.components}
        self.page_size = cache.page_size
        self.stats = StorageWorkerStats()
        self._due: dict[int, TreeNode] = {}  # write-through: nodes whose host copy landed
        self._staged: deque[_WriteJob] = deque()  # on host eviction: pages copied out
        self._staged_bytes = 0
        self._wake: anyio.Event | None = None
        self._idle: anyio.Event | None = None
        self._busy = False
        policy = self.config.backup_policy
        if policy is StorageBackupPolicy.WRITE_THROUGH:
            cache.host_commit_listener = self._on_host_commit
        elif policy is StorageBackupPolicy.ON_HOST_EVICTION:
            cache.host_evict_listener = self._on_host_evict

    # ------------------------------------------------------------------ listeners (actor)
    def _signal(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _on_host_commit(self, node: TreeNode) -> None:
        if node.id not in self._due and len(self._due) >= self.config.max_pending_writes:
            self.stats.dropped_writes += 1
            return
        self._due[node.id] = node
        self._signal()

    def _aux_of(self, nodes: Sequence[TreeNode], pos: int) -> list[_Aux]:
        """The auxiliary host copies of ``nodes`` (consecutive, the first at key position
        ``pos``) as write-job pages."""
        ps = self.page_size
        out: list[_Aux] = []
        for ct in self.aux:
            per_token = self._per_token[ct]
            pages: list[int] = []
            hosts: list[torch.Tensor] = []
            p = pos
            for n in nodes:
                e = p + n.key_len
                cd = n.data[ct]
                assert cd is not None
                if cd.host_value is not None:
                    if per_token:
                        pages.extend(range(p // ps, e // ps))
                    else:
                        pages.append(e // ps - 1)
                    hosts.append(cd.host_value)
                p = e
            if pages:
                out.append(_Aux(ct, pages, host=torch.cat(hosts)))
        return out

    def _on_host_evict(self, node: TreeNode) -> None:
        cd = node.data[FULL]
        assert cd is not None and cd.host_value is not None
        path = _path(node)
        start = sum(n.key_len for n in path[:-1])
        aux = self._aux_of([node], start)
        nbytes = cd.host_value.shape[0] // self.page_size * self.layout.page_bytes
        nbytes += sum(len(a.pages) * self.layouts[a.ct].page_bytes for a in aux)
        if self._staged_bytes + nbytes > self.config.max_pending_bytes:
            self.stats.dropped_writes += 1
            return
        tokens = [t for n in path for t in n.key]
        # Host -> staging memcpy inside the actor: the slots are freed right after this.
        rows = self.layout.gather(cd.host_value)
        for a in aux:
            assert a.host is not None
            a.rows = self.layouts[a.ct].gather(a.host)
            a.host = None
        job = _WriteJob(tokens, node.namespace, start // self.page_size, rows=rows, aux=aux)
        job.nbytes = nbytes
        self._staged.append(job)
        self._staged_bytes += nbytes
        self._signal()

    # ------------------------------------------------------------------ worker entry point
    async def run(self, svc: AsyncUnifiedRadixCache) -> None:
        """Write queued backups until cancelled (by the service's close)."""
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        if self._due or self._staged:
            self._wake.set()
        while True:
            if not (self._due or self._staged):
                self._idle.set()
                await self._wake.wait()
            self._wake = anyio.Event()
            self._idle = anyio.Event()
            while self._due or self._staged:
                await self._backoff.wait()
                if self._staged:
                    job = self._staged.popleft()
                    self._staged_bytes -= job.nbytes
                    if not await self._put(job):
                        self._retry_staged(job)
                else:
                    await self._write_through(svc)

    def _retry_staged(self, job: _WriteJob) -> None:
        job.attempts += 1
        if job.attempts >= self.retry.max_attempts:
            self.stats.dropped_writes += 1
            return
        self.stats.retried_writes += 1
        self._staged.appendleft(job)
        self._staged_bytes += job.nbytes

    def _retry_due(self, node: TreeNode) -> None:
        attempts = self._attempts.get(node.id, 0) + 1
        if attempts >= self.retry.max_attempts:
            self._attempts.pop(node.id, None)
            self.stats.dropped_writes += 1
            return
        self._attempts[node.id] = attempts
        self.stats.retried_writes += 1
        self._due.setdefault(node.id, node)

    async def flush(self) -> None:
        """Wait until every queued backup was written (or failed)."""
        while self._due or self._staged or (self._idle is not None and not self._idle.is_set()):
            if self._idle is None:
                await anyio.sleep(0)  # not started yet: let ``run`` begin
                continue
            await self._idle.wait()

    async def _write_through(self, svc: AsyncUnifiedRadixCache) -> None:
        picked: list[TreeNode] = []

        def start(cache: UnifiedRadixCache) -> _WriteJob | None:
            _, node = self._due.popitem()
            picked.append(node)
            if node.deleted:
                return None
            path = _path(node)
            hosts = []
            for n in path:
                cd = n.data[FULL]
                assert cd is not None
                if cd.host_value is None:
                    return None  # the chain lost a host copy meanwhile: nothing to write
                hosts.append(cd.host_value)
            job = _WriteJob([t for n in path for t in n.key], node.namespace, 0)
            job.host = torch.cat(hosts)
            # Host locks pin every component's host copies: host eviction takes whole leaves.
            job.aux = self._aux_of(path, 0)
            for n in path:
                cache.inc_host_lock_ref(n)
                job.pins.append((n, n.key_len))
            return job

        def undo(cache: UnifiedRadixCache, job: _WriteJob | None) -> None:
            if job is not None:
                self._unpin(cache, job.pins)

        job = await svc.call(start, undo=undo)
        if job is None:
            self._attempts.pop(picked[0].id, None)
            return
        try:
            ok = await self._put(job)
        finally:
            with anyio.CancelScope(shield=True):
                await svc.call(lambda cache: self._unpin(cache, job.pins))
        if ok:
            self._attempts.pop(picked[0].id, None)
        else:
            self._retry_due(picked[0])

    def _free_host_full(self, cache: UnifiedRadixCache, slots: torch.Tensor | None) -> None:
        """``undo`` of a host-slot reservation whose result never reached its caller."""
        if slots is not None:
            self.tier.host_free(FULL, slots)

    @staticmethod
    def _unpin(cache: UnifiedRadixCache, pins: Sequence[tuple[TreeNode, int]]) -> None:
        for node, length in pins:
            tiering.host_unlock_pieces(cache, node, length)

    def _keys(self, tokens: list[Any], namespace: Any, ct: ComponentType = FULL) -> list[str]:
        return page_keys(tokens, self.page_size, _STORAGE_COMPONENT[ct], namespace)

    def _aux_rows(self, aux: _Aux, sel: list[int]) -> torch.Tensor:
        """Rows of the selected pages of ``aux`` (staged, or gathered from host now)."""
        if aux.rows is not None:
            return aux.rows[sel]
        assert aux.host is not None
        layout = self.layouts[aux.ct]
        host = aux.host.view(-1, layout.page_size)[sel].reshape(-1)
        return layout.gather(host)

    async def _store(self, op: StorageOp, call: Awaitable[int]) -> int | None:
        """Await one storage call (made with ``raise_errors=True``); a failure is counted,
        reported to the observer and backs the worker off, and returns ``None``."""
        try:
            n = await call
        except StorageError as exc:
            self.stats.errors += 1
            self._backoff.failed()
            if self._error_sink is not None:
                self._error_sink.on_storage_error(self.storage.name, op)
            _log.warning("storage %s failed: %s", op.value, exc)
            return None
        self._backoff.succeeded()
        return n

    async def _put(self, job: _WriteJob) -> bool:
        """Store the job's pages not yet stored; False if a storage call failed (counted,
        never raised; the caller retries the job)."""
        t0 = time.perf_counter()
        ps = self.page_size
        storage = self.storage
        keys = (await anyio.to_thread.run_sync(self._keys, job.tokens, job.namespace))[
            job.first_page :
        ]
        if not keys:
            return True
        written = nbytes = 0
        stored: int | None = 0
        ok = True
        try:
            skip: int | None = 0
            if job.rows is None:
                skip = await self._store(StorageOp.EXISTS, storage.exists(keys, raise_errors=True))
                if skip is None:
                    return False
                if skip == len(keys):
                    return True
                assert job.host is not None
                host = job.host[skip * ps :]
                rows = await anyio.to_thread.run_sync(self.layout.gather, host)
            else:
                rows = job.rows
            assert skip is not None
            first = skip
            stored = await self._store(
                StorageOp.PUT, storage.put(keys[first:], list(rows), raise_errors=True)
            )
            if stored is None:
                return False
            written += stored
            nbytes += stored * self.layout.page_bytes
            # Auxiliary pages of the Full pages just stored.
            lo = job.first_page + skip
            hi = lo + stored
            for aux in job.aux:
                sel = [i for i, p in enumerate(aux.pages) if lo <= p < hi]
                if not sel:
                    continue
                ckeys = await anyio.to_thread.run_sync(
                    self._keys, job.tokens[: hi * ps], job.namespace, aux.ct
                )
                arows = await anyio.to_thread.run_sync(self._aux_rows, aux, sel)
                akeys = [ckeys[aux.pages[i]] for i in sel]
                n = await self._store(
                    StorageOp.PUT, storage.put(akeys, list(arows), raise_errors=True)
                )
                if n is None:
                    ok = False
                    break
                written += n
                nbytes += n * self.layouts[aux.ct].page_bytes
        finally:
            self.stats.pages_written += written
            if written and self.observer is not None:
                self.observer.on_transfer(
                    TransferKind.STORAGE_WRITE, (stored or 0) * ps, nbytes, time.perf_counter() - t0
                )
        return ok

    # ------------------------------------------------------------------ prefetch
    async def fetch(
        self, svc: AsyncUnifiedRadixCache, key: RadixKey, stop: anyio.Event | None = None
    ) -> int:
        """:meth:`prefetch` ``key`` into host, then (with a controller) load its host part
        back to device; returns the tokens that came from storage."""
        got = await self.prefetch(svc, key, stop)
        if self.controller is not None:
            await self.controller.load_back(svc, key)
        return got

    async def prefetch(
        self, svc: AsyncUnifiedRadixCache, key: RadixKey, stop: anyio.Event | None = None
    ) -> int:
        """Bring the pages of ``key`` that are in storage but not on host into host memory,
        as host-only nodes; returns the tokens inserted (0: a miss).

        ``stop`` ends a ``BEST_EFFORT`` prefetch early (what arrived is kept); ``TIMEOUT``
        (and ``BEST_EFFORT`` without a ``stop``) stops at ``config.prefetch_timeout(pages)``;
        ``WAIT_COMPLETE`` reads every page the store reported.  The auxiliary components'
        pages of the fetched span are read afterwards under the same policy.
        """
        ps = self.page_size
        self.stats.prefetches += 1

        def begin(cache: UnifiedRadixCache) -> _Prefetch:
            start, anchor = tiering.host_prefix(cache, key)
            if anchor.parent is not None:
                cache.inc_host_lock_ref(anchor)
            tokens = key.token_ids[: len(key) - len(key) % ps]
            return _Prefetch(start, anchor, anchor.key_len, tokens)

        pf = await svc.call(begin)
        slots: torch.Tensor | None = None
        aux_slots: dict[ComponentType, torch.Tensor] = {}
        inserted = 0
        try:
            pages = len(pf.tokens) // ps - pf.start // ps
            if pages < self.config.prefetch_threshold_pages:
                return 0
            if self._backoff.active:  # the store failed just now: do not wait for it again
                self.stats.prefetch_misses += 1
                return 0
            all_keys = await anyio.to_thread.run_sync(self._keys, pf.tokens, key.extra_key)
            keys = all_keys[pf.start // ps :]
            storage = self.storage
            found = await self._store(StorageOp.EXISTS, storage.exists(keys, raise_errors=True))
            if not found:
                self.stats.prefetch_misses += 1
                return 0
            keys = keys[:found]
            need_pages = found

            def reserve(cache: UnifiedRadixCache) -> torch.Tensor | None:
                need = need_pages * ps
                short = need - self.tier.host_available(FULL)
                if short > 0:
                    cache.evict_host(short)
                return self.tier.host_alloc(FULL, need)

            slots = await svc.call(reserve, undo=self._free_host_full)
            if slots is None:
                self.stats.prefetch_misses += 1
                return 0
            t0 = time.perf_counter()
            rows = torch.empty((need_pages, self.layout.page_bytes), dtype=torch.uint8)
            got, timed_out = await self._read(keys, rows, stop)
            if got:
                self.stats.pages_read += got
                first = pf.start // ps
                aux_read, aux_timed_out = await self._read_aux(
                    pf.tokens, key.extra_key, first, got, stop
                )
                timed_out = timed_out or aux_timed_out
                seconds = time.perf_counter() - t0
                with anyio.CancelScope(shield=True):

                    def reserve_aux(cache: UnifiedRadixCache) -> None:
                        for ct, (idx, _) in aux_read.items():
                            n = len(idx) * self.layouts[ct].page_size
                            host = tiering.host_alloc(cache, ct, n)
                            if host is not None:
                                aux_slots[ct] = host

                    if aux_read:
                        await svc.call(reserve_aux)
                    placed = slots[: got * ps]
                    moves = [(self.layout, rows[:got], placed)]
                    moves += [(self.layouts[ct], aux_read[ct][1], h) for ct, h in aux_slots.items()]

                    def scatter() -> None:
                        for layout, r, h in moves:
                            layout.scatter(r, h)

                    await anyio.to_thread.run_sync(scatter)
                    nbytes = got * self.layout.page_bytes + sum(
                        int(r.shape[0]) * layout.page_bytes for layout, r, _ in moves[1:]
                    )
                    parts = self._parts(aux_read, aux_slots, first)
                    # The tree owns the slots from here (insert_host frees what it does not use).
                    slots = slots[got * ps :]
                    aux_slots = {}

                    def commit(cache: UnifiedRadixCache) -> int:
                        n = tiering.insert_host(
                            cache, key[: pf.start + got * ps], placed, pf.start, parts
                        )
                        cache.counters.hit_tokens["storage"] += n
                        return n

                    inserted = await svc.call(commit)
                self.stats.prefetch_hit_tokens += inserted
                if self.observer is not None:
                    self.observer.on_transfer(TransferKind.STORAGE_READ, got * ps, nbytes, seconds)
            else:
                self.stats.prefetch_misses += 1
            if timed_out:
                self.stats.prefetch_timeouts += 1
            return inserted
        finally:
            left = slots
            left_aux = aux_slots

            def finish(cache: UnifiedRadixCache) -> None:
                if left is not None and left.shape[0]:
                    self.tier.host_free(FULL, left)
                for ct, host in left_aux.items():
                    self.tier.host_free(ct, host)
                if pf.anchor.parent is not None:
                    tiering.host_unlock_pieces(cache, pf.anchor, pf.anchor_len)

            with anyio.CancelScope(shield=True):
                await svc.call(finish)

    def _parts(
        self, aux_read: _AuxRead, aux_slots: dict[ComponentType, torch.Tensor], first: int
    ) -> dict[ComponentType, list[HostPart]]:
        """``insert_host``'s parts of the auxiliary pages placed in ``aux_slots`` (the span
        starts at page ``first``)."""
        ps = self.page_size
        parts: dict[ComponentType, list[HostPart]] = {}
        for ct, host in aux_slots.items():
            idx = aux_read[ct][0]
            out = parts[ct] = []
            if self._per_token[ct]:
                j = 0
                for i, n in _runs(idx):
                    a = (first + i) * ps
                    out.append(HostPart(a, a + n * ps, host[j * ps : (j + n) * ps]))
                    j += n
            else:
                for j, i in enumerate(idx):
                    end = (first + i + 1) * ps
                    out.append(HostPart(end, end, host[j : j + 1]))
        return parts

    async def _bounded(
        self, pages: int, stop: anyio.Event | None, body: Callable[[], Awaitable[None]]
    ) -> bool:
        """Run ``body`` under the prefetch stop policy for ``pages`` pages; returns whether
        the deadline stopped it (a ``BEST_EFFORT`` stop is not a timeout)."""
        policy = self.config.prefetch_policy
        deadline: float | None = self.config.prefetch_timeout(pages)
        if policy is PrefetchStopPolicy.WAIT_COMPLETE:
            deadline = None
        async with anyio.create_task_group() as tg:
            if stop is not None and policy is PrefetchStopPolicy.BEST_EFFORT:

                async def watch() -> None:
                    await stop.wait()
                    tg.cancel_scope.cancel()  # keeps what ``body`` recorded so far

                tg.start_soon(watch)
            with anyio.move_on_after(deadline) as scope:
                await body()
            tg.cancel_scope.cancel()  # the watcher
        return scope.cancelled_caught

    async def _read(
        self, keys: list[str], rows: torch.Tensor, stop: anyio.Event | None
    ) -> tuple[int, bool]:
        """Read leading pages into ``rows`` batch by batch under the stop policy; returns
        how many leading rows hold verified pages, and whether the deadline stopped it."""
        got = [0]

        async def body() -> None:
            await self._get_leading(keys, rows, got)

        timed_out = await self._bounded(len(keys), stop, body)
        return got[0], timed_out

    async def _get_leading(self, keys: list[str], rows: torch.Tensor, got: list[int]) -> None:
        """Read leading pages into ``rows``, ``batch_pages`` at a time, adding each batch's
        count to ``got[0]`` as it arrives (a deadline keeps what arrived); a failed call or
        a short batch ends the read."""
        batch = self.config.batch_pages
        storage = self.storage
        for i in range(0, len(keys), batch):
            part = keys[i : i + batch]
            bufs = list(rows[i : i + len(part)])
            n = await self._store(StorageOp.GET, storage.get(part, bufs, raise_errors=True))
            got[0] += n or 0
            if n is None or n < len(part):
                break

    async def _exists(self, keys: list[str]) -> int:
        """Leading stored ``keys`` (0 on a failure, which ``_store`` counts)."""
        storage = self.storage
        n = await self._store(StorageOp.EXISTS, storage.exists(keys, raise_errors=True))
        return n or 0

    async def _present(self, ct: ComponentType, keys: list[str]) -> list[int]:
        """Indexes of the stored ``keys`` of ``ct`` (see the module docstring: per-token
        data, the leading and trailing runs; states, every key probed)."""
        n = len(keys)
        if self._per_token[ct]:
            lead = await self._exists(keys)
            if lead >= n - 1:
                return list(range(lead))
            trail = await self._exists(keys[lead + 1 :][::-1])
            return [*range(lead), *range(n - trail, n)]
        present = [False] * n
        limiter = anyio.CapacityLimiter(self.config.batch_pages)

        async def probe(i: int) -> None:
            async with limiter:
                present[i] = await self._exists([keys[i]]) > 0

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(probe, i)
        return [i for i in range(n) if present[i]]

    async def _read_aux(
        self,
        tokens: list[Any],
        namespace: Any,
        first: int,
        got: int,
        stop: anyio.Event | None,
    ) -> tuple[_AuxRead, bool]:
        """Look up and read the auxiliary pages of the fetched span ``[first, first + got)``
        (pages) under the stop policy; returns what was read completely per component, and
        whether the deadline stopped it."""
        out: _AuxRead = {}
        if not self.aux:
            return out, False
        ps = self.page_size

        async def body() -> None:
            for ct in self.aux:
                keys = (
                    await anyio.to_thread.run_sync(
                        self._keys, tokens[: (first + got) * ps], namespace, ct
                    )
                )[first:]
                idx = await self._present(ct, keys)
                if not idx:
                    continue
                wanted = [keys[i] for i in idx]
                rows = torch.empty((len(idx), self.layouts[ct].page_bytes), dtype=torch.uint8)
                read = [0]
                await self._get_leading(wanted, rows, read)
                n = read[0]
                if n:
                    self.stats.pages_read += n
                    out[ct] = (idx[:n], rows[:n])

        timed_out = await self._bounded(got, stop, body)
        return out, timed_out
