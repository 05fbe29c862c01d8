"""``HiCacheController``: the background coroutines of the host tier, inside the async service.

It is a background worker of :class:`~urc.service.AsyncUnifiedRadixCache` and talks to the tree
only through the service's commands, like every other client (``start_backups`` /
``finish_backups``, ``start_load_back`` / ``finish_load_back``, ``evict_host``): the tree's
backup bookkeeping is the core's (:mod:`urc.host.transfers`), never edited here.  Byte
copies run in worker threads (``anyio.to_thread``) so the event loop never blocks on a copy.

- **backup**: woken when nodes become due (write-through policies); takes a batch, reserves
  host slots and pins the nodes (actor), copies (thread), commits ``host_value`` (actor).
- **host eviction**: woken after backups commit; keeps host usage at or below the high
  watermark by evicting down to the low watermark (host-only leaves without host locks,
  oldest first).
- **load-back**: on demand (:meth:`load_back`), for a match whose hit continues on host.

Every transfer is atomic with respect to cancellation: once slots are reserved, the copy and
the commit (or the abort) run shielded, so a cancelled caller or a closing service never
leaves pinned nodes or reserved slots behind.  A caller cancelled natively (``Task.cancel()``,
``asyncio.timeout``) after the actor reserved them never gets the ticket: the service aborts
it inside the actor (its ``give_back`` of a start command).

Copies run in worker threads by default (``copy_in_thread=True``): the event loop keeps
serving while bytes move, and when a copy finishes relative to other commands depends on the
machine.  ``copy_in_thread=False`` copies inside the event loop instead (the loop blocks for
the copy): the order of every command is then a function of the workload alone, which is
what a reproducible benchmark (``urc replay``) needs.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import anyio

from hicache.config import HiCacheConfig
from hicache.host_tier import HostMemoryTier
from urc.cache import UnifiedRadixCache
from urc.host import transfers as host_transfers
from urc.host_protocol import TierEvents
from urc.key import RadixKey
from urc.node import ComponentType
from urc.service import ServiceObserver, TransferKind

if TYPE_CHECKING:
    from urc.service import AsyncUnifiedRadixCache

__all__ = ["HiCacheController"]

T = TypeVar("T")


class HiCacheController(TierEvents):
    """Backup, host eviction and load-back for one cache (see the module docstring).

    Build it after :func:`~hicache.host_tier.attach_hicache` (or let :func:`hicache.attach` build
    both) and pass it to the service as a worker: ``AsyncUnifiedRadixCache(cache,
    workers=[controller])``.  It subscribes to the cache's tier events (``backup_due`` wakes
    its backup loop).  ``copy_in_thread``: see the module docstring.
    """

    def __init__(
        self,
        cache: UnifiedRadixCache,
        tier: HostMemoryTier,
        config: HiCacheConfig,
        observer: ServiceObserver | None = None,
        *,
        copy_in_thread: bool = True,
    ) -> None:
        self.cache = cache
        self.copy_in_thread = copy_in_thread
        self.tier = tier
        self.config = config
        self.observer = observer
        self._backup_due = anyio.Event()
        self._host_pressure = anyio.Event()
        self._limiter = anyio.CapacityLimiter(config.max_in_flight)
        self.in_flight = 0
        self.backed_up_tokens = 0
        self.loaded_back_tokens = 0
        cache.subscribe(self)

    def backup_due(self) -> None:
        """Tier event (inside the actor): wake the backup loop."""
        self._backup_due.set()

    # ------------------------------------------------------------------ worker entry point
    async def run(self, svc: AsyncUnifiedRadixCache) -> None:
        """The background coroutines; runs until cancelled (by the service's close)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._backup_loop, svc)
            tg.start_soon(self._host_eviction_loop, svc)

    async def _backup_loop(self, svc: AsyncUnifiedRadixCache) -> None:
        while True:
            await self._backup_due.wait()
            self._backup_due = anyio.Event()
            while await self._backup_batch(svc):
                pass

    async def _backup_batch(self, svc: AsyncUnifiedRadixCache) -> bool:
        """Back up one batch of due nodes; False when there was nothing to start."""
        tickets = await svc.start_backups(self.config.backup_batch)
        if not tickets:
            return False
        with anyio.CancelScope(shield=True):
            await self._transfer(
                svc, tickets, host_transfers.copy_backup, svc.finish_backups, TransferKind.BACKUP
            )
        self._host_pressure.set()
        if self.cache.pending_backups:
            self._backup_due.set()
        return True

    async def _transfer(
        self,
        svc: AsyncUnifiedRadixCache,
        tickets: list[T],
        copy: Callable[[HostMemoryTier, T], None],
        finish: Callable[[list[T], bool], Awaitable[int]],
        kind: TransferKind,
    ) -> int:
        """Copy every ticket in a thread, then commit them (or abort them if a copy failed)."""
        tier = self.tier
        ok = True
        t0 = time.perf_counter()
        self.in_flight += len(tickets)
        try:
            async with self._limiter:

                def copy_all() -> None:
                    for t in tickets:
                        copy(tier, t)

                if self.copy_in_thread:
                    await anyio.to_thread.run_sync(copy_all)
                else:
                    copy_all()
        except Exception:
            ok = False
            raise
        finally:
            self.in_flight -= len(tickets)
            seconds = time.perf_counter() - t0
            with anyio.CancelScope(shield=True):
                tokens = await finish(tickets, ok)
        if kind is TransferKind.BACKUP:
            self.backed_up_tokens += tokens
        else:
            self.loaded_back_tokens += tokens
        if self.observer is not None and tokens:
            nbytes = tokens * self.tier.pools[ComponentType.FULL].bytes_per_slot
            self.observer.on_transfer(kind, tokens, nbytes, seconds)
        return tokens

    async def _host_eviction_loop(self, svc: AsyncUnifiedRadixCache) -> None:
        config = self.config
        tier = self.tier
        pool = tier.pools[ComponentType.FULL]
        target = int(pool.size * (1.0 - config.low_watermark))  # free slots to reach
        while True:
            await self._host_pressure.wait()
            self._host_pressure = anyio.Event()
            if tier.usage() > config.high_watermark:
                await svc.evict_host(max(0, target - pool.allocator.available_size()))

    # ------------------------------------------------------------------ load-back
    async def load_back(self, svc: AsyncUnifiedRadixCache, key: RadixKey) -> int:
        """Load the host part of ``key``'s cached prefix back to device; returns the tokens
        loaded (0 when the host hit is below the threshold, or no device memory was found).

        Afterwards ``svc.match(key)`` returns the longer device hit.
        """
        ticket = await svc.start_load_back(key, self.config.load_back_threshold)
        if ticket is None:
            return 0
        with anyio.CancelScope(shield=True):
            loaded = await self._transfer(
                svc,
                [ticket],
                host_transfers.copy_load_back,
                svc.finish_load_back,
                TransferKind.LOAD_BACK,
            )
        return loaded
