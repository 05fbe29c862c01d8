"""Small real fleets: replicas on urc's async service publishing on real loopback ZMQ
sockets, the router's subscriber, a shared L3 on local files (the remote stores:
``test_fleet_stores.py``).

The router's index is checked against each replica's tree (every page hashed from its whole
path): exact after the run, including when the subscriber lost a third of the live batches
and had to recover them through the replay sockets."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kv_events_harness import CPU, GPU, tree_pages

from urc.apps.fleet import (
    BOUND,
    FLOOR,
    FleetConfig,
    L3Kind,
    RouterPolicy,
    SharedStoreConfig,
    run_fleet,
    run_sweep,
)
from urc.apps.fleet.replica import Replica, ReplicaSizes, open_replica
from urc.apps.fleet.subscriber import EventSubscriber
from urc.apps.replay.config import ReplayConfig
from urc.apps.replay.options import Capacity
from urc.apps.replay.source import summarize, synthetic_requests
from urc.apps.workloads import TraceRequest
from urc.host_protocol import WritePolicy

PS = 4


def _replay(requests: int = 40, device: int = 6000, host: int = 0) -> ReplayConfig:
    return ReplayConfig(
        num_requests=requests,
        device_tokens=Capacity(tokens=device),
        host_tokens=Capacity(tokens=host),
        write_policy=WritePolicy.WRITE_THROUGH,
        page_size=PS,
        chunk_size=1 << 16,
        concurrency=1,
        prefill_only=True,
    )


async def _serve(replicas: list[Replica], requests: list[TraceRequest]) -> None:
    """Round-robin, one request at a time per replica (as the fleet's router does)."""
    async with anyio.create_task_group() as tg:
        for i, tr in enumerate(requests):
            rep = replicas[i % len(replicas)]
            await rep.slot.acquire()
            tg.start_soon(rep.serve, tr)


async def _settle(replicas: list[Replica], sub: EventSubscriber) -> list[int]:
    """Wait (under the caller's deadline) until no replica publishes anything new -- host
    backups finish in the background after the last request -- and the subscriber has
    caught up with all of it; returns the batches each replica published."""
    while True:
        for rep in replicas:
            await rep.publisher.wait_drained()
        published = [rep.publisher.stats.batches_published for rep in replicas]
        await sub.catch_up(published)
        await anyio.sleep(0.05)  # a polling interval: the host tier has no idle signal
        if [rep.publisher.stats.batches_published for rep in replicas] == published:
            return published


def _every_third(_replica: int, seq: int) -> bool:
    return seq % 3 == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("host", [0, 3000], ids=["device-only", "with-host"])
@pytest.mark.parametrize("drop", [None, _every_third], ids=["no-loss", "lossy"])
async def test_the_router_index_matches_every_replica_tree_after_recovering_lost_batches(
    host: int, drop: Callable[[int, int], bool] | None
) -> None:
    config = _replay(host=host)
    summary = await summarize(config)
    sizes = ReplicaSizes(6000, host, summary.max_request_tokens)
    requests = list(synthetic_requests(config))
    with anyio.fail_after(60):
        async with AsyncExitStack() as stack:
            replicas = [
                await stack.enter_async_context(open_replica(i, config, sizes, None))
                for i in range(2)
            ]
            endpoints = [(r.publisher.endpoint, r.publisher.replay_endpoint) for r in replicas]
            sub = EventSubscriber(endpoints, drop=drop)  # type: ignore[arg-type]
            stack.callback(sub.close)
            tg = await stack.enter_async_context(anyio.create_task_group())
            tg.start_soon(sub.run)
            await sub.connected.wait()
            await _serve(replicas, requests)
            published = await _settle(replicas, sub)
            for rep, idx in zip(replicas, sub.indexes, strict=True):
                truth = tree_pages(rep.cache)
                assert idx.device == truth[GPU] and idx.device
                assert idx.host == truth[CPU]
                assert bool(idx.host) == (host > 0)
            assert sub.next_seq == published
            stats = sub.stats
            if drop is not None:
                assert stats.dropped > 0 and stats.gaps > 0
                assert stats.replayed >= stats.dropped
            assert stats.lost == 0
            tg.cancel_scope.cancel()
    for rep in replicas:
        assert rep.check() is None


@pytest.mark.asyncio
async def test_sync_recovers_a_lost_last_batch_through_the_replay_socket() -> None:
    config = _replay(requests=6)
    summary = await summarize(config)
    sizes = ReplicaSizes(6000, 0, summary.max_request_tokens)
    requests = list(synthetic_requests(config))
    with anyio.fail_after(60):
        async with AsyncExitStack() as stack:
            rep = await stack.enter_async_context(open_replica(0, config, sizes, None))
            endpoints = [(rep.publisher.endpoint, rep.publisher.replay_endpoint)]
            lost: list[int] = []
            sub = EventSubscriber(endpoints, drop=lambda _r, seq: not lost and seq >= 2)  # type: ignore[arg-type]
            stack.callback(sub.close)
            tg = await stack.enter_async_context(anyio.create_task_group())
            tg.start_soon(sub.run)
            await sub.connected.wait()
            await _serve([rep], requests)
            await sub.sync([rep.publisher])
            lost.append(1)  # stop dropping: the rest of the stream was lost
            published = rep.publisher.stats.batches_published
            assert sub.next_seq == [published] and published > 2
            # Lost here (or before the subscription reached the publisher): replayed.
            assert sub.stats.replayed >= published - 2
            assert sub.indexes[0].device == tree_pages(rep.cache)[GPU]
            tg.cancel_scope.cancel()


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", list(RouterPolicy))
async def test_a_small_fleet_serves_every_request_under_each_policy(policy: RouterPolicy) -> None:
    config = _replay(requests=60)
    summary = await summarize(config)
    with anyio.fail_after(90):
        run = await run_fleet(FleetConfig(config, 3, policy, drop_rate=0.2), summary)
    assert run.ok, run.check_errors
    assert run.requests == 60 and sum(run.replica_requests) == 60
    assert run.input_tokens == summary.input_tokens
    assert 0 < run.hit_rate <= summary.ideal_hit_rate
    assert run.dropped_batches > 0 and run.lost_batches == 0
    assert run.exact_share + run.over_share + run.under_share == pytest.approx(1.0)
    if policy is RouterPolicy.ROUND_ROBIN:
        assert run.replica_requests == [20, 20, 20]
    # The router's prediction never exceeds what the replica could hold at most.
    assert run.predicted_tokens <= run.input_tokens


@pytest.mark.asyncio
async def test_a_sweep_has_the_bound_and_the_floor_and_kv_aware_between(tmp_path: Path) -> None:
    base = FleetConfig(
        _replay(requests=80, device=4000, host=2000),
        2,
        RouterPolicy.KV_AWARE,
        store=SharedStoreConfig(L3Kind.FILE, directory=tmp_path),
    )
    with anyio.fail_after(120):
        sweep = await run_sweep(
            base, [2], [RouterPolicy.KV_AWARE], session_concurrency_per_replica=1.0
        )
    labels = [r.label for r in sweep.runs]
    assert labels == [BOUND, FLOOR, "kv-aware"]
    bound = sweep.bound(2)
    assert bound is not None and bound.replicas == 1 and bound.fleet == 2
    assert bound.device_tokens == 2 * sweep.runs[1].device_tokens
    assert sweep.ok
    assert "| 2 | kv-aware |" in sweep.format()
    doc = sweep.to_dict()
    assert [r["label"] for r in doc["runs"]] == labels
    kv = sweep.runs[2]
    assert kv.hit_tokens["storage"] >= 0 and kv.l3 == "file"
    assert dataclasses.asdict(kv)["fleet"] == 2
