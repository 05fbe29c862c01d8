"""What a cancelled caller passed in and what it got: never lost (issue 15, defects 1-4).

- Native asyncio cancellation (``Task.cancel()``, ``asyncio.timeout``) of an ownership move
  after it was sent: the command is applied and waited for, then the cancellation is raised
  and what the result hands over (slots, a ``call`` result with an ``undo``) is given back.
- An insert natively cancelled while waiting for room in a full stream is still applied.
- ``async with lease:`` releases on exit in a cancelled scope.
- ``alloc`` on a (FULL, SWA) cache short of SWA slots evicts SWA.
- ``alloc_mamba`` / ``free_mamba`` through the service.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest
import torch
from cache_harness import components_of
from service_harness import TIMEOUT

from urc import CacheConfig, ComponentType, InvalidInputError, OutOfMemoryError
from urc.cache import UnifiedRadixCache
from urc.service import AsyncUnifiedRadixCache
from urc.service import _commands as commands
from urc.service._commands import Alloc, Call, Command, Insert
from urc.specs import MambaSpec, SlidingWindowSpec

FULL = ComponentType.FULL
SWA = ComponentType.SWA
MAMBA = ComponentType.MAMBA
COMPONENT_SETS = [(FULL,), (FULL, SWA), (FULL, MAMBA)]
IDS = ["full", "full_swa", "full_mamba"]


def config_for(components: tuple[ComponentType, ...], kv_size: int = 512) -> CacheConfig:
    return CacheConfig(
        components=components_of(
            components, SlidingWindowSpec(4, kv_size // 2), MambaSpec(size=32, chunk_size=4)
        ),
        kv_size=kv_size,
        max_num_reqs=16,
        max_context_len=64,
    )


def held_nothing(components: tuple[ComponentType, ...]) -> dict[ComponentType, int]:
    return dict.fromkeys(components, 0)


def check_clean(cache: UnifiedRadixCache) -> None:
    cache.sanity_check()
    cache.check_pools(held_nothing(tuple(c.component_type for c in cache.components)))
    assert cache.protected_size() == 0


class CancelTaskOnApply:
    """Trace hook: when the actor applies a command of type ``kind``, ``Task.cancel()`` the
    victim task (before the reply is delivered: the reply is lost to the caller)."""

    def __init__(self, kind: type[Any]) -> None:
        self.kind = kind
        self.victim: asyncio.Task[Any] | None = None
        self.fired = 0

    def __call__(self, cmd: Command, result: Any, error: BaseException | None) -> None:
        if isinstance(cmd, self.kind) and self.victim is not None:
            self.victim.cancel()
            self.victim = None
            self.fired += 1


# ====================================================================== defect 1
@pytest.mark.parametrize("components", COMPONENT_SETS, ids=IDS)
@pytest.mark.asyncio
async def test_native_cancel_after_alloc_applied_gives_the_slots_back(
    components: tuple[ComponentType, ...],
) -> None:
    """``Task.cancel()`` between the actor applying an alloc and the caller resuming: the
    caller sees ``CancelledError`` and the slots go back to the pool (no leak)."""
    with anyio.fail_after(TIMEOUT):
        hook = CancelTaskOnApply(Alloc)
        async with AsyncUnifiedRadixCache(config_for(components), trace=hook) as svc:
            free_before = svc.cache.token_to_kv_pool_allocator.available_size()
            task = asyncio.ensure_future(svc.alloc(8))
            hook.victim = task
            with pytest.raises(asyncio.CancelledError):
                await task
            assert hook.fired == 1
            await svc.sanity_check(held_nothing(components))
            assert svc.cache.token_to_kv_pool_allocator.available_size() == free_before
        check_clean(svc.cache)


@pytest.mark.parametrize("components", COMPONENT_SETS, ids=IDS)
@pytest.mark.asyncio
async def test_asyncio_timeout_of_alloc_leaks_nothing(
    components: tuple[ComponentType, ...],
) -> None:
    """An ``asyncio.timeout`` that expires while an alloc is in flight: ``TimeoutError``
    for the caller, the slots given back."""
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(config_for(components)) as svc:
            for _ in range(4):
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0):
                        await svc.alloc(8)
                        await asyncio.Event().wait()  # only the expired deadline ends this
            await svc.sanity_check(held_nothing(components))
        check_clean(svc.cache)


@pytest.mark.asyncio
async def test_native_cancel_of_call_runs_its_undo() -> None:
    """A ``call`` whose result owns slots: a natively cancelled caller's result is handed
    to ``undo`` inside the actor."""
    with anyio.fail_after(TIMEOUT):
        hook = CancelTaskOnApply(Call)
        async with AsyncUnifiedRadixCache(config_for((FULL,)), trace=hook) as svc:
            undone: list[torch.Tensor] = []

            def take(cache: UnifiedRadixCache) -> torch.Tensor:
                out = cache.token_to_kv_pool_allocator.alloc(4)
                assert out is not None
                return out

            def give(cache: UnifiedRadixCache, slots: torch.Tensor) -> None:
                undone.append(slots)
                cache.token_to_kv_pool_allocator.free(slots)

            task = asyncio.ensure_future(svc.call(take, undo=give))
            hook.victim = task
            with pytest.raises(asyncio.CancelledError):
                await task
            await svc.sanity_check({FULL: 0})
            assert len(undone) == 1 and undone[0].shape[0] == 4
        check_clean(svc.cache)


@pytest.mark.parametrize("components", COMPONENT_SETS, ids=IDS)
@pytest.mark.asyncio
async def test_native_cancel_of_insert_waiting_for_room_still_applies_it(
    components: tuple[ComponentType, ...],
) -> None:
    """An insert natively cancelled while it waits for room in a full stream is not
    withdrawn: once the cancellation reaches the caller, the tree holds the key (the value
    is the tree's), and nothing leaks."""
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(config_for(components), max_queued=1) as svc:
            key = [7, 8, 9, 10, 11, 12, 13, 14]
            value = await svc.alloc(len(key))
            # A Mamba hit needs a state at the node.
            state = await svc.alloc_mamba() if MAMBA in components else None
            # The stats fill the one-slot buffer (or the actor's hand-off and the buffer), so
            # the insert, last in line, waits for room; all three run before the actor does.
            first = asyncio.ensure_future(svc.stats())
            second = asyncio.ensure_future(svc.stats())
            victim = asyncio.ensure_future(svc.insert(key, value, mamba_value=state))
            await anyio.lowlevel.checkpoint()
            assert svc._sending >= 1, "the insert (last in line) should be waiting for room"
            victim.cancel()
            with pytest.raises(asyncio.CancelledError):
                await victim
            await first
            await second
            assert (await svc.match(key)).prefix_len == len(key)
            await svc.sanity_check(held_nothing(components))
        check_clean(svc.cache)


@pytest.mark.asyncio
async def test_native_cancel_of_insert_leaves_the_unaligned_tail_to_its_caller() -> None:
    """Page size 4: an insert of 6 tokens leaves the 2-token tail to its caller, whichever
    way it was cancelled (issue 33, defect 3): a natively cancelled caller frees it itself,
    as the docstring says (the service used to free it too: a double free)."""
    with anyio.fail_after(TIMEOUT):
        hook = CancelTaskOnApply(Insert)
        config = CacheConfig(kv_size=256, page_size=4, max_num_reqs=4, max_context_len=64)
        async with AsyncUnifiedRadixCache(config, trace=hook) as svc:
            value = await svc.alloc(6)
            task = asyncio.ensure_future(svc.insert([1, 2, 3, 4, 5, 6], value))
            hook.victim = task
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await svc.match([1, 2, 3, 4, 5, 6])).prefix_len == 4
            await svc.sanity_check({FULL: 4})  # the tail's page is still the caller's
            await svc.free(value[4:])
            await svc.sanity_check({FULL: 0})
        check_clean(svc.cache)


# ====================================================================== defect 2
async def scenario_lease_exit_in_cancelled_scope() -> None:
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(config_for((FULL,))) as svc:
            await svc.insert([1, 2, 3], await svc.alloc(3))
            hit = await svc.match([1, 2, 3], lock=True)
            assert hit.lease is not None
            with anyio.CancelScope() as scope:
                async with hit.lease:
                    scope.cancel()
                    await anyio.lowlevel.checkpoint()  # the cancellation lands here
            assert scope.cancelled_caught
            assert hit.lease.released
            await svc.sanity_check({FULL: 0})
            assert svc.leases_held == 0 and svc.cache.protected_size() == 0
        assert svc.leases_released_at_close == 0
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_lease_context_releases_in_a_cancelled_scope(anyio_backend: str) -> None:
    """``async with hit.lease:`` exited by a cancellation still releases the lock."""
    await scenario_lease_exit_in_cancelled_scope()


# ====================================================================== defect 3
async def scenario_alloc_short_of_swa() -> None:
    with anyio.fail_after(TIMEOUT):
        config = CacheConfig(
            components=(FULL, SlidingWindowSpec(window=4, kv_size=64)),
            kv_size=256,
            max_num_reqs=8,
            max_context_len=64,
        )
        async with AsyncUnifiedRadixCache(config) as svc:
            for i in range(6):
                await svc.insert([i * 100 + j for j in range(10)], await svc.alloc(10))
            allocator = svc.cache.token_to_kv_pool_allocator
            assert allocator.available_size() >= 20 > allocator.swa_available_size()
            v = await svc.alloc(20)  # Full has room, SWA does not: SWA is evicted
            assert v.shape[0] == 20
            await svc.sanity_check({FULL: 20, SWA: 20})
            with pytest.raises(OutOfMemoryError):
                await svc.alloc(200)  # more than the SWA pool holds at all
            await svc.free(v)
            await svc.sanity_check({FULL: 0, SWA: 0})
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_alloc_evicts_swa_when_only_swa_is_short(anyio_backend: str) -> None:
    """(FULL, SWA) with the SWA pool full and Full not: ``alloc`` evicts SWA and succeeds,
    and a request no eviction can meet raises ``OutOfMemoryError``."""
    await scenario_alloc_short_of_swa()


# ====================================================================== defect 4
@pytest.mark.asyncio
async def test_alloc_mamba_and_free_mamba_through_the_service() -> None:
    """Mamba state slots are allocated and freed through commands; a short pool evicts tree
    states first; a slot the tree owns cannot be freed; no Mamba component: a typed error."""
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(config_for((FULL, MAMBA))) as svc:
            pool = svc.cache.pools.mamba
            for i in range(32):  # every state slot ends up in the tree
                key = [i * 10 + j for j in range(4)]
                res = await svc.insert(key, await svc.alloc(4), mamba_value=await svc.alloc_mamba())
                assert not res.mamba_exist
            assert pool.available_size() == 0
            slots = await svc.alloc_mamba(2)  # evicts two tree states
            assert slots.shape == (2,) and slots.dtype == torch.int64
            await svc.sanity_check({FULL: 0, MAMBA: 2})
            with pytest.raises(OutOfMemoryError):
                await svc.alloc_mamba(64, evict=False)
            tree_slot = svc.cache.iter_nodes()[-1].data[MAMBA]
            assert tree_slot is not None and tree_slot.value is not None
            with pytest.raises(InvalidInputError):
                await svc.free_mamba(tree_slot.value)
            await svc.free_mamba(slots)
            await svc.sanity_check({FULL: 0, MAMBA: 0})
        check_clean(svc.cache)
        async with AsyncUnifiedRadixCache(config_for((FULL,))) as svc:
            with pytest.raises(InvalidInputError):
                await svc.alloc_mamba()


@pytest.mark.asyncio
async def test_native_cancel_of_alloc_mamba_gives_the_slot_back() -> None:
    with anyio.fail_after(TIMEOUT):
        # Looked up here, not imported: on a core without it, only this test fails.
        hook = CancelTaskOnApply(commands.AllocMamba)
        async with AsyncUnifiedRadixCache(config_for((FULL, MAMBA)), trace=hook) as svc:
            task = asyncio.ensure_future(svc.alloc_mamba(3))
            hook.victim = task
            with pytest.raises(asyncio.CancelledError):
                await task
            await svc.sanity_check({FULL: 0, MAMBA: 0})
        check_clean(svc.cache)
