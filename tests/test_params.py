"""Parameter and result types (``urc.params``): the hand-built fast paths stay complete."""

from __future__ import annotations

import dataclasses

from urc import CacheConfig, ComponentType, build_cache
from urc.params import DecLockRefParams, DecLockRefResult, EvictResult, IncLockRefResult


def test_to_dec_params_sets_every_field_of_the_release_parameters() -> None:
    receipt = IncLockRefResult(
        delta=4,
        swa_uuid_for_lock=7,
        swa_uuid_for_host_lock=8,
        skip_lock_node_ids={ComponentType.SWA: {3}},
        node_id=11,
        swa_lock_epoch=2,
        full_start_id=5,
    )
    params = receipt.to_dec_params()
    expected = DecLockRefParams(
        swa_uuid_for_lock=7,
        swa_uuid_for_host_lock=8,
        skip_lock_node_ids={ComponentType.SWA: {3}},
        node_id=11,
        skip_swa=False,
        swa_lock_epoch=2,
        full_start_id=5,
    )
    # Every dataclass field is set (an unset slot would raise here) and equal.
    for f in dataclasses.fields(DecLockRefParams):
        assert getattr(params, f.name) == getattr(expected, f.name), f.name
    assert params.skip_lock_node_ids is receipt.skip_lock_node_ids  # shared with the receipt


def test_a_lock_receipt_reads_like_a_default_one() -> None:
    cache = build_cache(CacheConfig(kv_size=64))
    blank = cache.inc_lock_ref(cache.root)  # built field by field on the hot path
    default = IncLockRefResult(delta=0, node_id=cache.root.id)
    names = ("delta", "swa_uuid_for_lock", "swa_uuid_for_host_lock", "swa_lock_epoch")
    for name in (*names, "full_start_id", "node_id", "skip_lock_node_ids"):
        assert getattr(blank, name) == getattr(default, name), name
    blank.swa_lock_epoch = 3  # a component sets a field on one receipt only
    assert cache.inc_lock_ref(cache.root).swa_lock_epoch is None
    cache.sanity_check()
    cache.check_pools()


def test_tuple_new_builds_the_named_tuples_of_the_hot_paths() -> None:
    assert tuple.__new__(DecLockRefResult, (5,)) == DecLockRefResult(5)
    assert tuple.__new__(DecLockRefResult, (5,)).delta == 5
    assert tuple.__new__(EvictResult, [1, 2, 3]) == EvictResult(1, 2, 3)
