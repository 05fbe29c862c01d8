"""Soak (issue 33): many clients, random operations, about 10% cancelled both ways, page
size 4 (inserts leave unaligned tails to their callers), a host tier and a local-file L3
store, on asyncio and trio.

The clients are the chaos test's (``test_service_chaos.Client``: match, locked match and
``async with lease``, lock, release, insert over a locked match, alloc/free, evict,
load-back, whole requests), with the tail of every insert kept and freed by its caller
(whichever way the insert was cancelled), plus L3 fetches and bad hand-overs -- a free that
names a slot twice, a free of slots the tree owns -- that must be refused and change
nothing.  At the end the storage worker is closed (its flush is bounded), and then: no
lease held or released at close, no pin, every device and host pool conserved, and
``sanity_check()`` passes.  The figures (operations, cancellations, seconds, L3 traffic) are
printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest
import torch
from cache_harness import pins
from test_service_chaos import Client, Style, random_key

import hicache
from hicache.config import HiCacheConfig, StorageConfig
from hicache.storage.file import FileStorage
from hicache.storage_worker import StorageWorker
from urc import CacheConfig, ComponentType, DoubleFreeError, OutOfMemoryError, RadixKey
from urc.cache import UnifiedRadixCache
from urc.errors import TreeOwnedSlotError
from urc.service import AsyncUnifiedRadixCache

FULL = ComponentType.FULL
PS = 4
CLIENTS = 128
OPS = 256  # per client: 128 x 256 = 32768 operations per event loop
LIMIT_S = 240


class SoakClient(Client):
    """A chaos client at page size 4, with L3 fetches and bad hand-overs."""

    storage: StorageWorker | None = None
    refused: int = 0

    def pick(self, i: int) -> Callable[[Style | None], Awaitable[None]]:
        r = self.rng.random()
        if r < 0.04:
            return lambda s: self.bad_free()
        if r < 0.08 and self.inserted:
            key = self.rng.choice(self.inserted)
            return lambda s: self.fetch(key)
        return super().pick(i)

    async def insert(self, key: list[int], style: Style | None) -> None:
        """Insert over a locked match; the unaligned tail stays ours (and is freed)."""
        svc = self.svc
        m, v = await self.match_and_alloc(key)
        if v is not None:
            value = torch.cat([m.device_indices, v])
            tail = v[len(key) - len(key) % PS - m.prefix_len :]
            try:
                await svc.insert(key, value, prev_prefix_len=m.prefix_len)
            except BaseException as exc:
                if style in (Style.TASK_CANCEL, Style.TIMEOUT) and isinstance(
                    exc, asyncio.CancelledError
                ):  # applied: the tree took all but the tail, which is still ours
                    self.swap(v, tail)
                raise
            self.swap(v, tail)
            self.inserted = [*self.inserted[-7:], key]
        await self.release_one_of(m.lease)

    def swap(self, v: torch.Tensor, tail: torch.Tensor) -> None:
        self.drop(v, self.owned)
        if tail.shape[0]:
            self.owned.append(tail)

    async def bad_free(self) -> None:
        """Hand over slots that are not ours to free: refused, nothing changed."""
        svc = self.svc
        key = random_key(self.rng)
        m = await svc.match(key, lock=True)
        assert m.lease is not None
        async with m.lease:
            if m.prefix_len:
                with pytest.raises(TreeOwnedSlotError):
                    await svc.free(m.device_indices[:PS])
                self.refused += 1
            whole = [v for v in self.owned if v.shape[0] >= PS]
            if whole:  # indices are page runs: a page named twice is a whole page, twice
                mine = whole[-1][:PS]
                with pytest.raises(DoubleFreeError):
                    await svc.free(torch.cat([mine, mine]))
                self.refused += 1

    async def fetch(self, key: list[int]) -> None:
        """Fetch ``key`` through the storage worker (an L3 lookup, then a load-back)."""
        assert self.storage is not None
        with contextlib.suppress(OutOfMemoryError):
            await self.storage.fetch(self.svc, RadixKey(key))


async def soak(tmp: Path, seed: int) -> dict[str, float]:
    t0 = time.perf_counter()
    with anyio.fail_after(LIMIT_S):
        native = anyio.get_cancelled_exc_class() is asyncio.CancelledError
        cache = build(seed)
        store = FileStorage(tmp / "l3")
        hc = hicache.attach(
            cache,
            HiCacheConfig(host_ratio=1.0),
            store,
            storage_config=StorageConfig(flush_timeout_s=30.0),
            copy_in_thread=False,
        )
        assert hc.storage is not None
        async with store, AsyncUnifiedRadixCache(cache, max_queued=64, workers=hc.workers) as svc:
            clients = []
            for k in range(CLIENTS):
                c = SoakClient(
                    svc, hc.controller, random.Random(seed * 7919 + k), f"c{k}", (FULL,), native
                )
                c.storage = hc.storage
                clients.append(c)
            async with anyio.create_task_group() as tg:
                for c in clients:
                    tg.start_soon(c.run, OPS)
            dropped = await hc.storage.close()

            def check_when_quiet(cache: UnifiedRadixCache) -> bool:
                if cache.backups_in_flight:
                    return False
                cache.sanity_check()
                cache.check_pools({FULL: 0}, {FULL: 0})
                return True

            while not await svc.call(check_when_quiet):
                await anyio.wait_all_tasks_blocked()
            assert svc.leases_held == 0
            assert svc.background_failures == ()
        assert svc.leases_released_at_close == 0
        cache.sanity_check()
        cache.check_pools({FULL: 0}, {FULL: 0})
        full = cache.full
        assert full.protected_size == 0 and full.host_protected_size == 0
        assert pins(cache) == 0
        stats = hc.storage.stats
        assert stats.pages_written > 0, stats
        cancelled = {s.value: sum(c.cancelled[s] for c in clients) for s in Style}
        ops = sum(c.ops for c in clients)
        assert ops == CLIENTS * OPS
        assert sum(c.refused for c in clients) > 0
        figures: dict[str, float] = {
            "ops": ops,
            "cancelled": sum(cancelled.values()),
            **{f"cancelled_{k}": v for k, v in cancelled.items()},
            "refused_bad_frees": sum(c.refused for c in clients),
            "l3_pages_written": stats.pages_written,
            "l3_pages_read": stats.pages_read,
            "l3_dropped_at_close": dropped,
            "loaded_back_tokens": hc.controller.loaded_back_tokens,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"\nsoak {anyio.get_cancelled_exc_class().__module__}: {figures}")
        return figures


def build(seed: int) -> UnifiedRadixCache:
    from urc import build_cache

    return build_cache(
        CacheConfig(page_size=PS, kv_size=2048, max_num_reqs=300, max_context_len=64)
    )


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 30)
@pytest.mark.asyncio
async def test_soak_asyncio_ends_with_nothing_leaked(tmp_path: Path) -> None:
    """asyncio: scopes, deadlines, ``Task.cancel()`` and ``asyncio.timeout``."""
    figures = await soak(tmp_path, seed=33)
    assert 0.05 < figures["cancelled"] / figures["ops"] < 0.15, figures
    assert figures["cancelled_task_cancel"] > 0 and figures["cancelled_timeout"] > 0


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 30)
def test_soak_trio_ends_with_nothing_leaked(tmp_path: Path) -> None:
    """trio: cancel scopes and deadlines (trio has no other cancellation)."""
    figures: dict[str, float] = anyio.run(soak, tmp_path, 34, backend="trio")
    assert 0.05 < figures["cancelled"] / figures["ops"] < 0.15, figures
