"""The plug-in's HiCache surface (``urc.apps.sglang._hicache``) on a bare cache: write-through
backups are started at a scheduler turn and committed at a later one, never waited for in
between; the idle check SGLang's scheduler makes sees them in flight; a node whose ancestor's
backup is in flight waits for it instead of being dropped.  Copies run on a
``DeferredEngine`` (a copy moves no byte until its completion is waited on), so a commit
before the copy completed would show as wrong host bytes.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from deferred_engine import DeferredEngine
from hicache_harness import FULL, InFlight, check, insert, make, match, seq, zero_device

from hicache.config import HiCacheConfig
from hicache.host_tier import attach_hicache
from hicache.transfer_engine import TransferEngine
from urc import CacheConfig, EvictParams, KVShape, UnifiedRadixCache, build_cache
from urc.apps.bench.hicache_scheduler import PerLayerKVPool
from urc.apps.sglang._hicache import HiCacheSurface
from urc.apps.sglang._load_back import LayerLoadCounter, layer_plan
from urc.config import build_pools
from urc.host_protocol import WritePolicy
from urc.node import ComponentType
from urc.params import MatchResult

PAGE_SIZES = [1, 4, 16]


class Scheduler(HiCacheSurface):
    """The surface as the plug-in mixes it in, on a cache no SGLang process owns."""

    def __init__(self, core: UnifiedRadixCache) -> None:
        self.urc = core
        self.host = core.host_tier  # type: ignore[assignment]
        self.init_hicache_surface()

    def idle(self) -> bool:
        """SGLang 0.5.23's ``is_fully_idle`` HiCache terms."""
        idle = len(self.ongoing_write_through) == 0 and len(self.ongoing_load_back) == 0
        if self.enable_storage:
            idle &= len(self.ongoing_prefetch) == 0 and len(self.ongoing_backup) == 0
        return idle

    def flight(self) -> InFlight:
        """The backups in flight (their host slots are held outside the tree)."""
        return InFlight(backups=[t for t, _ in self.ongoing_write_through.values()])

    def check(self) -> None:
        check(self.urc, self.flight())


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_a_backup_is_committed_at_a_later_turn_once_its_copy_completed(ps: int) -> None:
    engine = DeferredEngine()
    core = make((FULL,), ps, engine=engine)
    sched = Scheduler(core)
    tokens = seq(1, 3, ps)
    assert insert(core, tokens)
    node = match(core, tokens).last_device_node
    want = core.pools.kv_pool.kv[:, :, core.path_device_indices(node)].clone()  # type: ignore[union-attr]
    sched.check_hicache_events()  # started, not waited for
    assert engine.pending() == 1 and len(sched.ongoing_write_through) == 1
    assert not sched.idle() and not sched.is_backuped(node)
    assert core.full_protected_size() == len(tokens)  # the chain is pinned while it copies
    sched.check()
    sched.check_hicache_events()  # the copy has not completed: nothing is committed
    assert not sched.is_backuped(node) and len(sched.ongoing_write_through) == 1
    for d in engine.submitted:
        d.wait()
    sched.check_hicache_events()
    assert sched.idle() and sched.is_backuped(node) and core.full_protected_size() == 0
    sched.check()
    # The host copy holds the bytes the device held when the backup started.
    core.evict(EvictParams(num_tokens=10**6))
    zero_device(core)
    hit = match(core, tokens)
    assert hit.host_hit_length == len(tokens) and core.load_back(hit.best_match_node)
    for d in engine.submitted:
        d.wait()
    got = core.pools.kv_pool.kv[:, :, core.path_device_indices(hit.best_match_node)]  # type: ignore[union-attr]
    assert torch.equal(got, want)
    sched.check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_a_child_due_while_its_parents_backup_is_in_flight_is_backed_up_after_it(ps: int) -> None:
    engine = DeferredEngine()
    core = make((FULL,), ps, engine=engine)
    sched = Scheduler(core)
    parent = seq(1, 2, ps)
    assert insert(core, parent)
    sched.check_hicache_events()  # the parent's backup is in flight
    child = parent + seq(500, 2, ps)
    assert insert(core, child, flight=sched.flight())
    sched.check_hicache_events()  # the child waits (its ancestor is in flight)
    assert len(sched.ongoing_write_through) == 1 and core.pending_backups
    sched.check()
    for _ in range(2):
        for d in engine.submitted:
            d.wait()
        sched.check_hicache_events()
    for d in engine.submitted:
        d.wait()
    sched.check_hicache_events()
    assert sched.idle() and not core.pending_backups
    assert sched.is_backuped(match(core, child, sched.flight()).last_device_node)
    sched.check()


def test_wait_for_backups_commits_every_copy_in_flight() -> None:
    engine = DeferredEngine()
    core = make((FULL,), 4, engine=engine)
    sched = Scheduler(core)
    for i in range(3):
        assert insert(core, seq(100 * (i + 1), 2, 4))
    sched.check_hicache_events()
    assert len(sched.ongoing_write_through) == 3
    sched.wait_for_backups()
    assert sched.idle() and engine.pending() == 0 and core.full_protected_size() == 0
    sched.check()


def test_without_a_host_tier_the_surface_is_inert() -> None:
    from urc import CacheConfig, build_cache

    core = build_cache(CacheConfig(page_size=1, kv_size=64))
    sched = Scheduler(core)
    sched.check_hicache_events()
    assert sched.cache_controller is None and sched.idle() and not sched.enable_storage
    assert sched.attach_storage_backend("file")[0] is False
    assert sched.detach_storage_backend()[0] is True
    assert sched.clear_storage_backend() is False


# ---------------------------------------------------------------------- layer-wise load-backs
LAYERS = 4


def layered(ps: int, engine: TransferEngine) -> tuple[UnifiedRadixCache, Scheduler]:
    """A write-back cache over per-layer buffers with layer-wise load-backs on ``engine``."""
    config = CacheConfig(
        components=(FULL,),
        page_size=ps,
        kv_size=64 * ps,
        kv_shape=KVShape(LAYERS, 2, 4, torch.float32),
    )
    pools = build_pools(config)
    pools.kv_pool = PerLayerKVPool(config.kv_size, config.kv_shape)
    core = build_cache(config, pools)
    hc = HiCacheConfig(write_policy=WritePolicy.WRITE_BACK, host_tokens=128 * ps)
    attach_hicache(core, hc, engine)
    sched = Scheduler(core)
    plan = layer_plan([(FULL, i) for i in range(LAYERS)], {FULL: LAYERS})
    sched.enable_layerwise_load_back(LayerLoadCounter(LAYERS), plan)
    return core, sched


def on_host(core: UnifiedRadixCache, tokens: list[int]) -> tuple[MatchResult, torch.Tensor]:
    """Insert ``tokens``, demote them to host, zero the device; returns the host hit and
    the bytes the device held."""
    assert insert(core, tokens)
    node = match(core, tokens).last_device_node
    want = kv_of(core, core.path_device_indices(node)).clone()
    core.evict(EvictParams(num_tokens=10**6))
    zero_device(core)
    hit = match(core, tokens)
    assert hit.host_hit_length == len(tokens)
    return hit, want


def kv_of(core: UnifiedRadixCache, slots: torch.Tensor) -> torch.Tensor:
    return core.pools.kv_pool.kv[:, :, slots]  # type: ignore[union-attr]


def load_params(hit: MatchResult) -> SimpleNamespace:
    """SGLang's ``InitLoadBackParams`` as the plug-in reads it."""
    return SimpleNamespace(
        best_match_node=hit.best_match_node, req=SimpleNamespace(last_node=hit.last_device_node)
    )


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_a_load_back_is_committed_at_once_and_the_forward_waits_layer_by_layer(ps: int) -> None:
    engine = DeferredEngine()
    core, sched = layered(ps, engine)
    tokens = seq(1, 3, ps)
    hit, want = on_host(core, tokens)
    loaded, node = sched.init_load_back(load_params(hit))  # type: ignore[misc]
    # The slots are the tree's now (a request's prefix points at them); the copy is queued.
    assert loaded == len(tokens) and node is hit.best_match_node
    assert match(core, tokens).device_prefix_len == len(tokens)
    slots = core.path_device_indices(node)
    assert engine.pending() == 0 and not sched.idle()
    assert core.full_protected_size() == len(tokens)  # pinned until the copy completed
    sched.check()
    index = sched.ready_to_load_host_cache()  # the new batch's consumer slot
    counter = sched.load_counter
    assert counter is not None and index == 0 and engine.pending() == 1
    assert not counter.done(index) and not bool(kv_of(core, slots).any())
    # The copy runs on another thread; the forward reads layer l once wait_until(l) returns.
    copier = threading.Thread(target=engine.submitted[-1].wait)
    counter.set_consumer(index)
    copier.start()
    for layer in range(LAYERS):
        counter.wait_until(layer)
        assert torch.equal(kv_of(core, slots)[:, layer], want[:, layer]), layer
    copier.join()
    sched.check_hicache_events()  # the copy completed: the pins are released
    assert sched.idle() and core.full_protected_size() == 0
    assert sched.ready_to_load_host_cache() == -1  # nothing queued, nothing in flight
    sched.check()


def test_a_batch_that_starts_no_copy_waits_for_the_one_in_flight() -> None:
    engine = DeferredEngine()
    core, sched = layered(4, engine)
    hit, _ = on_host(core, seq(1, 2, 4))
    sched.init_load_back(load_params(hit))
    index = sched.ready_to_load_host_cache()
    assert sched.ready_to_load_host_cache() == index  # still in flight
    engine.submitted[-1].wait()
    assert sched.ready_to_load_host_cache() == -1
    sched.check_hicache_events()
    assert sched.idle()
    sched.check()


def test_load_backs_queued_by_a_batch_never_formed_start_at_the_next_turn() -> None:
    engine = DeferredEngine()
    core, sched = layered(4, engine)
    hit, want = on_host(core, seq(1, 2, 4))
    _, node = sched.init_load_back(load_params(hit))  # type: ignore[misc]
    sched.check_hicache_events()
    assert engine.pending() == 1 and not sched.idle()
    # Its batch never formed; the next one reads the slots: it waits for that copy.
    assert sched.ready_to_load_host_cache() == 0
    sched.wait_for_backups()  # /flush_cache, shutdown: every copy waited for, pins released
    assert sched.idle() and core.full_protected_size() == 0
    assert torch.equal(kv_of(core, core.path_device_indices(node)), want)
    sched.check()


def test_a_failed_layer_copy_releases_the_forward_and_raises_at_the_turn() -> None:
    core, sched = layered(4, DeferredEngine())
    hit, _ = on_host(core, seq(1, 2, 4))
    sched.init_load_back(load_params(hit))
    sched.load_plan = (((FULL, (99,)),),) * LAYERS  # a buffer the pool does not have
    index = sched.ready_to_load_host_cache()
    counter = sched.load_counter
    assert counter is not None
    with pytest.raises(IndexError):
        sched.wait_for_backups()
    assert counter.done(index)  # no forward waits forever on it


def test_layer_plan_names_each_model_layers_k_and_v_buffers() -> None:
    swa = ComponentType.SWA
    plan = layer_plan([(FULL, 0), (swa, 0), (swa, 1), (FULL, 1)], {FULL: 2, swa: 2})
    assert plan == (
        ((FULL, (0, 2)),),
        ((swa, (0, 2)),),
        ((swa, (1, 3)),),
        ((FULL, (1, 3)),),
    )
