"""``StorageWorker``: the L3 storage tier's background work inside the async service.

A background worker of :class:`~urc.service.AsyncUnifiedRadixCache` (pass it in ``workers=``
next to the :class:`~hicache.controller.HiCacheController`).  It talks to the tree only
through ``svc.call`` and moves page bytes between the host pool and a
:class:`~hicache.storage.StorageBackend`; copies between host pool and staging buffers run in
worker threads.

- **Backup** (``StorageConfig.backup_policy``):

  * ``WRITE_THROUGH``: each host backup commit (the core's ``host_commit_listener``) queues
    the backed-up node; the worker pins the path's host copies (``host_lock_ref``), asks the
    store how many leading pages it already holds, stages the rest and ``put``s them, then
    unpins.
  * ``ON_HOST_EVICTION``: host eviction (the core's ``host_evict_listener``) copies the
    evicted leaf's pages into staging memory on the spot (bounded by ``max_pending_bytes``)
    and the worker ``put``s them afterwards.  A node's pages are reachable in storage once
    its ancestors were evicted (and so written) too.
  * ``OFF``: nothing is written (the store is filled by other instances).

- **Prefetch** (:meth:`StorageWorker.prefetch`, and :meth:`StorageWorker.fetch` which also
  loads the result to device through the controller): finds where the key's host copies end
  (pinning that node), asks the store how many further pages it holds, reserves host slots,
  ``get``s the pages into staging buffers under the stop policy, copies what arrived into the
  host slots and inserts it as host-only nodes (``cache.insert_host``).

Keys are the versioned chained page keys of ``hicache.storage.keys`` over the token path from
the root, with the node's namespace (``extra_key``): two namespaces never share a page.

Faults degrade: a store error, a miss or a timeout is a miss (the caller recomputes), counted
in :class:`StorageWorkerStats`; reserved host slots are freed and pins released on every path
(cancellation included).  Only pages that were read completely and verified by the codec are
ever committed.

Scope: caches with the FULL component only.  SWA and Mamba host data are not written or read
(a cache with those components is rejected): their data covers a window / a single position
per node, which a per-page chained key of the Full prefix does not describe.  EAGLE bigram
keys are rejected as well.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import torch

from hicache.config import PrefetchStopPolicy, StorageBackupPolicy, StorageConfig
from hicache.host_pool import HostPool
from hicache.storage.base import StorageBackend
from hicache.storage.errors import StorageError
from hicache.storage.keys import StorageComponent, page_keys
from hicache.tier import HostMemoryTier
from urc import tiering
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError
from urc.key import RadixKey
from urc.observer import ServiceObserver, TransferKind
from urc.tree import ComponentType, TreeNode

if TYPE_CHECKING:
    from hicache.controller import HiCacheController
    from urc.service import AsyncUnifiedRadixCache

__all__ = ["HostPageLayout", "StorageWorker", "StorageWorkerStats"]

_log = logging.getLogger(__name__)
FULL = ComponentType.FULL


class HostPageLayout:
    """Whole pages of a host pool as flat byte rows (the unit a storage page holds).

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
    """Cumulative counters of one worker (pages are storage pages of ``page_size`` tokens).

    ``prefetch_hit_tokens`` counts tokens inserted on host from storage (also added to the
    cache's ``hit_tokens["storage"]``); ``prefetch_misses`` prefetches that brought nothing
    (no page stored, a failure, or a timeout before the first page); ``prefetch_timeouts``
    prefetches stopped by their deadline; ``errors`` storage calls that raised a storage
    error; ``dropped_writes`` backups skipped because a bound was reached.
    """

    pages_written: int = 0
    pages_read: int = 0
    prefetches: int = 0
    prefetch_hit_tokens: int = 0
    prefetch_misses: int = 0
    prefetch_timeouts: int = 0
    errors: int = 0
    dropped_writes: int = 0


@dataclass(slots=True, eq=False)
class _WriteJob:
    """Pages ``[first_page, ...)`` of ``tokens`` to put: read from ``host`` (pinned by
    ``pins``) or already staged in ``rows``."""

    tokens: list[Any]
    namespace: Any
    first_page: int
    host: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    pins: list[tuple[TreeNode, int]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Prefetch:
    start: int  # token position where the key's host copies end
    anchor: TreeNode  # the node there, host-locked (the root: not locked)
    anchor_len: int
    tokens: list[Any]


def _path(node: TreeNode) -> list[TreeNode]:
    nodes: list[TreeNode] = []
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes


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
    ) -> None:
        if [c.component_type for c in cache.components] != [FULL]:
            raise ConfigError("the storage tier supports caches with the FULL component only")
        if cache.is_eagle:
            raise ConfigError("the storage tier does not support EAGLE bigram keys")
        self.cache = cache
        self.tier = tier
        self.storage = storage
        self.config = config or StorageConfig()
        self.controller = controller
        self.observer = observer
        self.layout = HostPageLayout(tier.pools[FULL])
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

    def _on_host_evict(self, node: TreeNode) -> None:
        cd = node.data[FULL]
        assert cd is not None and cd.host_value is not None
        nbytes = cd.host_value.shape[0] // self.page_size * self.layout.page_bytes
        if self._staged_bytes + nbytes > self.config.max_pending_bytes:
            self.stats.dropped_writes += 1
            return
        path = _path(node)
        start = sum(n.key_len for n in path[:-1])
        tokens = [t for n in path for t in n.key]
        # Host -> staging memcpy inside the actor: the slots are freed right after this.
        rows = self.layout.gather(cd.host_value)
        self._staged.append(_WriteJob(tokens, node.namespace, start // self.page_size, rows=rows))
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
                if self._staged:
                    job = self._staged.popleft()
                    assert job.rows is not None
                    self._staged_bytes -= job.rows.shape[0] * self.layout.page_bytes
                    await self._put(job)
                else:
                    await self._write_through(svc)

    async def flush(self) -> None:
        """Wait until every queued backup was written (or failed)."""
        while self._due or self._staged or (self._idle is not None and not self._idle.is_set()):
            if self._idle is None:
                await anyio.sleep(0)  # not started yet: let ``run`` begin
                continue
            await self._idle.wait()

    async def _write_through(self, svc: AsyncUnifiedRadixCache) -> None:
        def start(cache: UnifiedRadixCache) -> _WriteJob | None:
            _, node = self._due.popitem()
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
            for n in path:
                cache.inc_host_lock_ref(n)
                job.pins.append((n, n.key_len))
            return job

        job = await svc.call(start)
        if job is None:
            return
        try:
            await self._put(job)
        finally:
            with anyio.CancelScope(shield=True):
                await svc.call(lambda cache: self._unpin(cache, job.pins))

    @staticmethod
    def _unpin(cache: UnifiedRadixCache, pins: Sequence[tuple[TreeNode, int]]) -> None:
        for node, length in pins:
            tiering.host_unlock_pieces(cache, node, length)

    def _keys(self, tokens: list[Any], namespace: Any) -> list[str]:
        return page_keys(tokens, self.page_size, StorageComponent.FULL, namespace)

    async def _put(self, job: _WriteJob) -> None:
        """Store the job's pages not yet stored; failures are counted, never raised."""
        t0 = time.perf_counter()
        keys = (await anyio.to_thread.run_sync(self._keys, job.tokens, job.namespace))[
            job.first_page :
        ]
        if not keys:
            return
        try:
            skip = 0
            if job.rows is None:
                skip = await self.storage.exists(keys)
                if skip == len(keys):
                    return
                assert job.host is not None
                host = job.host[skip * self.page_size :]
                rows = await anyio.to_thread.run_sync(self.layout.gather, host)
            else:
                rows = job.rows
            stored = await self.storage.put(keys[skip:], list(rows))
        except StorageError as exc:
            self.stats.errors += 1
            _log.warning("storage backup failed: %s", exc)
            return
        self.stats.pages_written += stored
        if stored and self.observer is not None:
            self.observer.on_transfer(
                TransferKind.STORAGE_WRITE,
                stored * self.page_size,
                stored * self.layout.page_bytes,
                time.perf_counter() - t0,
            )

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
        ``WAIT_COMPLETE`` reads every page the store reported.
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
        inserted = 0
        try:
            pages = len(pf.tokens) // ps - pf.start // ps
            if pages < self.config.prefetch_threshold_pages:
                return 0
            all_keys = await anyio.to_thread.run_sync(self._keys, pf.tokens, key.extra_key)
            keys = all_keys[pf.start // ps :]
            try:
                found = await self.storage.exists(keys)
            except StorageError:
                self.stats.errors += 1
                found = 0
            if found == 0:
                self.stats.prefetch_misses += 1
                return 0
            keys = keys[:found]

            def reserve(cache: UnifiedRadixCache) -> torch.Tensor | None:
                need = found * ps
                short = need - self.tier.host_available(FULL)
                if short > 0:
                    cache.evict_host(short)
                return self.tier.host_alloc(FULL, need)

            slots = await svc.call(reserve)
            if slots is None:
                self.stats.prefetch_misses += 1
                return 0
            t0 = time.perf_counter()
            rows = torch.empty((found, self.layout.page_bytes), dtype=torch.uint8)
            got = await self._read(keys, rows, stop)
            if got:
                self.stats.pages_read += got
                seconds = time.perf_counter() - t0
                with anyio.CancelScope(shield=True):
                    placed = slots[: got * ps]
                    await anyio.to_thread.run_sync(self.layout.scatter, rows[:got], placed)
                    slots = slots[got * ps :]

                    def commit(cache: UnifiedRadixCache) -> int:
                        n = cache.insert_host(key[: pf.start + got * ps], placed, pf.start)
                        cache.counters.hit_tokens["storage"] += n
                        return n

                    inserted = await svc.call(commit)
                self.stats.prefetch_hit_tokens += inserted
                if self.observer is not None:
                    self.observer.on_transfer(
                        TransferKind.STORAGE_READ,
                        got * ps,
                        got * self.layout.page_bytes,
                        seconds,
                    )
            else:
                self.stats.prefetch_misses += 1
            return inserted
        finally:
            left = slots

            def finish(cache: UnifiedRadixCache) -> None:
                if left is not None and left.shape[0]:
                    self.tier.host_free(FULL, left)
                if pf.anchor.parent is not None:
                    tiering.host_unlock_pieces(cache, pf.anchor, pf.anchor_len)

            with anyio.CancelScope(shield=True):
                await svc.call(finish)

    async def _read(self, keys: list[str], rows: torch.Tensor, stop: anyio.Event | None) -> int:
        """Read leading pages into ``rows`` batch by batch under the stop policy; returns
        how many leading rows hold verified pages."""
        policy = self.config.prefetch_policy
        deadline: float | None = self.config.prefetch_timeout(len(keys))
        if policy is PrefetchStopPolicy.WAIT_COMPLETE:
            deadline = None
        batch = self.config.batch_pages
        got = 0
        async with anyio.create_task_group() as tg:
            if stop is not None and policy is PrefetchStopPolicy.BEST_EFFORT:

                async def watch() -> None:
                    await stop.wait()
                    tg.cancel_scope.cancel()  # keeps ``got``: the batches read so far

                tg.start_soon(watch)
            with anyio.move_on_after(deadline) as scope:
                try:
                    for i in range(0, len(keys), batch):
                        part = keys[i : i + batch]
                        n = await self.storage.get(part, list(rows[i : i + len(part)]))
                        got += n
                        if n < len(part):
                            break
                except StorageError as exc:
                    self.stats.errors += 1
                    _log.warning("storage prefetch failed: %s", exc)
            if scope.cancelled_caught:
                self.stats.prefetch_timeouts += 1
            tg.cancel_scope.cancel()  # the watcher
        return got
