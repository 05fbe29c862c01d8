"""``BackupWriter``: the storage worker's writes, from host copies to the L3 store.

Write-through: each host backup commit queues the backed-up node; the writer pins the path's
host copies (``host_lock_ref``), asks the store how many leading Full pages it already
holds, stages the rest (and the other components' pages of the same span) and ``put``s them,
then unpins.  On host eviction: the evicted leaf's pages (every component's) are copied into
staging memory on the spot (bounded by ``max_pending_bytes``) and ``put`` afterwards.  A
failed write is retried (up to ``RetryPolicy.max_attempts`` writes, then dropped and counted).

A flush is bounded: it waits at most ``StorageConfig.flush_timeout_s``, and while it waits a
store known to be down (``RetryPolicy.down_after`` failed calls in a row) makes every queued
write fail fast -- dropped and counted, not retried with its own back-off.  :meth:`close`
flushes, then refuses (and counts) further writes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import torch

from hicache.config import StorageBackupPolicy
from hicache.storage_worker.context import WorkerContext
from hicache.storage_worker.jobs import AuxPages, WriteJob, aux_pages_of, path_of, path_tokens
from urc.cache import UnifiedRadixCache
from urc.host import transfers as host_transfers
from urc.host_protocol import TierEvents
from urc.node import ComponentType, TreeNode
from urc.service import TransferKind

if TYPE_CHECKING:
    from urc.service import AsyncUnifiedRadixCache

__all__ = ["BackupWriter"]

FULL = ComponentType.FULL


class BackupWriter(TierEvents):
    """Queued backups and the loop that writes them (see the module docstring).

    The tier events :meth:`host_committed` (write-through) and :meth:`host_evicted` (on host
    eviction) queue work inside the actor, each under its backup policy only; :meth:`run` is
    the worker's background coroutine.
    """

    def __init__(self, ctx: WorkerContext) -> None:
        self.layouts = ctx.layouts
        self.calls = ctx.calls
        self.config = ctx.config
        self.retry = ctx.retry
        self.stats = ctx.stats
        self.observer = ctx.observer
        self.policy = ctx.config.backup_policy
        self._attempts: dict[int, int] = {}  # write-through: failed writes per node id
        self._due: dict[int, TreeNode] = {}  # write-through: nodes whose host copy landed
        self._staged: deque[WriteJob] = deque()  # on host eviction: pages copied out
        self._staged_bytes = 0
        self._wake: anyio.Event | None = None
        self._idle: anyio.Event | None = None
        self._flushing = 0  # flushes waiting: a store known to be down drops the queue
        self._closed = False
        self.pinning = 0  # write-through jobs holding host locks right now
        self._putting = 0  # staged jobs being put right now

    @property
    def pending(self) -> int:
        """Backups queued (write-through nodes due, pages staged) or being written."""
        return len(self._due) + len(self._staged) + self.pinning + self._putting

    # ------------------------------------------------------------------ tier events (actor)
    def _signal(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def host_committed(self, node: TreeNode) -> None:
        """Write-through: ``node``'s host copy landed; queue its path for a put."""
        if self.policy is not StorageBackupPolicy.WRITE_THROUGH:
            return
        if self._closed:
            self.stats.dropped_writes += 1
            return
        if node.id not in self._due and len(self._due) >= self.config.max_pending_writes:
            self.stats.dropped_writes += 1
            return
        self._due[node.id] = node
        self._signal()

    def host_evicted(self, node: TreeNode) -> None:
        """On host eviction: stage the host-only leaf's pages now (its slots are freed right
        after), put them later."""
        if self.policy is not StorageBackupPolicy.ON_HOST_EVICTION:
            return
        if self._closed:
            self.stats.dropped_writes += 1
            return
        cd = node.data[FULL]
        assert cd is not None and cd.host_value is not None
        layouts = self.layouts
        path = path_of(node)
        start = sum(n.key_len for n in path[:-1])
        aux = aux_pages_of(layouts, [node], start)
        nbytes = cd.host_value.shape[0] // layouts.page_size * layouts.full.page_bytes
        nbytes += sum(len(a.pages) * layouts.by_type[a.ct].page_bytes for a in aux)
        if self._staged_bytes + nbytes > self.config.max_pending_bytes:
            self.stats.dropped_writes += 1
            return
        tokens = path_tokens(path)
        # Host -> staging memcpy inside the actor: the slots are freed right after this.
        rows = layouts.full.gather(cd.host_value)
        for a in aux:
            assert a.host is not None
            a.rows = layouts.by_type[a.ct].gather(a.host)
            a.host = None
        job = WriteJob(tokens, node.namespace, start // layouts.page_size, rows=rows, aux=aux)
        job.nbytes = nbytes
        self._staged.append(job)
        self._staged_bytes += nbytes
        self._signal()

    # ------------------------------------------------------------------ the write loop
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
                await self.calls.backoff.wait()
                if self._staged:
                    await self._put_staged()
                else:
                    await self._write_through(svc)

    async def _put_staged(self) -> None:
        """Put up to ``StorageConfig.write_concurrency`` staged jobs at once (a store's
        calls overlap: one job's file or network I/O runs while the next is prepared)."""
        jobs: list[WriteJob] = []
        while self._staged and len(jobs) < self.config.write_concurrency:
            job = self._staged.popleft()
            self._staged_bytes -= job.nbytes
            jobs.append(job)
        done = [False] * len(jobs)

        async def put(i: int) -> None:
            done[i] = await self._put(jobs[i])

        self._putting += len(jobs)
        try:
            async with anyio.create_task_group() as group:
                for i in range(len(jobs)):
                    group.start_soon(put, i)
        finally:
            self._putting -= len(jobs)
        for job, ok in zip(reversed(jobs), reversed(done), strict=True):
            if not ok:
                self._retry_staged(job)  # back at the front, in their order

    def _fail_fast(self) -> bool:
        """While a flush waits on a store known to be down: drop (and count) every queued
        write; returns whether it did."""
        if not (self._flushing and self.calls.backoff.store_down):
            return False
        self.stats.dropped_writes += len(self._due) + len(self._staged)
        self._due.clear()
        self._staged.clear()
        self._staged_bytes = 0
        self._attempts.clear()
        return True

    def _retry_staged(self, job: WriteJob) -> None:
        job.attempts += 1
        if self._fail_fast():
            self.stats.dropped_writes += 1
            return
        if job.attempts >= self.retry.max_attempts:
            self.stats.dropped_writes += 1
            return
        self.stats.retried_writes += 1
        self._staged.appendleft(job)
        self._staged_bytes += job.nbytes

    def _retry_due(self, node: TreeNode) -> None:
        attempts = self._attempts.get(node.id, 0) + 1
        if self._fail_fast():
            self.stats.dropped_writes += 1
            return
        if attempts >= self.retry.max_attempts:
            self._attempts.pop(node.id, None)
            self.stats.dropped_writes += 1
            return
        self._attempts[node.id] = attempts
        self.stats.retried_writes += 1
        self._due.setdefault(node.id, node)

    async def flush(self, timeout_s: float | None = None) -> int:
        """Wait until every queued backup was written or dropped, at most ``timeout_s``
        (default ``StorageConfig.flush_timeout_s``); a store known to be down drops the queue
        at once.  What is still queued at the deadline is dropped.  Returns the writes
        dropped meanwhile (all counted in ``stats.dropped_writes``)."""
        dropped = self.stats.dropped_writes
        self._flushing += 1
        try:
            # No drop up front: the store may be back since its last failure.  The first
            # write that fails while the store is known down drops the rest.
            with anyio.move_on_after(
                self.config.flush_timeout_s if timeout_s is None else timeout_s
            ):
                while (
                    self._due
                    or self._staged
                    or (self._idle is not None and not self._idle.is_set())
                ):
                    if self._idle is None:
                        await anyio.sleep(0.001)  # not started yet: let ``run`` begin
                        continue
                    await self._idle.wait()
            self.stats.dropped_writes += len(self._due) + len(self._staged)
            self._due.clear()
            self._staged.clear()
            self._staged_bytes = 0
        finally:
            self._flushing -= 1
        return self.stats.dropped_writes - dropped

    async def close(self, timeout_s: float | None = None) -> int:
        """:meth:`flush` (bounded the same way), then drop and count every later write;
        returns the writes the flush dropped."""
        try:
            return await self.flush(timeout_s)
        finally:
            self._closed = True

    def drop_queued(self) -> int:
        """Drop (and count) every queued write and take no more; returns how many were
        dropped.  Synchronous: a detach without a service."""
        dropped = len(self._due) + len(self._staged)
        self.stats.dropped_writes += dropped
        self._due.clear()
        self._staged.clear()
        self._staged_bytes = 0
        self._attempts.clear()
        self._closed = True
        return dropped

    async def _write_through(self, svc: AsyncUnifiedRadixCache) -> None:
        picked: list[TreeNode] = []

        def start(cache: UnifiedRadixCache) -> WriteJob | None:
            if not self._due:  # a flush dropped the queue meanwhile
                return None
            _, node = self._due.popitem()
            picked.append(node)
            if node.deleted:
                return None
            path = path_of(node)
            hosts = []
            for n in path:
                cd = n.data[FULL]
                assert cd is not None
                if cd.host_value is None:
                    return None  # the chain lost a host copy meanwhile: nothing to write
                hosts.append(cd.host_value)
            job = WriteJob(path_tokens(path), node.namespace, 0)
            job.host = torch.cat(hosts)
            # Host locks pin every component's host copies: host eviction takes whole leaves.
            job.aux = aux_pages_of(self.layouts, path, 0)
            for n in path:
                cache.inc_host_lock_ref(n)
                job.pins.append((n, n.key_len))
            return job

        def undo(cache: UnifiedRadixCache, job: WriteJob | None) -> None:
            if job is not None:
                _unpin(cache, job.pins)

        job = await svc.call(start, undo=undo)
        if job is None:
            if picked:
                self._attempts.pop(picked[0].id, None)
            return
        self.pinning += 1
        try:
            ok = await self._put(job)
        finally:
            with anyio.CancelScope(shield=True):
                await svc.call(lambda cache: _unpin(cache, job.pins))
            self.pinning -= 1
        if ok:
            self._attempts.pop(picked[0].id, None)
        else:
            self._retry_due(picked[0])

    def _aux_rows(self, aux: AuxPages, sel: list[int]) -> torch.Tensor:
        """Rows of the selected pages of ``aux`` (staged, or gathered from host now)."""
        if aux.rows is not None:
            return aux.rows[sel]
        assert aux.host is not None
        layout = self.layouts.by_type[aux.ct]
        host = aux.host.view(-1, layout.page_size)[sel].reshape(-1)
        return layout.gather(host)

    async def _put(self, job: WriteJob) -> bool:
        """Store the job's pages not yet stored; False if a storage call failed (counted,
        never raised; the caller retries the job)."""
        t0 = time.perf_counter()
        ps = self.layouts.page_size
        calls = self.calls
        full = self.layouts.full
        keys = (await anyio.to_thread.run_sync(calls.keys, job.tokens, job.namespace))[
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
                skip = await calls.exists(keys)
                if skip is None:
                    return False
                if skip == len(keys):
                    return True
                assert job.host is not None
                host = job.host[skip * ps :]
                rows = await anyio.to_thread.run_sync(full.gather, host)
            else:
                rows = job.rows
            assert skip is not None
            first = skip
            stored = await calls.put(keys[first:], rows)
            if stored is None:
                return False
            written += stored
            nbytes += stored * full.page_bytes
            # Auxiliary pages of the Full pages just stored.
            lo = job.first_page + skip
            hi = lo + stored
            for aux in job.aux:
                sel = [i for i, p in enumerate(aux.pages) if lo <= p < hi]
                if not sel:
                    continue
                ckeys = await anyio.to_thread.run_sync(
                    calls.keys, job.tokens[: hi * ps], job.namespace, aux.ct
                )
                arows = await anyio.to_thread.run_sync(self._aux_rows, aux, sel)
                akeys = [ckeys[aux.pages[i]] for i in sel]
                n = await calls.put(akeys, arows)
                if n is None:
                    ok = False
                    break
                written += n
                nbytes += n * self.layouts.by_type[aux.ct].page_bytes
        finally:
            self.stats.pages_written += written
            if written and self.observer is not None:
                self.observer.on_transfer(
                    TransferKind.STORAGE_WRITE, (stored or 0) * ps, nbytes, time.perf_counter() - t0
                )
        return ok


def _unpin(cache: UnifiedRadixCache, pins: Sequence[tuple[TreeNode, int]]) -> None:
    for node, length in pins:
        host_transfers.host_unlock_pieces(cache, node, length)
