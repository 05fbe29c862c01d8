"""Parameter and result types (``urc.params``): the hand-built fast paths stay complete."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from urc import (
    CacheConfig,
    ComponentType,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    build_cache,
)
from urc.errors import InvalidInputError
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


def test_params_accept_attribute_assignment_after_construction_as_sglangs_do() -> None:
    ep = EvictParams()
    ep.mamba_num = 5
    ep.num_tokens = 3
    assert (ep.num_tokens, ep.swa_num_tokens, ep.mamba_num) == (3, 0, 5)
    ip = InsertParams(prev_prefix_len=2, priority=1)  # key and value filled in later
    ip.key = RadixKey([1, 2, 3])
    assert ip.key is not None and ip.value is None
    mp = MatchPrefixParams(key=RadixKey([1]))
    mp.cow_mamba = True
    assert mp.cow_mamba


def test_insert_without_a_key_is_a_typed_error_and_changes_nothing() -> None:
    cache = build_cache(CacheConfig(kv_size=64))
    with pytest.raises(InvalidInputError):
        cache.insert(InsertParams(value=torch.zeros(0, dtype=torch.int64)))
    assert cache.num_nodes == 0
    cache.sanity_check()
    cache.check_pools()


def test_component_evicted_seqlens_is_the_per_component_form_of_swa_evicted_seqlen() -> None:
    p = InsertParams(swa_evicted_seqlen=4)
    assert p.get_evicted_seqlen(ComponentType.SWA) == 4
    assert p.get_evicted_seqlen(ComponentType.MAMBA) == 0
    q = InsertParams(component_evicted_seqlens={ComponentType.SWA: 8})
    assert q.get_evicted_seqlen(ComponentType.SWA) == 8  # the dict wins
    q.set_evicted_seqlen(ComponentType.SWA, 12)
    assert q.get_evicted_seqlen(ComponentType.SWA) == 12 and q.swa_evicted_seqlen == 12
    p.set_evicted_seqlen(ComponentType.MAMBA, 3)
    assert p.component_evicted_seqlens == {ComponentType.MAMBA: 3}
    assert p.get_evicted_seqlen(ComponentType.SWA) == 4


def test_match_result_reports_device_prefix_len() -> None:
    cache = build_cache(CacheConfig(kv_size=64))
    v = cache.token_to_kv_pool_allocator.alloc(5)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5]), value=v))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 9])))
    assert m.device_prefix_len == 3 == m.device_indices.shape[0]
