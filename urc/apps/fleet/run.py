"""One fleet run: N replicas, the event subscriber, the router, and the workload.

:func:`run_fleet` starts the shared L3 store (if any), N replicas
(:mod:`urc.apps.fleet.replica`) and the subscriber (:mod:`urc.apps.fleet.subscriber`) in one
event loop, then routes the workload's requests in arrival order.  For each request the
router hashes its prompt into pages (SGLang's block hashes), asks each replica's index how
many leading pages it holds (the *predicted* overlap), picks a replica under the policy, and
waits for that replica's slot (a replica serves one request at a time; the router's queue is
FIFO).  The replica's serving loop then reports what it *actually* had (device + host hits)
and what came from the shared L3.  Before each decision the router yields once to the event
loop, so whatever events have arrived are applied: the view lags by what the replicas have
not published or the sockets not delivered yet, as a real router's does.  The overlap is
read again when the chosen replica starts serving the request (after the requests queued
before it there): the difference between the two readings is the queue, what remains
against the actual hit is the event lag.

Time: the replay serves as fast as it can, so the trace's seconds shrink to milliseconds.
A real session sends its next request only after the previous answer (plus the client's
think time: a median 8.8 s after a tool call in the agentic sessions), by which time the
router has long applied that answer's events (the event lag here is milliseconds).  With
``FleetConfig.causal`` (the default) the fleet keeps that order: a session's request waits
until its previous request was served and the router has applied every event published by
then; and a replica's L3 writes land before it takes its next request (a write-through lands
in milliseconds, long before a real session's next turn).  Without it, the router decides
on whatever arrived, which in compressed time is far staler than a real router's view (the
accuracy columns show how much).

The run ends with every replica's L3 writes flushed, every publisher drained, the subscriber
caught up (:meth:`~urc.apps.fleet.subscriber.EventSubscriber.catch_up`), and the core's
invariants checked on every replica.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from time import perf_counter

import anyio
import anyio.lowlevel

from hicache.config import StorageBackupPolicy, StorageConfig
from urc.apps.fleet.index import PrefixHasher
from urc.apps.fleet.policy import AFFINITY_PREFIX_TOKENS, Router, RouterPolicy, RoutingParams
from urc.apps.fleet.replica import Replica, ReplicaSizes, open_replica
from urc.apps.fleet.report import FleetRun
from urc.apps.fleet.store import SharedStoreConfig, open_shared_store
from urc.apps.fleet.subscriber import EventSubscriber
from urc.apps.replay.config import ReplayConfig
from urc.apps.replay.source import WorkloadSummary, aiter_requests
from urc.apps.workloads import TraceRequest
from urc.node import Tier

__all__ = ["FleetConfig", "run_fleet"]


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """One run: ``replay`` (the workload and each replica's cache and serving knobs; its
    ``device_tokens`` / ``host_tokens`` are per replica, in cache tokens), ``replicas``,
    ``policy`` and its ``routing`` knobs, the shared ``store`` (its L3 pages written per
    ``l3_backup``; it needs a host tier), and ``drop_rate``: the share of live event
    batches the router loses (seeded; recovered through the replay sockets).  ``label``
    names the run in reports (default: the policy); ``fleet`` the N it stands for (a
    reference run on one replica stands for N; default: ``replicas``).  ``causal``: a
    session's request is routed only once its previous request was served and the router
    has applied every event published by then, and a replica's L3 writes land before it
    takes its next request (see the module docstring)."""

    replay: ReplayConfig
    replicas: int
    policy: RouterPolicy
    routing: RoutingParams = field(default_factory=RoutingParams)
    store: SharedStoreConfig = field(default_factory=SharedStoreConfig)
    l3_backup: StorageBackupPolicy = StorageBackupPolicy.WRITE_THROUGH
    drop_rate: float = 0.0
    label: str | None = None
    fleet: int | None = None
    causal: bool = True


class _Accuracy:
    """Per request: the overlap predicted on the chosen replica when the router chose it and
    again when the replica started serving it, and what the replica actually had."""

    def __init__(self) -> None:
        self.predicted = array("q")
        self.at_serve = array("q")
        self.actual = array("q")
        self.prompt = array("q")


def _affinity_key(tr: TraceRequest, hashes: list[int], page_size: int) -> str:
    if tr.session_id is not None:
        return tr.session_id
    if hashes:
        return str(hashes[min(len(hashes), max(1, AFFINITY_PREFIX_TOKENS // page_size)) - 1])
    return repr(tr.input_ids[:AFFINITY_PREFIX_TOKENS])


async def _route_all(
    config: FleetConfig,
    replicas: list[Replica],
    sub: EventSubscriber,
    acc: _Accuracy,
) -> None:
    ps = config.replay.page_size
    router = Router(config.policy, len(replicas), config.routing)
    hasher = PrefixHasher(ps)
    indexes = sub.indexes

    # Per session: set when its latest request has been served.
    session_done: dict[str, anyio.Event] = {}

    async def serve(rep: Replica, tr: TraceRequest, hashes: list[int], predicted: int) -> None:
        at_serve = indexes[rep.index].overlap(hashes) * ps
        done = session_done.get(tr.session_id) if tr.session_id is not None else None
        try:
            local, _from_l3 = await rep.serve(tr, settle=config.causal)
        finally:
            if done is not None:
                done.set()
        acc.predicted.append(predicted)
        acc.at_serve.append(at_serve)
        acc.actual.append(local)
        acc.prompt.append(tr.input_length)

    async with anyio.create_task_group() as tg:
        async for tr in aiter_requests(config.replay):
            await anyio.lowlevel.checkpoint()  # apply the events that have arrived
            if config.causal and tr.session_id is not None:
                previous = session_done.get(tr.session_id)
                if previous is not None:
                    await previous.wait()
                    await sub.sync([r.publisher for r in replicas])
                session_done[tr.session_id] = anyio.Event()
            hashes = hasher.hashes(tr.input_ids, tr.session_id)
            overlaps = [idx.overlap(hashes) * ps for idx in indexes]
            choice = router.choose(
                tr.timestamp_ms, tr.input_length, overlaps, _affinity_key(tr, hashes, ps)
            )
            router.routed(tr.timestamp_ms, choice, tr.input_length)
            rep = replicas[choice]
            await rep.slot.acquire()
            tg.start_soon(serve, rep, tr, hashes, overlaps[choice])


async def run_fleet(config: FleetConfig, summary: WorkloadSummary) -> FleetRun:
    """Run ``config`` (see the module docstring); ``summary`` is the workload's first pass
    (:func:`urc.apps.replay.source.summarize`), shared by the runs of a sweep.  Raises
    :class:`~urc.errors.ConfigError` for sizes that cannot be built (an L3 store without a
    host tier among them) and ``StorageUnavailableError`` when a remote store is down."""
    from urc.errors import ConfigError

    rc = config.replay
    ps = rc.page_size
    device = max(ps, rc.device_tokens.resolve(summary.unique_tokens, ps))
    host = rc.host_tokens.resolve(summary.unique_tokens, ps)
    if config.store.kind.value != "none" and host <= 0:
        raise ConfigError("a shared L3 store needs a host tier (host tokens > 0)")
    sizes = ReplicaSizes(device, host, summary.max_request_tokens)
    rng = random.Random(rc.seed)
    rate = config.drop_rate
    drop = (lambda _r, _s: rng.random() < rate) if rate > 0 else None
    acc = _Accuracy()
    t0 = perf_counter()
    async with AsyncExitStack() as stack:
        store = await stack.enter_async_context(open_shared_store(config.store))
        storage_config = StorageConfig(backup_policy=config.l3_backup)
        replicas = [
            await stack.enter_async_context(
                open_replica(i, rc, sizes, store, storage_config if store else None)
            )
            for i in range(config.replicas)
        ]
        endpoints = []
        for rep in replicas:
            pub = rep.publisher
            assert pub.endpoint is not None and pub.replay_endpoint is not None
            endpoints.append((pub.endpoint, pub.replay_endpoint))
        sub = EventSubscriber(endpoints, drop=drop)
        stack.callback(sub.close)
        tg = await stack.enter_async_context(anyio.create_task_group())
        tg.start_soon(sub.run)
        await sub.connected.wait()
        t_route = perf_counter()
        await _route_all(config, replicas, sub, acc)
        route_wall = perf_counter() - t_route
        for rep in replicas:
            await rep.flush()
        with anyio.fail_after(60):
            for rep in replicas:
                await rep.publisher.wait_drained()
            await sub.catch_up([rep.publisher.stats.batches_published for rep in replicas])
        tg.cancel_scope.cancel()
    errors = [e for e in (rep.check() for rep in replicas) if e is not None]
    return _summarize_run(
        config,
        sizes=sizes,
        summary=summary,
        replicas=replicas,
        predicted=acc.predicted,
        at_serve=acc.at_serve,
        actual=acc.actual,
        prompt=acc.prompt,
        subscriber=sub,
        wall_s=route_wall,
        total_s=perf_counter() - t0,
        errors=errors,
    )


def _percentile_ms(values: array[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return 1000.0 * ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _summarize_run(
    config: FleetConfig,
    *,
    sizes: ReplicaSizes,
    summary: WorkloadSummary,
    replicas: Sequence[Replica],
    predicted: array[int],
    at_serve: array[int],
    actual: array[int],
    prompt: array[int],
    subscriber: EventSubscriber,
    wall_s: float,
    total_s: float,
    errors: list[str],
) -> FleetRun:
    """Collect a finished run's figures."""
    hits = dict.fromkeys((t.name.lower() for t in Tier), 0)
    for rep in replicas:
        for tier, n in rep.hits.items():
            hits[tier.name.lower()] += n
    exact = over = under = 0
    err = 0.0
    for p, a, n in zip(predicted, actual, prompt, strict=True):
        if p == a:
            exact += 1
        elif p > a:
            over += 1
        else:
            under += 1
        if n:
            err += abs(p - a) / n
    count = len(predicted) or 1
    exact_at_serve = sum(1 for p, a in zip(at_serve, actual, strict=True) if p == a)
    stats = subscriber.stats
    l3 = [r.storage.stats for r in replicas if r.storage is not None]
    rc = config.replay
    unit = 1
    if rc.agentic:
        from urc.apps.replay.source import agentic_workload

        unit = agentic_workload(rc).block_size or 1
    return FleetRun(
        label=config.label or config.policy.value,
        policy=config.policy.value,
        fleet=config.fleet or config.replicas,
        replicas=config.replicas,
        device_tokens=sizes.device,
        host_tokens=sizes.host,
        l3=config.store.kind.value,
        token_unit=unit,
        requests=len(predicted),
        input_tokens=sum(prompt),
        hit_tokens=hits,
        ideal_hit_rate=summary.ideal_hit_rate,
        replica_requests=[r.requests for r in replicas],
        replica_prompt_tokens=[r.prompt_tokens for r in replicas],
        rejected=sum(r.rejected for r in replicas),
        predicted_tokens=sum(predicted),
        actual_tokens=sum(actual),
        exact_share=exact / count,
        over_share=over / count,
        under_share=under / count,
        mean_abs_error=err / count,
        exact_share_at_serve=exact_at_serve / count,
        lag_ms_p50=_percentile_ms(subscriber.lag_s, 0.5),
        lag_ms_p99=_percentile_ms(subscriber.lag_s, 0.99),
        lag_ms_max=1000.0 * max(subscriber.lag_s, default=0.0),
        event_batches=stats.batches,
        events=stats.events,
        gaps=stats.gaps,
        replayed_batches=stats.replayed,
        dropped_batches=stats.dropped,
        lost_batches=stats.lost,
        l3_pages_written=sum(w.pages_written for w in l3),
        l3_failures=sum(w.errors + w.dropped_writes for w in l3),
        wall_s=wall_s,
        total_s=total_s,
        check_errors=errors,
    )
