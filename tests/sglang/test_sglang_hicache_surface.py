"""The plug-in's HiCache surface (``urc.apps.sglang._hicache``) on a bare cache: write-through
backups are started at a scheduler turn and committed at a later one, never waited for in
between; the idle check SGLang's scheduler makes sees them in flight; a node whose ancestor's
backup is in flight waits for it instead of being dropped.  Copies run on a
``DeferredEngine`` (a copy moves no byte until its completion is waited on), so a commit
before the copy completed would show as wrong host bytes.
"""

from __future__ import annotations

import pytest
import torch
from deferred_engine import DeferredEngine
from hicache_harness import FULL, InFlight, check, insert, make, match, seq, zero_device

from urc import EvictParams, UnifiedRadixCache
from urc.apps.sglang._hicache import HiCacheSurface

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
