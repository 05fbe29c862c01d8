"""The async service: round trips, errors, close, failure, observers, background work, and a
256-client random workload checked against a sequential replay of the recorded history.

Every async test is bounded by ``anyio.fail_after``; nothing synchronises with sleeps.  A few
scenarios also run under trio (``pytest.mark.anyio``: once per backend of ``anyio_backend``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import torch
from service_harness import (
    AllocRow,
    FillRow,
    History,
    check_clean,
    replay,
    run_clients,
    small_config,
)

from urc import (
    ComponentType,
    KeyValueMismatchError,
    LeaseError,
    OutOfMemoryError,
    Req,
    ServiceClosedError,
    ServiceFailedError,
    UnifiedRadixCache,
    build_cache,
)
from urc.service import AsyncUnifiedRadixCache, ServiceState
from urc.service._commands import (
    Alloc,
    CacheFinishedReq,
    CacheUnfinishedReq,
    Call,
    Command,
    CommandKind,
    Evict,
    Insert,
    InsertOutcome,
    Lock,
    Match,
    MatchReq,
    Release,
    SanityCheck,
    Stats,
)
from urc.service._executor import CommandExecutor
from urc.service._lease import Lease
from urc.service._observer import ServiceObserver, TransferKind
from urc.stats import CacheStats

FULL = ComponentType.FULL
TIMEOUT = 30


# ====================================================================== basic behaviour
async def scenario_round_trip() -> None:
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(small_config()) as svc:
            assert svc.state is ServiceState.RUNNING
            v = await svc.alloc(8)
            res = await svc.insert(list(range(8)), v)
            assert res == InsertOutcome(prefix_len=0, total_len=8)
            m = await svc.match(list(range(10)), lock=True)
            assert m.prefix_len == 8 and torch.equal(m.device_indices, v)
            assert m.lease is not None and svc.leases_held == 1
            stats = await svc.stats()
            assert isinstance(stats, CacheStats)
            assert stats.component(FULL) is not None
            assert stats.component(FULL).protected == 8  # type: ignore[union-attr]
            lease2 = await svc.lock(m.node)
            assert lease2.prefix_len == 8 and svc.leases_held == 2
            async with lease2:
                pass
            assert lease2.released
            await m.lease.release()
            with pytest.raises(LeaseError):
                await m.lease.release()
            assert (await svc.evict(num_tokens=8)).num_tokens_evicted == 8
            assert (await svc.match(list(range(8)))).prefix_len == 0
            assert await svc.call(lambda c: c.evictable_size()) == 0
            await svc.sanity_check({FULL: 0})
        assert svc.leases_released_at_close == 0
        assert svc.state.value == "closed"
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_round_trip(anyio_backend: str) -> None:
    """match/insert/lock/release/evict/stats/call work and leave the cache clean.

    The same round trip under trio.
    """
    await scenario_round_trip()


@pytest.mark.asyncio
async def test_request_caching_through_service() -> None:
    """match_req + cache_unfinished_req + cache_finished_req move slots into the tree."""
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(small_config()) as svc:
            req = Req("r1", list(range(12)))
            await svc.call(AllocRow(req))
            m = await svc.match_req(req)
            assert m.prefix_len == 0 and m.lease is None
            await svc.call(FillRow(req))
            await svc.cache_unfinished_req(req)
            assert req.cache_protected_len == 12
            await svc.cache_finished_req(req)
            assert req.req_pool_idx is None
            req2 = Req("r2", [*range(12), 99])
            await svc.call(AllocRow(req2))
            m2 = await svc.match_req(req2)
            assert m2.prefix_len == 12
            with pytest.raises(Exception, match="already holds a lock"):
                await svc.match_req(req2)
            await svc.cache_finished_req(req2, is_insert=False)
            await svc.sanity_check({FULL: 0})
        check_clean(svc.cache)


@pytest.mark.asyncio
async def test_command_error_reaches_caller_and_service_keeps_serving() -> None:
    """A typed core error goes to its caller only; the cache is unchanged and still served."""
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(small_config()) as svc:
            v = await svc.alloc(4)
            with pytest.raises(KeyValueMismatchError):
                await svc.insert([1, 2, 3], v)
            with pytest.raises(OutOfMemoryError):
                await svc.alloc(10**6)
            with pytest.raises(LeaseError):
                await svc.release(Lease(42, 0, None))
            res = await svc.insert([1, 2, 3, 4], v)
            assert res.total_len == 4
            assert (await svc.match([1, 2, 3, 4])).prefix_len == 4
            await svc.sanity_check({FULL: 0})
        check_clean(svc.cache)


@pytest.mark.asyncio
async def test_closed_service_rejects_calls() -> None:
    """Before start and after close every call raises ServiceClosedError."""
    with anyio.fail_after(TIMEOUT):
        svc = AsyncUnifiedRadixCache(small_config())
        with pytest.raises(ServiceClosedError):
            await svc.match([1])
        async with svc:
            await svc.match([1])
        for call in (
            lambda: svc.match([1]),
            lambda: svc.stats(),
            lambda: svc.alloc(1),
            lambda: svc.insert([1], torch.tensor([0])),
            lambda: svc.sanity_check(),
        ):
            with pytest.raises(ServiceClosedError):
                await call()
        assert await svc.aclose() == 0  # idempotent
        with pytest.raises(ServiceClosedError):
            async with svc:
                pass


async def scenario_close_releases_leases() -> None:
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(small_config()) as svc:
            for k in range(3):
                key = [k, k + 1, k + 2]
                await svc.insert(key, await svc.alloc(3))
            leases = [(await svc.match([k, k + 1, k + 2], lock=True)).lease for k in range(3)]
            assert svc.leases_held == 3
            assert svc.cache.protected_size() == 9
            released = await svc.aclose()
        assert released == 3 == svc.leases_released_at_close
        assert all(lease is not None and lease.released for lease in leases)
        assert leases[0] is not None
        with pytest.raises(ServiceClosedError):
            await leases[0].release()
        check_clean(svc.cache)


@pytest.mark.anyio
async def test_close_releases_outstanding_leases(anyio_backend: str) -> None:
    """aclose releases (and counts) leases still held; the tree ends unlocked."""
    await scenario_close_releases_leases()


@pytest.mark.asyncio
async def test_close_drains_queued_commands() -> None:
    """Commands queued before close are applied (their callers get results)."""
    with anyio.fail_after(TIMEOUT):
        results: list[int] = []
        async with AsyncUnifiedRadixCache(small_config()) as svc:
            v = await svc.alloc(4)
            await svc.insert([5, 6, 7, 8], v)

            async def matcher() -> None:
                results.append((await svc.match([5, 6, 7, 8])).prefix_len)

            async with anyio.create_task_group() as tg:
                for _ in range(20):
                    tg.start_soon(matcher)
                tg.start_soon(svc.aclose)
        assert results == [4] * 20
        check_clean(svc.cache)


async def scenario_actor_failure() -> None:
    with anyio.fail_after(TIMEOUT):
        outcomes: list[BaseException] = []

        def fail_on_first_match(cmd: Command, result: Any, error: BaseException | None) -> None:
            if isinstance(cmd, Match):
                raise AssertionError("invariant broken (injected)")

        config = small_config()
        async with AsyncUnifiedRadixCache(config, max_queued=2, trace=fail_on_first_match) as svc:

            async def waiter() -> None:
                try:
                    await svc.match([1, 2])
                except ServiceFailedError as exc:
                    outcomes.append(exc)

            async with anyio.create_task_group() as tg:
                for _ in range(10):  # more than max_queued: some wait to send
                    tg.start_soon(waiter)
            assert svc.state is ServiceState.FAILED
            assert isinstance(svc.failure, AssertionError)
            with pytest.raises(ServiceFailedError):
                await svc.stats()
        assert len(outcomes) == 10  # the failing caller, the queued, the blocked, the late
        assert all(isinstance(o.__cause__, AssertionError) for o in outcomes)


@pytest.mark.anyio
async def test_actor_failure_fails_waiting_callers(anyio_backend: str) -> None:
    """An unexpected exception in the actor fails the caller, every queued or blocked caller
    and every later call with ServiceFailedError (cause chained); nothing hangs."""
    await scenario_actor_failure()


@pytest.mark.asyncio
async def test_actor_failure_fifo_fails_all_queued() -> None:
    """With asyncio's FIFO scheduling every caller queued behind the failing command fails."""
    with anyio.fail_after(TIMEOUT):
        errors: list[BaseException] = []

        def boom(cache: UnifiedRadixCache) -> None:
            raise RuntimeError("bug")

        async with AsyncUnifiedRadixCache(small_config()) as svc:

            async def call(fn: Callable[[], Awaitable[Any]]) -> None:
                try:
                    await fn()
                except ServiceFailedError as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call, lambda: svc.call(boom))
                for _ in range(5):
                    tg.start_soon(call, lambda: svc.match([1]))
                tg.start_soon(call, lambda: svc.insert([1], torch.tensor([0])))
        assert len(errors) == 7
        assert all(isinstance(e.__cause__, RuntimeError) for e in errors)


# ====================================================================== observer
@dataclass
class RecordingObserver:
    commands: list[tuple[CommandKind, float, float, BaseException | None]] = field(
        default_factory=list
    )
    batches: list[tuple[CacheStats, int]] = field(default_factory=list)
    transfers: list[tuple[TransferKind, int, int, float]] = field(default_factory=list)

    def on_command(
        self, kind: CommandKind, queue_wait_s: float, latency_s: float, error: BaseException | None
    ) -> None:
        self.commands.append((kind, queue_wait_s, latency_s, error))

    def on_batch(self, stats: CacheStats, queued: int) -> None:
        self.batches.append((stats, queued))

    def on_transfer(self, kind: TransferKind, tokens: int, nbytes: int, seconds: float) -> None:
        self.transfers.append((kind, tokens, nbytes, seconds))


@pytest.mark.asyncio
async def test_observer_sees_every_command_and_batch() -> None:
    """on_command per applied command (with its error), on_batch per batch with stats."""
    with anyio.fail_after(TIMEOUT):
        obs = RecordingObserver()
        assert isinstance(obs, ServiceObserver)
        async with AsyncUnifiedRadixCache(small_config(), observer=obs) as svc:
            v = await svc.alloc(3)
            await svc.insert([1, 2, 3], v)
            with pytest.raises(KeyValueMismatchError):
                await svc.insert([1, 2], v)
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(svc.match, [1, 2, 3])
        kinds = [k for k, *_ in obs.commands]
        assert kinds[:3] == [CommandKind.ALLOC, CommandKind.INSERT, CommandKind.INSERT]
        assert kinds.count(CommandKind.MATCH) == 8
        assert all(w >= 0 and lat >= 0 for _, w, lat, _ in obs.commands)
        errors = [e for *_, e in obs.commands if e is not None]
        assert [type(e) for e in errors] == [KeyValueMismatchError]
        assert obs.batches and all(isinstance(s, CacheStats) for s, _ in obs.batches)
        assert len(obs.batches) < len(obs.commands)  # the 8 matches came in few batches
        assert obs.batches[-1][0].inserted_tokens == 3


# ====================================================================== background work
@pytest.mark.asyncio
async def test_background_worker_cancelled_and_pins_released_at_close() -> None:
    """A background coroutine talks through commands; close cancels it, its cleanup may
    still call the service, and pins it held are released."""
    with anyio.fail_after(TIMEOUT):
        started = anyio.Event()
        cleaned: list[int] = []

        class Pinner:
            async def run(self, svc: AsyncUnifiedRadixCache) -> None:
                v = await svc.alloc(4)
                await svc.insert([9, 9, 9, 9], v)
                m = await svc.match([9, 9, 9, 9], lock=True)  # a pin, left held
                assert m.lease is not None
                try:
                    started.set()
                    await anyio.Event().wait()  # until cancelled
                finally:
                    with anyio.CancelScope(shield=True):
                        cleaned.append((await svc.stats()).num_nodes)

        async with AsyncUnifiedRadixCache(small_config(), workers=[Pinner()]) as svc:
            await started.wait()
            assert svc.cache.protected_size() == 4
        assert cleaned == [1]
        assert svc.leases_released_at_close == 1
        check_clean(svc.cache)


@pytest.mark.asyncio
async def test_background_worker_failure_never_fails_service() -> None:
    """An exception escaping a background coroutine ends that worker only: it is logged and
    kept, and the service keeps serving."""
    with anyio.fail_after(TIMEOUT):
        async with AsyncUnifiedRadixCache(small_config()) as svc:
            done = anyio.Event()

            async def bad(svc: AsyncUnifiedRadixCache) -> None:
                await svc.stats()
                done.set()
                raise ValueError("worker bug")

            svc.start_background(bad)
            await done.wait()
            while not svc.background_failures:
                await anyio.lowlevel.checkpoint()
            assert svc.state is ServiceState.RUNNING
            assert isinstance(svc.background_failures[0], ValueError)
            await svc.sanity_check({FULL: 0})
        check_clean(svc.cache)


# ====================================================================== concurrency
@pytest.mark.slow
@pytest.mark.asyncio
async def test_256_clients_random_ops_conserve_everything() -> None:
    """256 clients x 100 random ops: invariants hold, every slot and lock is returned, and the
    recorded history replays sequentially to identical results (linearizability)."""
    with anyio.fail_after(TIMEOUT * 2):
        config = small_config(kv_size=2048, max_num_reqs=300)
        history = History()
        async with AsyncUnifiedRadixCache(config, max_queued=64, trace=history) as svc:
            clients = await run_clients(svc, 256, 100, seed=1)
            await svc.sanity_check({FULL: 0})
            assert svc.leases_held == 0
            final_stats = await svc.stats()
        assert sum(c.ops for c in clients) == 256 * 100
        assert svc.leases_released_at_close == 0
        check_clean(svc.cache)
        kinds = {type(cmd) for cmd, _, _ in history.entries}
        assert {Match, Insert, Release, Lock, Alloc, MatchReq, CacheFinishedReq} <= kinds
        assert {CacheUnfinishedReq, Call, Evict, SanityCheck, Stats} <= kinds
        replayed = replay(config, history)
        assert replayed.stats() == final_stats
        assert torch.equal(
            replayed.all_values_flatten().sort().values,
            svc.cache.all_values_flatten().sort().values,
        )


@pytest.mark.asyncio
async def test_batching_applies_queued_commands_in_one_wakeup() -> None:
    """Commands queued together are applied in one batch, in send order."""
    with anyio.fail_after(TIMEOUT):
        obs = RecordingObserver()
        history = History()
        async with AsyncUnifiedRadixCache(small_config(), observer=obs, trace=history) as svc:
            await svc.stats()
            n0 = len(obs.batches)
            order: list[int] = []

            async def ask(k: int) -> None:
                await svc.match([k])
                order.append(k)

            async with anyio.create_task_group() as tg:
                for k in range(32):
                    tg.start_soon(ask, k)
            assert len(obs.batches) - n0 <= 2
            keys = [cmd.key.token_ids[0] for cmd, _, _ in history.entries if isinstance(cmd, Match)]
            assert sorted(keys) == list(range(32))


def test_replay_detects_divergence() -> None:
    """The replay checker is not vacuous: a tampered result is reported."""
    config = small_config()
    history = History()
    cache = build_cache(config)
    ex = CommandExecutor(cache)
    for cmd in (Alloc(4), Stats()):
        history(cmd, ex.apply(cmd), None)
    history.entries[0] = (Alloc(4), torch.tensor([9, 9, 9, 9]), None)
    with pytest.raises(AssertionError):
        replay(config, history)


@dataclass
class PullingRecorder(RecordingObserver):
    """A pulling observer (``attach``) that asks for ``on_batch`` every ``interval`` s."""

    interval: float | None = None
    source: Any = None

    def attach(self, source: Any) -> float | None:
        self.source = source
        return self.interval


@pytest.mark.asyncio
async def test_pulling_observer_gets_a_snapshot_source() -> None:
    """An observer with ``attach`` gets no per-batch snapshot (interval None), pulls exact
    ones from the source on the loop or from another thread, and the final one after close."""
    import anyio.to_thread

    from urc.service._observer import PullingObserver, ServiceSnapshot

    with anyio.fail_after(TIMEOUT):
        obs = PullingRecorder()
        assert isinstance(obs, PullingObserver)
        async with AsyncUnifiedRadixCache(small_config(), observer=obs) as svc:
            v = await svc.alloc(4)
            await svc.insert([1, 2, 3, 4], v)
            snap = obs.source.snapshot()
            assert isinstance(snap, ServiceSnapshot)
            assert snap.stats == await svc.stats() and snap.queued == 0
            other = await anyio.to_thread.run_sync(obs.source.snapshot)
            assert other.seq > snap.seq and other.stats == snap.stats
            await svc.match([1, 2])
        assert obs.batches == [] and len(obs.commands) == 4
        final = obs.source.snapshot()
        assert final is obs.source.snapshot()  # fixed at close
        assert final.stats == svc.cache.stats() and final.stats.match_requests == 1

        every = PullingRecorder(interval=0.0)  # 0: on_batch after every batch, like a plain one
        async with AsyncUnifiedRadixCache(small_config(), observer=every) as svc:
            for _ in range(3):
                await svc.stats()
        assert len(every.batches) >= 3 and every.batches[-1][0] == svc.cache.stats()
