"""One bad caller among 256 never corrupts what the others own (issue 33, defects 1-3).

- Clients that free a slot twice in one call, free slots the tree owns, or insert a value
  naming a slot twice get a typed error; the service keeps serving and every pool is
  conserved at the end (defects 1 and 2), under asyncio and trio.
- An insert cancelled either way -- a cancelled scope (asyncio and trio) or ``Task.cancel()``
  -- leaves its unaligned tail to its caller, who frees it: the service never frees it too
  (defect 3).  ``leases_held`` is exact right after ``async with lease:`` exits.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import anyio
import pytest
import torch
from cache_harness import components_of
from test_service import TIMEOUT

from urc import CacheConfig, ComponentType, DoubleFreeError, InvalidIndicesError
from urc.cache import UnifiedRadixCache
from urc.errors import TreeOwnedSlotError
from urc.service import AsyncUnifiedRadixCache, ServiceState
from urc.service._commands import Command, Insert
from urc.specs import SlidingWindowSpec

FULL, SWA = ComponentType.FULL, ComponentType.SWA
CLIENTS = 256
PS = 4


def config(components: tuple[ComponentType, ...]) -> CacheConfig:
    return CacheConfig(
        components=components_of(components, SlidingWindowSpec(2 * PS, CLIENTS * 4 * PS)),
        page_size=PS,
        kv_size=CLIENTS * 4 * PS,
        max_num_reqs=8,
        max_context_len=64,
    )


def check_clean(cache: UnifiedRadixCache) -> None:
    cache.sanity_check()
    cache.check_pools({c.component_type: 0 for c in cache.components})
    assert cache.protected_size() == 0


async def bad_client(svc: AsyncUnifiedRadixCache, i: int, refused: list[int]) -> None:
    """Insert a prompt, then try every bad hand-over once (each must be refused), then free
    what is still its own."""
    key = [i * 100 + j for j in range(2 * PS)]
    slots = await svc.alloc(2 * PS)
    await svc.insert(key, slots)
    mine = await svc.alloc(2 * PS)
    attempts: list[tuple[type[Exception], Any]] = [
        (DoubleFreeError, svc.free(torch.cat([mine, mine[:PS]]))),
        (TreeOwnedSlotError, svc.free(slots[PS : 2 * PS])),
        (TreeOwnedSlotError, svc.free(torch.cat([mine[:PS], slots[:PS]]))),
        (InvalidIndicesError, svc.insert([7, i, *range(2 * PS - 2)], torch.cat([mine[:PS]] * 2))),
        (TreeOwnedSlotError, svc.insert([9, i, *range(2 * PS - 2)], slots)),
    ]
    for error, call in attempts:
        with pytest.raises(error):
            await call
        refused[0] += 1
    await svc.free(mine)


@pytest.mark.parametrize("components", [(FULL,), (FULL, SWA)], ids=["full", "full_swa"])
@pytest.mark.anyio
async def test_256_clients_handing_over_bad_slots_are_refused_and_nothing_leaks(
    anyio_backend: str, components: tuple[ComponentType, ...]
) -> None:
    refused = [0]
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(config(components)) as svc:
            async with anyio.create_task_group() as tg:
                for i in range(CLIENTS):
                    tg.start_soon(bad_client, svc, i, refused)
            assert svc.state is ServiceState.RUNNING
            await svc.sanity_check(dict.fromkeys(components, 0))
            for i in (0, CLIENTS - 1):  # every client's prompt is still cached, intact
                assert (await svc.match([i * 100 + j for j in range(2 * PS)])).prefix_len == 2 * PS
    assert refused[0] == 5 * CLIENTS
    check_clean(svc.cache)


class AppliedInserts:
    """Trace hook: the values of the inserts the actor applied."""

    def __init__(self) -> None:
        self.values: set[int] = set()

    def __call__(self, cmd: Command, result: Any, error: BaseException | None) -> None:
        if isinstance(cmd, Insert) and error is None:
            self.values.add(id(cmd.value))


async def insert_then_clean_up(
    svc: AsyncUnifiedRadixCache,
    applied: AppliedInserts,
    i: int,
    rng: random.Random,
    native: bool,
    cancelled: list[int],
) -> None:
    """Insert 6 tokens at page 4 (one page cached, a 2-token tail) and cancel the call
    after a random number of checkpoints; then free what is still the caller's: the tail
    when the insert was applied, else everything."""
    value = await svc.alloc(PS + 2)
    key = [i * 100 + j for j in range(PS + 2)]
    steps = rng.randrange(4)
    if native:
        task = asyncio.ensure_future(svc.insert(key, value))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            cancelled[0] += 1
    else:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(svc.insert, key, value)
                for _ in range(steps):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
        cancelled[0] += scope.cancelled_caught
    if id(value) in applied.values:
        await svc.free(value[PS:])  # the tail is the caller's whichever way it was cancelled
    else:
        await svc.free(value)


async def run_cancelled_inserts(native: bool) -> int:
    applied = AppliedInserts()
    cancelled = [0]
    rng = random.Random(33)
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(config((FULL,)), trace=applied) as svc:
            async with anyio.create_task_group() as tg:
                for i in range(CLIENTS):
                    tg.start_soon(insert_then_clean_up, svc, applied, i, rng, native, cancelled)
            assert svc.state is ServiceState.RUNNING
            await svc.sanity_check({FULL: 0})
    check_clean(svc.cache)
    assert applied.values, "no insert was applied: the test proves nothing"
    return cancelled[0]


@pytest.mark.anyio
async def test_scope_cancelled_inserts_leave_their_tails_to_their_callers(
    anyio_backend: str,
) -> None:
    assert await run_cancelled_inserts(native=False) > 0


@pytest.mark.asyncio
async def test_natively_cancelled_inserts_leave_their_tails_to_their_callers() -> None:
    """``Task.cancel()`` at random points of 256 inserts: whichever were applied, their
    callers free the tails (the service used to free them as well: a double free, or
    another client's page once reallocated)."""
    assert await run_cancelled_inserts(native=True) > 0


@pytest.mark.anyio
async def test_leases_held_drops_as_soon_as_the_lease_context_exits(anyio_backend: str) -> None:
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(config((FULL,))) as svc:
            await svc.insert(list(range(PS)), await svc.alloc(PS))
            hit = await svc.match(list(range(PS)), lock=True)
            assert hit.lease is not None and svc.leases_held == 1
            async with hit.lease:
                pass
            assert svc.leases_held == 0  # its release may still be queued: not held
            await svc.sanity_check({FULL: 0})
            assert svc.leases_held == 0
    check_clean(svc.cache)
