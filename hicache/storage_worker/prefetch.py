"""``Prefetcher``: the storage worker's reads, from the L3 store into host memory.

A prefetch finds where the key's host copies end (pinning that node), asks the store how
many further Full pages it holds, reserves host slots, ``get``s the pages into staging
buffers under the stop policy, then looks up and reads the other components' pages of the
fetched span (under the same policy), copies what arrived into host slots and inserts it as
host-only nodes (``urc.host.transfers.insert_host`` with one
:class:`~urc.host.transfers.HostPart` list per auxiliary component).  Reserved host slots
are freed and the pin released on every path, a natively cancelled caller included (the
reservations carry an ``undo``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch

from hicache.config import PrefetchStopPolicy
from hicache.storage_worker.context import WorkerContext
from urc.cache import UnifiedRadixCache
from urc.host import transfers as host_transfers
from urc.host_protocol import HostPart
from urc.key import RadixKey
from urc.node import ComponentType, Tier, TreeNode
from urc.service import TransferKind

if TYPE_CHECKING:
    from urc.service import AsyncUnifiedRadixCache

__all__ = ["Prefetcher"]

FULL = ComponentType.FULL

# An auxiliary component's pages read by a prefetch: indexes into the fetched span's pages
# (a state: the page its position ends) and their staged rows.
_AuxRead = dict[ComponentType, tuple[list[int], torch.Tensor]]


@dataclass(slots=True, eq=False)
class _Start:
    start: int  # token position where the key's host copies end
    anchor: TreeNode  # the node there, host-locked (the root: not locked)
    anchor_len: int
    tokens: list[Any]


def _unlock_anchor(cache: UnifiedRadixCache, pf: _Start) -> None:
    if pf.anchor.parent is not None:
        host_transfers.host_unlock_pieces(cache, pf.anchor, pf.anchor_len)


def _runs(idx: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive values of the sorted ``idx``: ``(first, length)`` each."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


class Prefetcher:
    """Prefetches from the store into host memory (see the module docstring)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.tier = ctx.tier
        self.layouts = ctx.layouts
        self.calls = ctx.calls
        self.config = ctx.config
        self.stats = ctx.stats
        self.observer = ctx.observer

    def _free_host_full(self, cache: UnifiedRadixCache, slots: torch.Tensor | None) -> None:
        """``undo`` of a host-slot reservation whose result never reached its caller."""
        if slots is not None:
            self.tier.host_free(FULL, slots)

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
        layouts = self.layouts
        ps = layouts.page_size
        full = layouts.full
        self.stats.prefetches += 1

        def begin(cache: UnifiedRadixCache) -> _Start:
            start, anchor = host_transfers.host_prefix(cache, key)
            if anchor.parent is not None:
                cache.inc_host_lock_ref(anchor)
            tokens = key.token_ids[: len(key) - len(key) % ps]
            return _Start(start, anchor, anchor.key_len, tokens)

        pf = await svc.call(begin, undo=_unlock_anchor)
        slots: torch.Tensor | None = None
        aux_slots: dict[ComponentType, torch.Tensor] = {}
        inserted = 0
        try:
            pages = len(pf.tokens) // ps - pf.start // ps
            if pages < self.config.prefetch_threshold_pages:
                return 0
            if self.calls.backoff.active:  # the store failed just now: do not wait for it
                self.stats.prefetch_misses += 1
                return 0
            all_keys = await anyio.to_thread.run_sync(self.calls.keys, pf.tokens, key.extra_key)
            keys = all_keys[pf.start // ps :]
            found = await self.calls.exists(keys)
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
            rows = torch.empty((need_pages, full.page_bytes), dtype=torch.uint8)
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
                            n = len(idx) * layouts.by_type[ct].page_size
                            host = host_transfers.host_alloc(cache, ct, n)
                            if host is not None:
                                aux_slots[ct] = host

                    if aux_read:
                        await svc.call(reserve_aux)
                    placed = slots[: got * ps]
                    moves = [(full, rows[:got], placed)]
                    moves += [
                        (layouts.by_type[ct], aux_read[ct][1], h) for ct, h in aux_slots.items()
                    ]

                    def scatter() -> None:
                        for layout, r, h in moves:
                            layout.scatter(r, h)

                    await anyio.to_thread.run_sync(scatter)
                    nbytes = got * full.page_bytes + sum(
                        int(r.shape[0]) * layout.page_bytes for layout, r, _ in moves[1:]
                    )
                    parts = self._parts(aux_read, aux_slots, first)
                    # The tree owns the slots from here (insert_host frees what it does not use).
                    slots = slots[got * ps :]
                    aux_slots = {}

                    def commit(cache: UnifiedRadixCache) -> int:
                        n = host_transfers.insert_host(
                            cache, key[: pf.start + got * ps], placed, pf.start, parts
                        )
                        cache.counters.hit_tokens[Tier.STORAGE] += n
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
                _unlock_anchor(cache, pf)

            with anyio.CancelScope(shield=True):
                await svc.call(finish)

    def _parts(
        self, aux_read: _AuxRead, aux_slots: dict[ComponentType, torch.Tensor], first: int
    ) -> dict[ComponentType, list[HostPart]]:
        """``insert_host``'s parts of the auxiliary pages placed in ``aux_slots`` (the span
        starts at page ``first``)."""
        ps = self.layouts.page_size
        parts: dict[ComponentType, list[HostPart]] = {}
        for ct, host in aux_slots.items():
            idx = aux_read[ct][0]
            out = parts[ct] = []
            if self.layouts.per_token[ct]:
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
            await self.calls.get_leading(keys, rows, got, self.config.batch_pages)

        timed_out = await self._bounded(len(keys), stop, body)
        return got[0], timed_out

    async def _exists(self, keys: list[str]) -> int:
        """Leading stored ``keys`` (0 on a failure, which the calls count)."""
        return await self.calls.exists(keys) or 0

    async def _present(self, ct: ComponentType, keys: list[str]) -> list[int]:
        """Indexes of the stored ``keys`` of ``ct`` (per-token data: the leading and the
        trailing run; states: every key probed)."""
        n = len(keys)
        if self.layouts.per_token[ct]:
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
        layouts = self.layouts
        if not layouts.aux:
            return out, False
        ps = layouts.page_size

        async def body() -> None:
            for ct in layouts.aux:
                keys = (
                    await anyio.to_thread.run_sync(
                        self.calls.keys, tokens[: (first + got) * ps], namespace, ct
                    )
                )[first:]
                idx = await self._present(ct, keys)
                if not idx:
                    continue
                wanted = [keys[i] for i in idx]
                rows = torch.empty((len(idx), layouts.by_type[ct].page_bytes), dtype=torch.uint8)
                read = [0]
                await self.calls.get_leading(wanted, rows, read, self.config.batch_pages)
                n = read[0]
                if n:
                    self.stats.pages_read += n
                    out[ct] = (idx[:n], rows[:n])

        timed_out = await self._bounded(got, stop, body)
        return out, timed_out
