"""Chaos: 256 clients on one service, about 10% of their calls cancelled at random points.

Each client runs a seeded random mix of alloc / free / insert / match(lock=True) (released
through ``async with lease`` or ``release()``) / lock / evict / HiCache load-back over shared
prefixes (plus ``alloc_mamba`` states with Mamba, and whole requests -- ``match_req`` ..
``cache_finished_req`` -- with Full only), on a cache with a host tier and its controller
backing nodes up in the background (copies in the event loop, so a seed fixes the order of
every command; load-backs mostly of keys the client inserted, which evictions demote to
host).  A cancelled call is cancelled, after a random number of
scheduler checkpoints, by one of: an anyio ``CancelScope``, a native asyncio
``Task.cancel()``, an ``asyncio.timeout`` (asyncio only), or an anyio deadline
(``move_on_after``).

Every client follows the cancellation rules of :mod:`urc.service` to know what it owns
after each call (see ``Client.settle``) and gives it all back at the end.  Afterwards: no
lease held, every component's protected size 0 (device and host), free + cached ==
capacity for every pool (device and host), no pin, ``sanity_check()`` passes, nodes were
backed up and loaded back, and no task is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum

import anyio
import pytest
import torch
from anyio.lowlevel import checkpoint
from cache_harness import components_of, pins
from service_harness import serve_request
from test_service_ownership import COMPONENT_SETS, IDS

from hicache.config import HiCacheConfig
from hicache.controller import HiCacheController
from hicache.host_tier import attach_hicache
from urc import (
    CacheConfig,
    ComponentType,
    InvalidLockError,
    OutOfMemoryError,
    RadixKey,
    Req,
    build_cache,
)
from urc.cache import UnifiedRadixCache
from urc.service import AsyncUnifiedRadixCache, MatchOutcome
from urc.service._lease import Lease, NodeHandle
from urc.specs import MambaSpec, SlidingWindowSpec

FULL = ComponentType.FULL
SWA = ComponentType.SWA
MAMBA = ComponentType.MAMBA
CLIENTS = 256
OPS = 32  # per client: 256 x 32 = 8192 calls per run
CANCEL_RATE = 0.1
LIMIT_S = 60  # fail_after bound of one run (it takes a few seconds)


class Style(Enum):
    """How a cancelled call is cancelled."""

    SCOPE = "scope"  # anyio CancelScope.cancel()
    DEADLINE = "deadline"  # anyio move_on_after, deadline moved to now
    TASK_CANCEL = "task_cancel"  # native asyncio Task.cancel() of the call's task
    TIMEOUT = "timeout"  # asyncio.timeout, rescheduled to now


NATIVE = (Style.TASK_CANCEL, Style.TIMEOUT)


def config_for(components: tuple[ComponentType, ...]) -> CacheConfig:
    return CacheConfig(
        components=components_of(
            components, SlidingWindowSpec(4, 1024), MambaSpec(size=96, chunk_size=4)
        ),
        kv_size=2048,
        max_num_reqs=300,
        max_context_len=64,
    )


PREFIXES = [[100 + i] * 4 + [i, i + 1, i + 2, i + 3] for i in range(6)]


def random_key(rng: random.Random) -> list[int]:
    base = rng.choice(PREFIXES)[: rng.randint(0, 8)]
    return base + [rng.randrange(12) for _ in range(rng.randint(1, 8))]


@dataclass
class Client:
    """One coroutine's workload and what it owns: ``owned`` Full slots, ``states`` Mamba
    slots, ``leases``.  Its records follow each call synchronously."""

    svc: AsyncUnifiedRadixCache
    controller: HiCacheController
    rng: random.Random
    name: str
    components: tuple[ComponentType, ...]
    native: bool  # asyncio: native cancellation styles are available
    owned: list[torch.Tensor] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    handles: list[NodeHandle] = field(default_factory=list)
    inserted: list[list[int]] = field(default_factory=list)  # recent keys it inserted
    cancelled: dict[Style, int] = field(default_factory=lambda: dict.fromkeys(Style, 0))
    ops: int = 0

    # ------------------------------------------------------------------ driving
    async def run(self, num_ops: int) -> None:
        try:
            for i in range(num_ops):
                await self.one(i)
                self.ops += 1
        finally:
            with anyio.CancelScope(shield=True):
                await self.cleanup()

    async def one(self, i: int) -> None:
        rng = self.rng
        op = self.pick(i)
        if rng.random() >= CANCEL_RATE:
            await op(None)
            return
        styles = [Style.SCOPE, Style.DEADLINE] + (list(NATIVE) if self.native else [])
        style = rng.choice(styles)
        after = rng.randrange(4)  # checkpoints before the cancellation fires
        self.cancelled[style] += 1
        if style is Style.SCOPE:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(fire_after, after, scope.cancel)
                    await op(style)
        elif style is Style.DEADLINE:
            with anyio.move_on_after(3600) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(fire_after, after, lambda: setattr(scope, "deadline", 0))
                    await op(style)
        else:
            task = asyncio.ensure_future(self.native_call(op, style, after))
            canceller = None
            if style is Style.TASK_CANCEL:
                canceller = asyncio.ensure_future(fire_after(after, task.cancel))
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await task
            if canceller is not None:
                await canceller

    async def native_call(
        self, op: Callable[[Style | None], Awaitable[None]], style: Style, after: int
    ) -> None:
        if style is Style.TIMEOUT:
            async with asyncio.timeout(None) as cm:
                canceller = asyncio.ensure_future(fire_after(after, lambda: cm.reschedule(0)))
                try:
                    await op(style)
                finally:
                    canceller.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await canceller
        else:
            await op(style)

    def pick(self, i: int) -> Callable[[Style | None], Awaitable[None]]:
        r = self.rng.random()
        key = random_key(self.rng)
        if r < 0.2:
            return lambda s: self.match(key)
        if r < 0.4:
            return lambda s: self.match_locked(key)
        if r < 0.5:
            return lambda s: self.release_one()
        if r < 0.55:
            return lambda s: self.lock_one()
        if r < 0.8:
            return lambda s: self.insert(key, s)
        if r < 0.9 and self.components == (FULL,):
            return lambda s: self.request(key, f"{self.name}-{i}")
        if r < 0.93:
            return lambda s: self.alloc_free(s)
        if r < 0.97:
            return lambda s: self.evict()
        if self.inserted and self.rng.random() < 0.7:
            key = self.rng.choice(self.inserted)  # likely demoted to host since
        return lambda s: self.load_back(key)

    # ------------------------------------------------------------------ operations
    async def match(self, key: list[int]) -> None:
        m = await self.svc.match(key)
        self.handles.append(m.node)
        del self.handles[:-4]

    async def match_locked(self, key: list[int]) -> None:
        m = await self.svc.match(key, lock=True)
        assert m.lease is not None
        if self.rng.random() < 0.5:
            async with m.lease:  # released on exit, cancelled or not
                await checkpoint()
        else:
            self.leases.append(m.lease)

    async def release_one(self) -> None:
        if not self.leases:
            return
        lease = self.leases[self.rng.randrange(len(self.leases))]
        try:
            await lease.release()
        finally:
            if lease.released:  # marked before the first await, unless cancelled before
                self.leases.remove(lease)

    async def lock_one(self) -> None:
        if self.handles:
            with contextlib.suppress(InvalidLockError):  # evicted since the match
                self.leases.append(await self.svc.lock(self.handles[-1]))

    async def load_back(self, key: list[int]) -> None:
        with contextlib.suppress(OutOfMemoryError):
            await self.controller.load_back(self.svc, RadixKey(key))

    async def evict(self) -> None:
        await self.svc.evict(num_tokens=self.rng.randint(1, 64))

    async def alloc_free(self, style: Style | None) -> None:
        try:
            v = await self.svc.alloc(self.rng.randint(1, 8))
        except OutOfMemoryError:
            return
        self.owned.append(v)
        await checkpoint()
        await self.give(v, style)

    async def give(self, v: torch.Tensor, style: Style | None) -> None:
        """Free ``v`` (in ``owned``); settle who owns it if the free is cancelled."""
        try:
            await self.svc.free(v)
        except BaseException as exc:
            self.settle(v, exc, style, self.owned)
            raise
        self.drop(v, self.owned)

    async def match_and_alloc(self, key: list[int]) -> tuple[MatchOutcome, torch.Tensor | None]:
        """Lock the cached prefix of ``key`` (the lease is ours) and allocate slots for the
        rest (owned by us; None when the pool is out)."""
        m = await self.svc.match(key, lock=True)
        assert m.lease is not None
        self.leases.append(m.lease)
        try:
            v = await self.svc.alloc(len(key) - m.prefix_len)
        except OutOfMemoryError:
            return m, None
        self.owned.append(v)
        return m, v

    async def insert(self, key: list[int], style: Style | None) -> None:
        svc = self.svc
        m, v = await self.match_and_alloc(key)
        if v is not None:
            state = None
            if MAMBA in self.components:
                try:
                    state = await svc.alloc_mamba()
                except OutOfMemoryError:
                    state = None
                else:
                    self.states.append(state)
            value = torch.cat([m.device_indices, v])
            try:
                res = await svc.insert(key, value, prev_prefix_len=m.prefix_len, mamba_value=state)
            except BaseException as exc:
                self.settle(v, exc, style, self.owned)
                if state is not None:
                    self.settle(state, exc, style, self.states)
                raise
            self.drop(v, self.owned)  # the tree took the slots (page size 1: no tail)
            self.inserted = [*self.inserted[-7:], key]
            if state is not None:
                if res.mamba_exist:
                    await self.give_state(state, style)
                else:
                    self.drop(state, self.states)
        await self.release_one_of(m.lease)

    async def release_one_of(self, lease: Lease) -> None:
        try:
            await lease.release()
        finally:
            if lease.released:
                self.leases.remove(lease)

    async def give_state(self, state: torch.Tensor, style: Style | None) -> None:
        try:
            await self.svc.free_mamba(state)
        except BaseException as exc:
            self.settle(state, exc, style, self.states)
            raise
        self.drop(state, self.states)

    async def request(self, key: list[int], rid: str) -> None:
        await serve_request(self.svc, Req(rid, key), unfinished=self.rng.random() < 0.3)

    # ------------------------------------------------------------------ ownership
    def settle(
        self, t: torch.Tensor, exc: BaseException, style: Style | None, where: list[torch.Tensor]
    ) -> None:
        """A call that took ``t`` (a free, an insert) raised ``exc``.  The rules: a typed
        error changed nothing (``t`` is still ours); a native cancellation is raised only once
        the command was applied (``t`` was taken); a cancelled anyio scope raises before
        sending (``t`` is still ours) -- a scope cancelled after sending gets the outcome
        instead of an exception."""
        if style in NATIVE and isinstance(exc, asyncio.CancelledError):
            self.drop(t, where)

    @staticmethod
    def drop(t: torch.Tensor, where: list[torch.Tensor]) -> None:
        where[:] = [x for x in where if x is not t]

    async def cleanup(self) -> None:
        for lease in self.leases:
            if not lease.released:
                await lease.release()
        self.leases.clear()
        for v in self.owned:
            await self.svc.free(v)
        self.owned.clear()
        for s in self.states:
            await self.svc.free_mamba(s)
        self.states.clear()


async def fire_after(checkpoints: int, fire: Callable[[], object]) -> None:
    for _ in range(checkpoints):
        await checkpoint()
    fire()


async def scenario(components: tuple[ComponentType, ...], seed: int) -> dict[Style, int]:
    with anyio.fail_after(LIMIT_S):
        native = anyio.get_cancelled_exc_class() is asyncio.CancelledError
        tasks_before = {t.id for t in anyio.get_running_tasks()}
        cache = build_cache(config_for(components))
        hconfig = HiCacheConfig(host_ratio=1.0)
        # Copies in the loop: the order of every command is a function of the seed alone.
        tier = attach_hicache(cache, hconfig)
        controller = HiCacheController(cache, tier, hconfig, copy_in_thread=False)
        async with AsyncUnifiedRadixCache(cache, max_queued=64, workers=[controller]) as svc:
            clients = [
                Client(
                    svc,
                    controller,
                    random.Random(seed * 1_000_003 + k),
                    f"c{k}",
                    components,
                    native,
                )
                for k in range(CLIENTS)
            ]
            async with anyio.create_task_group() as tg:
                for c in clients:
                    tg.start_soon(c.run, OPS)
            held = dict.fromkeys(components, 0)

            def check_when_quiet(cache: UnifiedRadixCache) -> bool:
                # The controller keeps backing up nodes that are still due: check between
                # two of its transfers, inside one actor command.
                if cache.backups_in_flight:
                    return False
                cache.sanity_check()
                cache.check_pools(held, held)  # device and host pools
                return True

            while not await svc.call(check_when_quiet):
                await anyio.wait_all_tasks_blocked()  # the transfer in flight finishes
            assert svc.leases_held == 0
            assert svc.background_failures == ()
        assert svc.leases_released_at_close == 0
        cache.sanity_check()
        cache.check_pools(held, held)  # device and host pools
        for c in cache.components:
            assert c.protected_size == 0 and c.host_protected_size == 0
            assert c.pool_available() + c.evictable_size == c.pool_capacity()
            assert c.host_available() + c.host_evictable_size == c.host_capacity()
        assert pins(cache) == 0
        # The host tier was exercised: nodes were backed up and loaded back.
        assert controller.backed_up_tokens > 0 and controller.loaded_back_tokens > 0
        assert sum(c.ops for c in clients) == CLIENTS * OPS
        assert {t.id for t in anyio.get_running_tasks()} == tasks_before
        totals = dict.fromkeys(Style, 0)
        for c in clients:
            for s, n in c.cancelled.items():
                totals[s] += n
        return totals


@pytest.mark.slow
@pytest.mark.parametrize("components", COMPONENT_SETS, ids=IDS)
@pytest.mark.asyncio
async def test_chaos_asyncio_leaks_nothing(components: tuple[ComponentType, ...]) -> None:
    """asyncio: every cancellation style, about 10% of 8192 calls."""
    totals = await scenario(components, seed=11)
    assert all(n > 50 for n in totals.values()), totals


@pytest.mark.slow
@pytest.mark.parametrize("components", COMPONENT_SETS, ids=IDS)
def test_chaos_trio_leaks_nothing(components: tuple[ComponentType, ...]) -> None:
    """trio: cancel scopes and deadlines (trio has no other cancellation)."""
    totals: dict[Style, int] = anyio.run(scenario, components, 12, backend="trio")
    assert totals[Style.SCOPE] > 100 and totals[Style.DEADLINE] > 100, totals
