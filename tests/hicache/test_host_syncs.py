"""No hidden host syncs: with the pools on a stand-in accelerator (``device_guard``: device
tensors raise on ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``nonzero``,
``torch.equal``, blocking device-to-host copies, and on mixing host and device tensors), the
cache's index bookkeeping stays on the host and a HiCache round trip -- inserts, matches,
backups, device eviction, load-backs, with SWA and Mamba -- runs without one sync, and
byte-exact.
"""

from __future__ import annotations

import pytest
import torch
from device_guard import DeviceGuard, DeviceMismatchError, DeviceTensor, HostSyncError
from hicache_harness import FULL, SET_IDS, SETS, make
from transfer_harness import round_trip

from hicache.host_layout import HostLayout
from hicache.host_pool import HostPool
from urc import ComponentType
from urc.pools.kv_pool import KVPool, KVShape

ALL_SETS = [(FULL,), *SETS]
ALL_IDS = ["full", *SET_IDS]


def test_the_guard_raises_on_host_syncs_and_mixed_devices() -> None:
    with DeviceGuard() as guard:
        t = torch.arange(4, device=guard.device)
        assert isinstance(t, DeviceTensor) and t.device == guard.device
        for sync in (t.tolist, t[0].item, t.numpy, t.cpu, t.nonzero, lambda: bool(t[0])):
            with pytest.raises(HostSyncError):
                sync()
        with pytest.raises(HostSyncError):
            torch.equal(t, t)
        with pytest.raises(HostSyncError):
            torch.empty(4, dtype=torch.int64).copy_(t)
        with pytest.raises(DeviceMismatchError):
            torch.index_select(t, 0, torch.tensor([0, 1]))
        host = torch.empty(4, dtype=torch.int64)
        host.copy_(t, non_blocking=True)  # a DMA: no sync
        assert isinstance(torch.tensor([1, 2]).to(guard.device, non_blocking=True), DeviceTensor)
        assert guard.syncs_checked > 0
    assert host.tolist() == [0, 1, 2, 3]


LAYOUTS = list(HostLayout)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("comps", ALL_SETS, ids=ALL_IDS)
def test_round_trip_on_a_device_makes_no_host_sync(
    comps: tuple[ComponentType, ...], ps: int, layout: HostLayout
) -> None:
    with DeviceGuard() as guard:
        cache = make(comps, ps, device=str(guard.device), layout=layout)
        assert isinstance(cache.pools.kv_pool.kv, DeviceTensor)  # type: ignore[union-attr]
        pairs = round_trip(cache, ps)
        assert guard.syncs_checked > 0
        value = cache.token_to_kv_pool_allocator.alloc(ps)  # index bookkeeping: on the host
        assert value is not None and not isinstance(value, DeviceTensor)
        assert value.device == torch.device("cpu")
    for before, after in pairs:
        after.assert_equal(before)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("ps", [1, 4])
def test_host_pool_copies_of_a_device_pool_make_no_host_sync(ps: int, layout: HostLayout) -> None:
    with DeviceGuard() as guard:
        kv = KVPool(16 * ps, KVShape(3, 2, 4, torch.float32), guard.device)
        kv.kv.normal_()
        pool = HostPool(kv.slot_buffers(), 8 * ps, ps, layout=layout)
        assert not pool.pinned  # pinned only for a CUDA pool
        # Scattered host pages, device pages in two runs.
        host_idx = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in (5, 1, 7, 2)])
        dev_idx = torch.cat([torch.arange(8 * ps, 10 * ps), torch.arange(2 * ps, 4 * ps)])
        pool.backup(dev_idx, host_idx).wait()
        back = torch.arange(12 * ps, 16 * ps)
        pool.load(host_idx, back).wait()
        moved = kv.kv[:, :, back].clone()
        expected = kv.kv[:, :, dev_idx].clone()
    assert torch.equal(moved, expected)
