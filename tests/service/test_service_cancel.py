"""Cancellation safety of the async service: a cancelled caller leaves no lock and no slot.

Covered windows: cancelled before sending, while queued (the actor skips the command),
between the actor taking a lock and the caller receiving the reply (the lease is released,
also when the queue is full at that moment), during a command that moves ownership (it
completes; the cancellation lands afterwards), and at random points under 256 clients, with
the recorded history replayed sequentially to identical results.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import torch
from service_harness import (
    FULL,
    TIMEOUT,
    History,
    check_clean,
    replay,
    run_clients,
    small_config,
)

from urc import RadixKey
from urc.service import AsyncUnifiedRadixCache
from urc.service._commands import Command, Insert, Lock, Match, Release, SanityCheck, Stats

KEY = [1, 2, 3, 4]


async def prepared(svc: AsyncUnifiedRadixCache) -> None:
    await svc.insert(KEY, await svc.alloc(len(KEY)))


@dataclass
class CancelOnApply:
    """Trace hook: when the actor applies a command of type ``kind``, cancel ``scope``."""

    kind: type[Any]
    history: History = field(default_factory=History)
    scope: anyio.CancelScope | None = None
    fired: int = 0

    def __call__(self, cmd: Command, result: Any, error: BaseException | None) -> None:
        self.history(cmd, result, error)
        if isinstance(cmd, self.kind) and self.scope is not None:
            self.scope.cancel()
            self.scope = None
            self.fired += 1


async def scenario_cancelled_while_queued(strict_order: bool) -> None:
    with anyio.fail_after(TIMEOUT):
        hook = CancelOnApply(Stats)
        # max_batch=1: the actor yields between commands, so a caller cancelled while its
        # command waits in the queue runs its handler before the actor reaches the command.
        async with AsyncUnifiedRadixCache(small_config(), max_batch=1, trace=hook) as svc:
            await prepared(svc)
            caught: list[bool] = []

            async def victim() -> None:
                got = None
                with anyio.CancelScope() as scope:
                    hook.scope = scope  # cancelled when the actor applies the Stats
                    got = await svc.match(KEY, lock=True)
                caught.append(scope.cancelled_caught)
                if got is not None and got.lease is not None:  # it ran first (trio order)
                    await got.lease.release()

            async with anyio.create_task_group() as tg:
                tg.start_soon(svc.stats)
                tg.start_soon(victim)
            await svc.sanity_check({FULL: 0})
            matches = [c for c, _, _ in hook.history.entries if isinstance(c, Match)]
            if strict_order:  # asyncio runs ready tasks FIFO: the Stats went first
                assert caught == [True] and not matches  # skipped, never applied
            assert svc.leases_held == 0

            with anyio.CancelScope() as scope:
                scope.cancel()
                await svc.match(KEY, lock=True)  # already cancelled: not even sent
            assert scope.cancelled_caught
            v = await svc.alloc(2)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await svc.insert([7, 8], v)  # an ownership move is not sent either
            assert scope.cancelled_caught
            await svc.free(v)  # still ours
            await svc.sanity_check({FULL: 0})
            assert len([c for c, _, _ in hook.history.entries if isinstance(c, Match)]) == len(
                matches
            )
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_cancelled_while_queued_is_skipped(anyio_backend: str) -> None:
    """A caller cancelled before the actor took its command: the command never runs.

    Under trio (no FIFO guarantee) the lease is skipped or released: never leaked.
    """
    await scenario_cancelled_while_queued(strict_order=anyio_backend == "asyncio")


async def scenario_cancel_between_lock_and_reply() -> None:
    with anyio.fail_after(TIMEOUT):
        hook = CancelOnApply(Match)
        async with AsyncUnifiedRadixCache(small_config(), trace=hook) as svc:
            await prepared(svc)
            reached = False
            with anyio.CancelScope() as scope:
                hook.scope = scope
                await svc.match(KEY, lock=True)  # the actor locks, then the scope is cancelled
                reached = True
            assert scope.cancelled_caught and not reached and hook.fired == 1
            await svc.sanity_check({FULL: 0})
            assert svc.leases_held == 0
            assert svc.cache.protected_size() == 0
            applied = [type(c) for c, _, _ in hook.history.entries]
            assert applied[-3:-1] == [Match, Release]  # the actor released the lost lease
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_cancel_between_lock_and_reply_releases_lease(anyio_backend: str) -> None:
    """The actor took a lock for a caller cancelled before it got the reply: released."""
    await scenario_cancel_between_lock_and_reply()


@pytest.mark.asyncio
async def test_lost_lease_released_when_queue_is_full() -> None:
    """Same window, but the queue is full when the cancelled caller gives the lease back:
    the release is parked and the actor applies it at the start of its next batch, before
    the command that filled the queue (queued, it would come after it)."""
    with anyio.fail_after(TIMEOUT):
        orphans_seen: list[int] = []
        history = History()
        state: dict[str, Any] = {}

        def hook(cmd: Command, result: Any, error: BaseException | None) -> None:
            history(cmd, result, error)
            if isinstance(cmd, Match) and "scope" in state:
                # Order matters (asyncio runs ready tasks FIFO): the filler fills the queue
                # before the cancelled caller tries to queue its release.
                state["tg"].start_soon(filler)
                state.pop("scope").cancel()
            if isinstance(cmd, Stats):
                orphans_seen.append(len(svc._orphans))

        async def filler() -> None:
            await svc.stats()

        async with AsyncUnifiedRadixCache(small_config(), max_queued=1, trace=hook) as svc:
            await prepared(svc)
            async with anyio.create_task_group() as tg:
                state["tg"] = tg
                with anyio.CancelScope() as scope:
                    state["scope"] = scope
                    await svc.match(KEY, lock=True)
                assert scope.cancelled_caught
            await svc.sanity_check({FULL: 0})
            assert orphans_seen == [0]  # parked, and applied before the batch's first command
            assert [type(c) for c, _, _ in history.entries][-3:] == [Release, Stats, SanityCheck]
            assert svc.leases_held == 0
        check_clean(svc.cache)


async def scenario_cancel_during_ownership_move() -> None:
    with anyio.fail_after(TIMEOUT):
        hook = CancelOnApply(Insert)
        async with AsyncUnifiedRadixCache(small_config(), trace=hook) as svc:
            v = await svc.alloc(3)
            got: list[Any] = []
            with anyio.CancelScope() as scope:
                hook.scope = scope
                got.append(await svc.insert([5, 6, 7], v))
                await anyio.lowlevel.checkpoint()
                got.append(None)  # not reached
            assert scope.cancelled_caught and len(got) == 1 and got[0].total_len == 3
            assert (await svc.match([5, 6, 7])).prefix_len == 3
            await svc.sanity_check({FULL: 0})
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_cancel_during_ownership_move_completes_it(anyio_backend: str) -> None:
    """A caller cancelled while its insert is applied still gets the outcome (the tree took
    the slots); the cancellation lands at its next checkpoint."""
    await scenario_cancel_during_ownership_move()


@pytest.mark.asyncio
async def test_cancelled_release_keeps_lease_usable() -> None:
    """A release cancelled before it is sent leaves the lease held (and releasable)."""
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(small_config()) as svc:
            await prepared(svc)
            lease = (await svc.match(KEY, lock=True)).lease
            assert lease is not None
            with anyio.CancelScope() as scope:
                scope.cancel()
                await lease.release()
            assert scope.cancelled_caught and not lease.released and svc.leases_held == 1
            await lease.release()
            assert svc.leases_held == 0
        check_clean(svc.cache)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_random_cancellations_256_clients_leak_nothing() -> None:
    """256 clients x 60 random ops; scopes are cancelled before sending, while queued, and
    while the actor applies the caller's own command (including right after it took a
    lock).  Afterwards no lease, lock or slot is left and the history replays exactly."""
    with anyio.fail_after(TIMEOUT * 2):
        config = small_config(kv_size=2048, max_num_reqs=300)
        rng = random.Random(5)
        history = History()
        by_key: dict[int, anyio.CancelScope] = {}
        live: list[anyio.CancelScope] = []
        fired = {"own": 0, "own_lock": 0, "random": 0}

        def chaos(scope: anyio.CancelScope, key: RadixKey) -> None:
            r = rng.random()
            if r < 0.05:
                scope.cancel()  # before the call is even made
            elif r < 0.35:
                by_key[id(key)] = scope
            elif r < 0.45:
                live.append(scope)

        def hook(cmd: Command, result: Any, error: BaseException | None) -> None:
            history(cmd, result, error)
            key = getattr(cmd, "key", None)
            scope = by_key.pop(id(key), None) if key is not None else None
            if scope is not None and rng.random() < 0.5:
                scope.cancel()  # the caller is cancelled before it sees this reply
                fired["own"] += 1
                if isinstance(cmd, (Match, Lock)) and getattr(cmd, "lock", True):
                    fired["own_lock"] += 1
            if live and rng.random() < 0.05:
                live.pop(rng.randrange(len(live))).cancel()  # a random caller, anywhere
                fired["random"] += 1

        async with AsyncUnifiedRadixCache(config, max_queued=64, trace=hook) as svc:
            clients = await run_clients(svc, 256, 60, seed=2, chaos=chaos)
            await svc.sanity_check({FULL: 0})
            assert svc.leases_held == 0
            final_stats = await svc.stats()
        assert sum(c.cancelled for c in clients) > 100
        assert fired["own_lock"] > 10 and fired["random"] > 10
        assert svc.leases_released_at_close == 0
        check_clean(svc.cache)
        replayed = replay(config, history)
        assert replayed.stats() == final_stats
        assert torch.equal(
            replayed.all_values_flatten().sort().values,
            svc.cache.all_values_flatten().sort().values,
        )


@pytest.mark.asyncio
async def test_release_cancelled_while_queued_is_still_applied() -> None:
    """A release whose caller is cancelled while it waits in the queue is still applied."""
    with anyio.fail_after(TIMEOUT):
        hook = CancelOnApply(Stats)
        async with AsyncUnifiedRadixCache(small_config(), max_batch=1, trace=hook) as svc:
            await prepared(svc)
            lease = (await svc.match(KEY, lock=True)).lease
            assert lease is not None
            caught: list[bool] = []

            async def victim() -> None:
                assert lease is not None
                with anyio.CancelScope() as scope:
                    hook.scope = scope
                    await lease.release()
                caught.append(scope.cancelled_caught)

            async with anyio.create_task_group() as tg:
                tg.start_soon(svc.stats)
                tg.start_soon(victim)
            await svc.sanity_check({FULL: 0})
            assert caught == [True] and lease.released and svc.leases_held == 0
        check_clean(svc.cache)


async def scenario_host_scope_cancelled() -> None:
    with anyio.fail_after(TIMEOUT):
        with anyio.CancelScope() as outer:
            async with AsyncUnifiedRadixCache(small_config()) as svc:
                await prepared(svc)
                lease = (await svc.match(KEY, lock=True)).lease
                outer.cancel()  # cancels the body and the actor task alike
                await anyio.Event().wait()
        assert outer.cancelled_caught
        assert svc.state.value == "closed"
        assert lease is not None and lease.released
        assert svc.leases_released_at_close == 1
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_host_scope_cancelled_closes_cleanly(anyio_backend: str) -> None:
    """Cancelling the scope around ``async with`` stops the actor and releases leases."""
    await scenario_host_scope_cancelled()


# ====================================================================== transport paths
# The actor's hot path (no trace hook, no observer) and the asyncio reply futures get their
# own checks: the scenarios above mostly run with a trace hook (the hooked path).


async def scenario_cancelled_while_queued_fast_path(strict_order: bool) -> None:
    """No hook: a ``call`` queued first cancels the victim's scope from inside the actor."""
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(small_config(), max_batch=1) as svc:
            await prepared(svc)
            state: dict[str, Any] = {}
            caught: list[bool] = []

            def cancel_victim(cache: Any) -> None:
                # Trio may start the victim after this call ran: then there is nothing to
                # cancel yet and the victim's match simply runs (asyncio keeps start order).
                scope = state.pop("scope", None)
                if scope is not None:
                    scope.cancel()
                elif strict_order:
                    raise AssertionError("the victim had not started before the call ran")

            async def victim() -> None:
                got = None
                with anyio.CancelScope() as scope:
                    state["scope"] = scope
                    got = await svc.match(KEY, lock=True)
                caught.append(scope.cancelled_caught)
                if got is not None and got.lease is not None:  # it ran first (trio order)
                    await got.lease.release()

            async with anyio.create_task_group() as tg:
                tg.start_soon(svc.call, cancel_victim)
                tg.start_soon(victim)
            await svc.sanity_check({FULL: 0})
            if strict_order:
                assert caught == [True]
            assert svc.leases_held == 0 and svc.cache.protected_size() == 0
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_cancelled_while_queued_is_skipped_without_hooks(anyio_backend: str) -> None:
    await scenario_cancelled_while_queued_fast_path(strict_order=anyio_backend == "asyncio")


async def scenario_ownership_move_cancelled_while_queued(strict_order: bool) -> None:
    """An insert whose caller is cancelled while the insert still waits in the queue: the
    caller waits for it anyway, gets the outcome, and is cancelled at its next checkpoint.
    (Trio may start the tasks in either order: then only the outcome is checked.)"""
    with anyio.fail_after(TIMEOUT):
        hook = CancelOnApply(Stats)
        async with AsyncUnifiedRadixCache(small_config(), max_batch=1, trace=hook) as svc:
            v = await svc.alloc(3)
            got: list[Any] = []
            caught: list[bool] = []

            async def victim() -> None:
                with anyio.CancelScope() as scope:
                    hook.scope = scope  # cancelled when the actor applies the Stats
                    got.append(await svc.insert([5, 6, 7], v))
                    await anyio.lowlevel.checkpoint()
                    got.append(None)  # not reached
                caught.append(scope.cancelled_caught)

            async with anyio.create_task_group() as tg:
                tg.start_soon(svc.stats)
                tg.start_soon(victim)
            if strict_order:
                assert hook.fired == 1 and caught == [True]
            # Cancelled (at the checkpoint after the insert) exactly when the second append
            # was not reached; the insert's outcome arrived either way.
            assert len(got) == (1 if caught == [True] else 2) and got[0].total_len == 3
            assert (await svc.match([5, 6, 7])).prefix_len == 3  # the tree took the slots
            await svc.sanity_check({FULL: 0})
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_ownership_move_cancelled_while_queued_completes(anyio_backend: str) -> None:
    await scenario_ownership_move_cancelled_while_queued(strict_order=anyio_backend == "asyncio")


@pytest.mark.asyncio
async def test_native_asyncio_cancellation_is_not_swallowed() -> None:
    """A plain ``Task.cancel()`` (no anyio scope cancelled) of a caller waiting for an
    ownership move goes through, as it would through a shielded scope; nothing leaks."""
    import asyncio

    with anyio.fail_after(TIMEOUT):
        state: dict[str, Any] = {}

        def hook(cmd: Command, result: Any, error: BaseException | None) -> None:
            if isinstance(cmd, Insert) and "task" in state:
                state.pop("task").cancel()

        async with AsyncUnifiedRadixCache(small_config(), trace=hook) as svc:
            v = await svc.alloc(3)
            task = asyncio.ensure_future(svc.insert([5, 6, 7], v))
            state["task"] = task
            with pytest.raises(asyncio.CancelledError):
                await task
            assert task.cancelled()
            assert (await svc.match([5, 6, 7])).prefix_len == 3  # applied all the same
            await svc.sanity_check({FULL: 0})
        check_clean(svc.cache)


async def scenario_overflow_keeps_send_order(strict_order: bool) -> None:
    """More senders than ``max_queued``: the rest wait in line and are applied in send
    order; ``queued`` counts them all."""
    with anyio.fail_after(TIMEOUT):
        history = History()
        seen: list[int] = []

        async with AsyncUnifiedRadixCache(small_config(), max_queued=2, trace=history) as svc:

            def peek(cache: Any) -> None:
                seen.append(svc.queued)

            async def ask(k: int) -> None:
                await svc.match([k])

            async with anyio.create_task_group() as tg:
                tg.start_soon(svc.call, peek)
                for k in range(20):
                    tg.start_soon(ask, k)
            await svc.sanity_check({FULL: 0})
        keys = [c.key.token_ids[0] for c, _, _ in history.entries if isinstance(c, Match)]
        assert sorted(keys) == list(range(20))
        if strict_order:  # asyncio: all 21 were sent before the actor ran; 20 still wait
            assert seen == [20] and keys == list(range(20))


@pytest.mark.asyncio
async def test_overflow_keeps_send_order() -> None:
    await scenario_overflow_keeps_send_order(strict_order=True)


@pytest.mark.asyncio
async def test_overflow_fifo_under_asyncio() -> None:
    """Under asyncio (FIFO scheduling) the apply order is exactly the send order."""
    with anyio.fail_after(TIMEOUT):
        history = History()
        async with AsyncUnifiedRadixCache(small_config(), max_queued=3, trace=history) as svc:
            async with anyio.create_task_group() as tg:
                for k in range(40):
                    tg.start_soon(svc.match, [k])
            assert svc.queued == 0
        keys = [c.key.token_ids[0] for c, _, _ in history.entries if isinstance(c, Match)]
        assert keys == list(range(40))


def test_overflow_keeps_send_order_trio() -> None:
    anyio.run(scenario_overflow_keeps_send_order, False, backend="trio")


# ====================================================================== the command stream
# The stream is bounded (``max_queued``): past that, callers wait for room (``await send``).


async def wait_idle(svc: AsyncUnifiedRadixCache) -> None:
    """Until the actor waits in ``receive()`` (a condition polled at checkpoints, no timer)."""
    while not svc._idle:
        await anyio.lowlevel.checkpoint()


async def scenario_close_applies_callers_waiting_for_room() -> None:
    with anyio.fail_after(TIMEOUT):
        results: list[int] = []
        async with AsyncUnifiedRadixCache(small_config(), max_queued=2) as svc:
            await prepared(svc)

            started = [0]

            async def matcher() -> None:
                started[0] += 1  # then it sends at once (or waits for room)
                results.append((await svc.match(KEY)).prefix_len)

            async def closer() -> None:
                while started[0] < 20:  # trio runs new tasks in any order
                    await anyio.lowlevel.checkpoint()
                await svc.aclose()

            async with anyio.create_task_group() as tg:
                for _ in range(20):  # most of them wait for room
                    tg.start_soon(matcher)
                tg.start_soon(closer)
        assert results == [len(KEY)] * 20
        assert svc.queued == 0
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_close_applies_callers_waiting_for_room(anyio_backend: str) -> None:
    """Callers still waiting for room in a full stream when close begins are applied."""
    await scenario_close_applies_callers_waiting_for_room()


async def scenario_cancelled_while_waiting_for_room(strict_order: bool) -> None:
    with anyio.fail_after(TIMEOUT):
        history = History()
        async with AsyncUnifiedRadixCache(small_config(), max_queued=1, trace=history) as svc:
            await prepared(svc)
            lease = (await svc.match(KEY, lock=True)).lease
            assert lease is not None
            scopes: list[anyio.CancelScope] = []
            released: list[bool] = []

            async def victim() -> None:
                got = None
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    got = await svc.match(KEY, lock=True)  # waits for room; cancelled there
                if strict_order:
                    assert scope.cancelled_caught
                if got is not None and got.lease is not None:  # it ran first (trio order)
                    await got.lease.release()

            async def releaser() -> None:
                assert lease is not None
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    await lease.release()  # waits for room (shielded); cancelled there
                released.append(lease.released)

            n0 = len(history.entries)
            await wait_idle(svc)
            async with anyio.create_task_group() as tg:
                tg.start_soon(svc.stats)  # handed to the waiting actor
                tg.start_soon(svc.stats)  # fills the stream
                tg.start_soon(victim)
                tg.start_soon(releaser)
                await anyio.lowlevel.checkpoint()
                if strict_order:  # asyncio: the four ran in order, before the actor
                    assert svc._sending == 2 and svc.queued == 4  # both wait for room
                for scope in scopes:
                    scope.cancel()
            await svc.sanity_check({FULL: 0})
            assert released == [True] and svc.leases_held == 0
            assert svc.cache.protected_size() == 0
            assert svc.queued == 0  # the count is right again once the actor drained
            applied = [type(c) for c, _, _ in history.entries[n0:]]
            assert Release in applied
            assert svc.leases_held == 0
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_cancelled_while_waiting_for_room(anyio_backend: str) -> None:
    """A match cancelled while it waits for room is withdrawn (or skipped); a release
    cancelled there is still applied; nothing leaks and the queue count recovers."""
    await scenario_cancelled_while_waiting_for_room(strict_order=anyio_backend == "asyncio")


@pytest.mark.asyncio
async def test_native_cancel_of_the_actor_answers_the_handed_over_call() -> None:
    """The actor is natively cancelled just after a call was handed to it in ``receive()``
    (the stream drops such an item): its caller is answered, not left hanging."""
    import asyncio

    from urc.errors import ServiceClosedError

    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(small_config()) as svc:
            await wait_idle(svc)
            actor = next(t for t in asyncio.all_tasks() if t.get_name() == "urc-actor")
            caller = asyncio.ensure_future(svc.alloc(4))
            await anyio.lowlevel.checkpoint()  # the caller hands its call over; the actor wakes
            assert svc._handoff is not None
            actor.cancel()  # lands before the actor resumes
            with pytest.raises(ServiceClosedError):
                await caller
        assert svc.state.value == "closed"
        check_clean(svc.cache)
