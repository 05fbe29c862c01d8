"""Tests of the Prometheus exporter (``metrics.exporter``): gauges, counters, histograms.

Every test uses a fresh ``CollectorRegistry``.  Most drive a real cache through
:class:`Actor`, which applies service commands with a ``CommandExecutor`` and calls the
observer exactly as the service's actor does (``on_command`` per command, ``on_batch`` per
batch); one test goes through the real ``AsyncUnifiedRadixCache``.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
import pytest
from metrics_harness import (
    COMPONENT_SETS,
    FULL,
    MAMBA,
    Actor,
    assert_counters_match,
    assert_gauges_match,
    assert_histograms_match,
    build,
    make_stats,
    seq,
    sum_samples,
    value,
)
from prometheus_client import CollectorRegistry

from hicache.storage.stats import StorageErrorObserver, StorageOp
from metrics import (
    COMMAND_BUCKETS,
    CacheMetrics,
    ExportMode,
    GaugeMultiprocessMode,
    MetricsConfig,
    make_observer,
)
from urc import RadixKey, Tier
from urc.errors import URCError
from urc.params import EvictParams
from urc.service._commands import (
    Alloc,
    CommandKind,
    Evict,
    Match,
    MatchOutcome,
    Release,
)
from urc.service._lease import Lease
from urc.service._observer import ServiceObserver, TransferKind
from urc.stats import ComponentStats


# ---------------------------------------------------------------------------- scripted cache
@pytest.mark.parametrize("components", list(COMPONENT_SETS))
def test_scripted_sequence_gauges_counters_histograms(
    registry: CollectorRegistry, mode: ExportMode, components: str
) -> None:
    cache = build(components)
    exporter = CacheMetrics(registry, MetricsConfig(mode=mode))
    assert isinstance(exporter, ServiceObserver)
    actor = Actor(cache, exporter)

    a = seq(1000, 32)
    b = a[:16] + seq(2000, 16)
    c = seq(3000, 40)
    for tokens in (a, b, c):
        actor.insert(tokens)
        assert_gauges_match(registry, cache)
        assert_counters_match(registry, cache)

    # Matches (hits and a miss) in one batch, then a lock held across batches.
    hits = actor.batch([Match(RadixKey(a)), Match(RadixKey(b[:20])), Match(RadixKey(seq(9, 9)))])
    assert all(isinstance(h, MatchOutcome) for h in hits)
    locked = actor.one(Match(RadixKey(c), lock=True))
    assert isinstance(locked, MatchOutcome) and locked.lease is not None
    assert_gauges_match(registry, cache)
    if locked.prefix_len:
        assert value(registry, "urc_cache_protected_tokens", component="full", tier="device") > 0
    assert_counters_match(registry, cache)

    # Errors are counted by command kind and exception class; the cache is unchanged.
    bogus = Lease(10_000, 0, None)
    errs = actor.batch([Release(bogus), Alloc(-1), Evict(EvictParams(num_tokens=-1))])
    assert all(isinstance(e, URCError) for e in errs)
    for kind, name in actor.errors:
        assert value(registry, "urc_command_errors_total", kind=kind.value, error_type=name) == sum(
            1 for e in actor.errors if e == (kind, name)
        )
    assert sum_samples(registry, "urc_command_errors_total") == len(actor.errors) == 3

    # Partial eviction (the locked prefix survives), release, then evict everything.
    actor.one(Evict(EvictParams(num_tokens=20, mamba_num=1)))
    assert_gauges_match(registry, cache)
    assert_counters_match(registry, cache)
    actor.one(Release(locked.lease))
    actor.one(Evict(EvictParams(num_tokens=10_000, swa_num_tokens=10_000, mamba_num=10_000)))
    assert cache.evictable_size() == 0
    assert value(registry, "urc_cache_evictable_tokens", component="full", tier="device") == 0
    assert_gauges_match(registry, cache)
    assert_counters_match(registry, cache)
    assert value(registry, "urc_evicted_tokens_total", component="full", tier="device") > 0
    assert_histograms_match(registry, actor)
    cache.sanity_check()


def test_counter_deltas_across_snapshots(registry: CollectorRegistry, mode: ExportMode) -> None:
    cache = build()
    exporter = CacheMetrics(registry, MetricsConfig(mode=mode))
    actor = Actor(cache, exporter)
    actor.insert(seq(0, 64))
    before = {
        "req": value(registry, "urc_match_requests_total"),
        "query": value(registry, "urc_match_query_tokens_total"),
        "hit": value(registry, "urc_match_hit_tokens_total", tier="device"),
    }
    # Several batches of matches of known sizes: each counter advances by exactly the delta.
    for n in (8, 16, 64):
        actor.one(Match(RadixKey(seq(0, n))))
        after = {
            "req": value(registry, "urc_match_requests_total"),
            "query": value(registry, "urc_match_query_tokens_total"),
            "hit": value(registry, "urc_match_hit_tokens_total", tier="device"),
        }
        assert after["req"] - before["req"] == 1
        assert after["query"] - before["query"] == n
        assert after["hit"] - before["hit"] == n
        before = after
    # A batch with no counter change leaves counters alone (an unchanged snapshot is a no-op).
    exporter.on_batch(cache.stats(), 0)
    exporter.on_batch(cache.stats(), 0)
    assert value(registry, "urc_match_requests_total") == before["req"]
    # Misses count queries but no hits.
    actor.one(Match(RadixKey(seq(500, 10))))
    assert value(registry, "urc_match_query_tokens_total") == before["query"] + 10
    assert value(registry, "urc_match_hit_tokens_total", tier="device") == before["hit"]
    assert_counters_match(registry, cache)


def test_host_tier_and_mamba_units_from_snapshots(
    registry: CollectorRegistry, mode: ExportMode
) -> None:
    """Whatever (component, tier) entries a snapshot has are exported, each in its unit."""
    exporter = CacheMetrics(registry, MetricsConfig(mode=mode))
    comps = (
        ComponentStats(FULL, Tier.DEVICE, "tokens", 10, 5, 100, 80),
        ComponentStats(FULL, Tier.HOST, "tokens", 300, 7, 1000, 690),
        ComponentStats(MAMBA, Tier.DEVICE, "states", 3, 1, 16, 12),
        ComponentStats(MAMBA, Tier.HOST, "states", 4, 0, 64, 60),
    )
    exporter.on_batch(
        make_stats(
            comps,
            num_nodes=9,
            match_requests=4,
            query_tokens=100,
            hit_tokens={Tier.DEVICE: 40, Tier.HOST: 20, Tier.STORAGE: 10},
            evicted={(FULL, Tier.DEVICE): 50, (FULL, Tier.HOST): 30, (MAMBA, Tier.DEVICE): 2},
            backed_up_tokens=70,
            loaded_back_tokens=20,
        ),
        queued=5,
    )
    host = {"component": "full", "tier": "host"}
    assert value(registry, "urc_cache_evictable_tokens", **host) == 300
    assert value(registry, "urc_cache_protected_tokens", **host) == 7
    assert value(registry, "urc_pool_used_tokens", **host) == 310
    assert value(registry, "urc_pool_free_tokens", **host) == 690
    mh = {"component": "mamba", "tier": "host"}
    assert value(registry, "urc_cache_evictable_states", **mh) == 4
    assert value(registry, "urc_pool_capacity_states", **mh) == 64
    assert registry.get_sample_value("urc_cache_evictable_tokens", mh) is None
    for tier, n in (("device", 40), ("host", 20), ("storage", 10)):
        assert value(registry, "urc_match_hit_tokens_total", tier=tier) == n
    assert value(registry, "urc_evicted_tokens_total", component="full", tier="host") == 30
    assert value(registry, "urc_evicted_states_total", component="mamba", tier="device") == 2
    assert (
        registry.get_sample_value(
            "urc_evicted_tokens_total", {"component": "mamba", "tier": "device"}
        )
        is None
    )
    assert value(registry, "urc_backed_up_tokens_total") == 70
    assert value(registry, "urc_loaded_back_tokens_total") == 20
    assert value(registry, "urc_service_queued_commands") == 5
    assert value(registry, "urc_tree_nodes") == 9
    # Label values stay inside the documented bounded sets.
    for fam in registry.collect():
        for s in fam.samples:
            assert s.labels.get("component", "full") in {"full", "swa", "mamba"}
            assert s.labels.get("tier", "device") in {"device", "host", "storage"}


def test_counter_going_backwards_counts_as_reset(
    registry: CollectorRegistry, mode: ExportMode
) -> None:
    exporter = CacheMetrics(registry, MetricsConfig(mode=mode))
    exporter.on_batch(make_stats(match_requests=10, hit_tokens={Tier.DEVICE: 5}), 0)
    exporter.on_batch(make_stats(match_requests=12, hit_tokens={Tier.DEVICE: 9}), 0)
    assert value(registry, "urc_match_requests_total") == 12
    # A replaced/reset source: its new value is the increase since the reset.
    exporter.on_batch(make_stats(match_requests=3, hit_tokens={Tier.DEVICE: 1}), 0)
    assert value(registry, "urc_match_requests_total") == 15
    assert value(registry, "urc_match_hit_tokens_total", tier="device") == 10
    exporter.on_batch(make_stats(match_requests=4, hit_tokens={Tier.DEVICE: 1}), 0)
    assert value(registry, "urc_match_requests_total") == 16


def test_gauges_follow_decreases_and_queue(registry: CollectorRegistry, mode: ExportMode) -> None:
    exporter = CacheMetrics(registry, MetricsConfig(mode=mode))
    dev = {"component": "full", "tier": "device"}
    for ev, queued in ((10, 3), (4, 0), (0, 7), (0, 7)):
        comps = (ComponentStats(FULL, Tier.DEVICE, "tokens", ev, 0, 64, 64 - ev),)
        exporter.on_batch(make_stats(comps, num_nodes=ev), queued)
        assert value(registry, "urc_cache_evictable_tokens", **dev) == ev
        assert value(registry, "urc_pool_used_tokens", **dev) == ev
        assert value(registry, "urc_tree_nodes") == ev
        assert value(registry, "urc_service_queued_commands") == queued


def test_transfers_and_in_flight(registry: CollectorRegistry, mode: ExportMode) -> None:
    exporter = CacheMetrics(registry, MetricsConfig(mode=mode))
    exporter.on_transfer(TransferKind.STORAGE_READ, 64, 4096, 2e-3)
    exporter.on_transfer(TransferKind.STORAGE_READ, 32, 2048, 5e-4)
    exporter.on_transfer(TransferKind.STORAGE_WRITE, 16, 1024, 1e-3)
    exporter.on_transfer(TransferKind.BACKUP, 128, 8192, 3e-5)
    exporter.on_transfer(TransferKind.LOAD_BACK, 8, 512, 7e-6)
    rd = {"kind": "storage_read"}
    assert value(registry, "urc_transfers_total", **rd) == 2
    assert value(registry, "urc_transfer_bytes_total", **rd) == 6144
    assert value(registry, "urc_transfer_tokens_total", **rd) == 96
    assert value(registry, "urc_transfers_total", kind="storage_write") == 1
    assert value(registry, "urc_transfer_bytes_total", kind="storage_write") == 1024
    assert value(registry, "urc_transfer_duration_seconds_count", kind="backup") == 1
    assert value(registry, "urc_transfer_duration_seconds_count", kind="load_back") == 1
    assert value(registry, "urc_transfer_duration_seconds_sum", **rd) == pytest.approx(2.5e-3)
    # Microsecond buckets: a 7 us load-back lands below 10 us, not in a millisecond bucket.
    assert (
        value(registry, "urc_transfer_duration_seconds_bucket", kind="load_back", le="1e-05") == 1
    )

    flight = {"kind": "backup"}
    with exporter.track_transfer(TransferKind.BACKUP):
        assert value(registry, "urc_transfers_in_flight", **flight) == 1
        exporter.transfer_started(TransferKind.BACKUP)
        assert value(registry, "urc_transfers_in_flight", **flight) == 2
        exporter.transfer_finished(TransferKind.BACKUP)
    assert value(registry, "urc_transfers_in_flight", **flight) == 0
    with pytest.raises(RuntimeError), exporter.track_transfer(TransferKind.STORAGE_READ):
        raise RuntimeError("transfer failed")
    assert value(registry, "urc_transfers_in_flight", kind="storage_read") == 0
    exporter.set_transfers_in_flight(TransferKind.LOAD_BACK, 3)
    assert value(registry, "urc_transfers_in_flight", kind="load_back") == 3


def test_command_histogram_buckets_are_microsecond_scale(
    registry: CollectorRegistry, mode: ExportMode
) -> None:
    assert COMMAND_BUCKETS[0] == 1e-6 and COMMAND_BUCKETS[-1] == 1.0
    exporter = CacheMetrics(registry, MetricsConfig(mode=mode))
    exporter.on_command(CommandKind.MATCH, 2e-6, 3e-6, None)
    exporter.on_command(CommandKind.MATCH, 0.0, 0.2, None)
    exporter.on_command(CommandKind.INSERT, -1e-9, -1e-9, None)  # clamped, never negative
    m = {"kind": "match"}
    assert value(registry, "urc_command_duration_seconds_bucket", le="2.5e-06", **m) == 0
    assert value(registry, "urc_command_duration_seconds_bucket", le="5e-06", **m) == 1
    assert value(registry, "urc_command_duration_seconds_bucket", le="0.25", **m) == 2
    assert value(registry, "urc_command_duration_seconds_sum", kind="insert") == 0
    assert value(registry, "urc_command_queue_wait_seconds_bucket", le="2.5e-06") == 3


def test_error_types_are_capped(registry: CollectorRegistry, mode: ExportMode) -> None:
    exporter = CacheMetrics(registry, MetricsConfig(max_error_types=2, mode=mode))
    errors: list[BaseException] = [KeyError(), ValueError(), TypeError(), OSError(), KeyError()]
    for e in errors:
        exporter.on_command(CommandKind.CALL, 0.0, 0.0, e)
    call = {"kind": "call"}
    assert value(registry, "urc_command_errors_total", error_type="KeyError", **call) == 2
    assert value(registry, "urc_command_errors_total", error_type="ValueError", **call) == 1
    assert value(registry, "urc_command_errors_total", error_type="other", **call) == 2
    assert sum_samples(registry, "urc_command_errors_total") == 5


# ---------------------------------------------------------------------------- registries
def test_two_caches_with_separate_registries_do_not_collide(mode: ExportMode) -> None:
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    c1, c2 = build(), build(kv_size=512)
    a1, a2 = (
        Actor(c1, CacheMetrics(r1, MetricsConfig(mode=mode))),
        Actor(c2, CacheMetrics(r2, MetricsConfig(mode=mode))),
    )
    a1.insert(seq(0, 100))
    a2.insert(seq(0, 30))
    a2.insert(seq(50, 20))
    a1.one(Match(RadixKey(seq(0, 50))))
    for reg, cache, actor in ((r1, c1, a1), (r2, c2, a2)):
        assert_gauges_match(reg, cache)
        assert_counters_match(reg, cache)
        assert_histograms_match(reg, actor)
    dev = {"component": "full", "tier": "device"}
    assert value(r1, "urc_cache_evictable_tokens", **dev) == 100
    assert value(r2, "urc_cache_evictable_tokens", **dev) == 50
    assert value(r1, "urc_pool_capacity_tokens", **dev) == 1024
    assert value(r2, "urc_pool_capacity_tokens", **dev) == 512


def test_same_registry_twice_is_refused_until_unregistered(
    registry: CollectorRegistry, mode: ExportMode
) -> None:
    first = CacheMetrics(registry, MetricsConfig(mode=mode))
    with pytest.raises(ValueError, match="Duplicated"):
        CacheMetrics(registry, MetricsConfig(mode=mode))
    first.unregister()
    first.unregister()  # idempotent
    assert not [f for f in registry.collect() if f.name.startswith("urc_")]
    second = CacheMetrics(registry, MetricsConfig(mode=mode))
    second.on_batch(build().stats(), 0)
    assert registry.get_sample_value("urc_tree_nodes") == 0


def test_disabled_exporter_registers_nothing_and_ignores_calls(
    registry: CollectorRegistry,
) -> None:
    off = MetricsConfig(enabled=False)
    assert make_observer(off, registry) is None
    exporter = CacheMetrics(registry, off)
    cache = build()
    actor = Actor(cache, exporter)
    actor.insert(seq(0, 10))
    exporter.on_transfer(TransferKind.BACKUP, 1, 1, 1.0)
    with exporter.track_transfer(TransferKind.BACKUP):
        pass
    exporter.set_transfers_in_flight(TransferKind.BACKUP, 2)
    assert list(registry.collect()) == []
    on = make_observer(registry=registry)
    assert isinstance(on, CacheMetrics) and on.enabled


def test_default_registry_is_the_global_one() -> None:
    from prometheus_client import REGISTRY

    exporter = CacheMetrics()
    try:
        assert exporter.registry is REGISTRY
        assert REGISTRY.get_sample_value("urc_tree_nodes") == 0
    finally:
        exporter.unregister()
    assert REGISTRY.get_sample_value("urc_tree_nodes") is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"command_buckets": ()},
        {"command_buckets": (1e-3, 1e-4)},
        {"transfer_buckets": (0.0, 1.0)},
        {"transfer_buckets": (1.0, float("inf"))},
        {"max_error_types": 0},
    ],
)
def test_config_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MetricsConfig(**kwargs)


def test_custom_buckets_and_gauge_mode(registry: CollectorRegistry, mode: ExportMode) -> None:
    cfg = MetricsConfig(
        command_buckets=(1e-3, 1.0),
        gauge_multiprocess_mode=GaugeMultiprocessMode.MOSTRECENT,
        mode=mode,
    )
    exporter = CacheMetrics(registry, cfg)
    exporter.on_command(CommandKind.STATS, 0.0, 5e-4, None)
    assert value(registry, "urc_command_duration_seconds_bucket", kind="stats", le="0.001") == 1
    assert (
        registry.get_sample_value(
            "urc_command_duration_seconds_bucket", {"kind": "stats", "le": "1e-06"}
        )
        is None
    )


# ---------------------------------------------------------------------------- through the service
@pytest.mark.asyncio
async def test_through_the_service(registry: CollectorRegistry) -> None:
    service = pytest.importorskip("urc.service")
    cache = build()
    exporter = CacheMetrics(registry)
    submitted: dict[CommandKind, int] = {}

    def sent(kind: CommandKind) -> None:
        submitted[kind] = submitted.get(kind, 0) + 1

    with anyio.fail_after(30):
        async with service.AsyncUnifiedRadixCache(cache, observer=exporter) as svc:

            async def figures() -> tuple[int, int, int]:
                # Runs in the actor, so the batch that follows reports the same state.
                sent(CommandKind.CALL)
                figs: tuple[int, int, int] = await svc.call(
                    lambda c: (c.evictable_size(), c.protected_size(), c.num_nodes)
                )
                return figs

            async def check() -> None:
                ev, prot, nodes = await figures()
                dev = {"component": "full", "tier": "device"}
                assert value(registry, "urc_cache_evictable_tokens", **dev) == ev
                assert value(registry, "urc_cache_protected_tokens", **dev) == prot
                assert value(registry, "urc_tree_nodes") == nodes

            for i in range(4):
                sent(CommandKind.ALLOC)
                v = await svc.alloc(24)
                sent(CommandKind.INSERT)
                await svc.insert(seq(0, 8) + seq(100 * (i + 1), 16), v)
                await check()
            sent(CommandKind.MATCH)
            hit = await svc.match(seq(0, 8) + seq(100, 16), lock=True)
            assert hit.lease is not None and hit.prefix_len == 24
            await check()
            assert value(registry, "urc_cache_protected_tokens", component="full",
                         tier="device") == 24  # fmt: skip

            # Concurrent clients: one batch may hold many commands; every one is observed.
            async def client(k: int) -> None:
                sent(CommandKind.MATCH)
                await svc.match(seq(0, 8) + seq(100 * (k % 4 + 1), 10))

            async with anyio.create_task_group() as tg:
                for k in range(32):
                    tg.start_soon(client, k)
            sent(CommandKind.RELEASE)
            await hit.lease.release()
            sent(CommandKind.EVICT)
            with pytest.raises(URCError):
                await svc.evict(-1)
            sent(CommandKind.EVICT)
            await svc.evict(1000)
            await check()
            sent(CommandKind.STATS)
            await svc.stats()
    # The close drains the queue and reports one last batch.
    assert_gauges_match(registry, cache)
    assert_counters_match(registry, cache)
    for kind in CommandKind:
        n = submitted.get(kind, 0)
        assert value(registry, "urc_command_duration_seconds_count", kind=kind.value) == n
    total = sum(submitted.values())
    assert value(registry, "urc_command_queue_wait_seconds_count") == total
    assert value(registry, "urc_command_errors_total", kind="evict",
                 error_type="InvalidInputError") == 1  # fmt: skip
    assert value(registry, "urc_service_queued_commands") == 0
    assert cache.counters.match_requests == 33


async def scenario_scrapes_pull_exact_figures(registry: CollectorRegistry) -> None:
    """Attached to a service, a SCRAPE exporter gets no snapshot per batch: each scrape pulls
    one (from the event loop thread directly, from another thread through the loop), and
    the gauges equal the cache's figures at that moment."""
    service = pytest.importorskip("urc.service")
    cache = build()
    exporter = CacheMetrics(registry)
    pushed: list[int] = []
    exporter.on_batch = lambda stats, queued: pushed.append(queued)  # type: ignore[method-assign]
    with anyio.fail_after(30):
        async with service.AsyncUnifiedRadixCache(cache, observer=exporter) as svc:

            async def figures() -> tuple[int, int, int]:
                figs: tuple[int, int, int] = await svc.call(
                    lambda c: (c.evictable_size(), c.protected_size(), c.num_nodes)
                )
                return figs

            def check(figs: tuple[int, int, int]) -> None:
                dev = {"component": "full", "tier": "device"}
                assert value(registry, "urc_cache_evictable_tokens", **dev) == figs[0]
                assert value(registry, "urc_cache_protected_tokens", **dev) == figs[1]
                assert value(registry, "urc_tree_nodes") == figs[2]

            v = await svc.alloc(24)
            await svc.insert(seq(0, 24), v)
            hit = await svc.match(seq(0, 24), lock=True)
            assert hit.lease is not None
            check(await figures())  # scraped on the loop thread
            figs = await figures()
            await anyio.to_thread.run_sync(check, figs)  # scraped from a worker thread

            # Scrapes from another thread while clients keep the actor busy: counters never
            # go backwards and every scrape succeeds.
            seen: list[float] = []
            done = anyio.Event()

            def scraper() -> None:
                while not done.is_set():
                    seen.append(value(registry, "urc_match_requests_total"))

            async def client(k: int) -> None:
                for _ in range(50):
                    await svc.match(seq(0, 8 + k))

            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, scraper)
                async with anyio.create_task_group() as clients:
                    for k in range(8):
                        clients.start_soon(client, k)
                done.set()
            assert seen and seen == sorted(seen)
            await hit.lease.release()
            await anyio.to_thread.run_sync(check, await figures())
        assert pushed == []  # never a snapshot per batch
    assert_gauges_match(registry, cache)  # after close: the snapshot taken at close
    assert_counters_match(registry, cache)
    assert value(registry, "urc_service_queued_commands") == 0


@pytest.mark.anyio
async def test_scrapes_pull_exact_figures_from_the_service(
    anyio_backend: str, registry: CollectorRegistry
) -> None:
    await scenario_scrapes_pull_exact_figures(registry)


@pytest.mark.asyncio
@pytest.mark.parametrize("interval", [0.0, 3600.0])
async def test_direct_mode_through_the_service(
    registry: CollectorRegistry, interval: float
) -> None:
    """DIRECT mode gets a snapshot at most every ``direct_interval_s`` while the service is
    busy, always when it goes idle and at close: exact whenever idle; every command observed."""
    service = pytest.importorskip("urc.service")
    cache = build()
    config = MetricsConfig(mode=ExportMode.DIRECT, direct_interval_s=interval)
    exporter = CacheMetrics(registry, config)
    batches: list[int] = []
    on_batch = exporter.on_batch

    def counting(stats: Any, queued: int) -> None:
        batches.append(queued)
        on_batch(stats, queued)

    exporter.on_batch = counting  # type: ignore[method-assign]
    commands = 0
    with anyio.fail_after(30):
        async with service.AsyncUnifiedRadixCache(cache, observer=exporter) as svc:
            for i in range(5):
                v = await svc.alloc(16)
                await svc.insert(seq(1000 * i, 16), v)
                commands += 2
            async with anyio.create_task_group() as tg:
                for k in range(32):
                    tg.start_soon(svc.match, seq(0, 8 + k % 8))
            commands += 32
            await svc.evict(20)
            commands += 1
            while not svc._idle:  # a condition polled at checkpoints: the actor went idle
                await anyio.lowlevel.checkpoint()
            assert_gauges_match(registry, cache)  # exact once idle, whatever the interval
            assert_counters_match(registry, cache)
            during = len(batches)
    assert_gauges_match(registry, cache)
    assert_counters_match(registry, cache)
    assert sum_samples(registry, "urc_command_duration_seconds_count") == commands
    if interval:
        assert during < commands // 4  # rate-limited: only the first batch and idle flushes
    else:
        assert during >= 12  # one per batch (the 32 matches may share a few)


# ---------------------------------------------------------------------------- storage errors
@pytest.mark.parametrize("mode", [ExportMode.SCRAPE, ExportMode.DIRECT])
def test_storage_errors_are_counted_by_backend_and_operation(mode: ExportMode) -> None:
    """``on_storage_error`` (what a StorageWorker calls per failed storage call) feeds
    ``urc_storage_errors_total{backend,op}``; the exporter is a StorageErrorObserver."""
    registry = CollectorRegistry()
    exporter = CacheMetrics(registry, MetricsConfig(mode=mode))
    assert isinstance(exporter, StorageErrorObserver)
    for op in (StorageOp.PUT, StorageOp.PUT, StorageOp.EXISTS):
        exporter.on_storage_error("valkey", op)
    value = registry.get_sample_value
    assert value("urc_storage_errors_total", {"backend": "valkey", "op": "put"}) == 2
    assert value("urc_storage_errors_total", {"backend": "valkey", "op": "exists"}) == 1
    assert value("urc_storage_errors_total", {"backend": "valkey", "op": "get"}) is None


@pytest.mark.asyncio
async def test_write_back_backups_are_backed_up_tokens_not_transfers_and_help_says_so() -> None:
    """Issue 50 item 11: under write_back ``urc_transfers_total{kind="backup"}`` stayed 0
    while ``urc_backed_up_tokens_total`` grew, and nothing said why.  One definition: a
    transfer is what a background worker runs; backed-up tokens count every path, and the
    help of each counter says which copies it counts."""
    import torch
    from prometheus_client import generate_latest

    import hicache
    from hicache.config import HiCacheConfig
    from urc import CacheConfig, KVShape, build_cache
    from urc.host_protocol import WritePolicy
    from urc.service import AsyncUnifiedRadixCache

    registry = CollectorRegistry()
    exporter = CacheMetrics(registry)
    cache = build_cache(CacheConfig(kv_size=256, kv_shape=KVShape(2, 2, 4, torch.float32)))
    hc = hicache.attach(
        cache,
        HiCacheConfig(write_policy=WritePolicy.WRITE_BACK, host_tokens=512),
        observer=exporter,
    )
    with anyio.fail_after(30):
        async with AsyncUnifiedRadixCache(cache, observer=exporter, workers=hc.workers) as svc:
            for i in range(4):
                await svc.insert(seq(100 * i, 32), await svc.alloc(32))
            await svc.evict(1 << 10)
            await svc.call(lambda c: None)  # one more batch: the exporter saw the eviction
    assert value(registry, "urc_backed_up_tokens_total") == 4 * 32
    assert value(registry, "urc_transfers_total", kind="backup") == 0
    text = generate_latest(registry).decode()
    helps = {line.split()[2]: line for line in text.splitlines() if line.startswith("# HELP urc_")}
    assert "write_back" in helps["urc_transfers_total"]
    assert "every path" in helps["urc_backed_up_tokens_total"]
