"""Mamba state pool: allocation, explicit free, copy, tree ownership, bad input."""

from __future__ import annotations

import pytest
import torch

from urc.config import CacheConfig, build_pools
from urc.errors import ConfigError, DoubleFreeError, InvalidIndicesError, TreeOwnedSlotError
from urc.node import ComponentType
from urc.pools.indices import INDEX_DEVICE, index_tensor
from urc.pools.mamba import MambaPool
from urc.specs import MambaSpec


def _pool(size: int = 6) -> MambaPool:
    return MambaPool(size, (3, 4), (2, 4, 4))


def _snapshot(pool: MambaPool) -> tuple[int, list[bool], list[bool], torch.Tensor, torch.Tensor]:
    return (
        pool.available_size(),
        [pool.is_allocated(s) for s in range(pool.size)],
        [pool.is_tree_owned(s) for s in range(pool.size)],
        pool.conv.clone(),
        pool.temporal.clone(),
    )


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True)
    )


def test_shapes_from_config() -> None:
    cfg = CacheConfig(
        components=(ComponentType.FULL, MambaSpec(size=5, conv_shape=(2, 3), ssm_shape=(4, 5, 6))),
    )
    pool = build_pools(cfg).mamba
    assert pool is not None
    assert pool.capacity == pool.size == 5
    assert tuple(pool.conv.shape) == (5, 2, 3)
    assert tuple(pool.temporal.shape) == (5, 4, 5, 6)
    assert pool.available_size() == 5
    pool.check_consistency()


@pytest.mark.parametrize(("values", "shape"), [(7, ()), ([7], (1,)), ([3, 1, 2], (3,)), ([], (0,))])
@pytest.mark.parametrize("device", [INDEX_DEVICE, torch.device("meta")])
def test_index_tensor_is_a_new_int64_tensor(
    values: int | list[int], shape: tuple[int, ...], device: torch.device
) -> None:
    a, b = index_tensor(values, device), index_tensor(values, device)
    assert a.dtype == torch.int64 and a.device == device and tuple(a.shape) == shape
    if device.type == "cpu":
        assert a.tolist() == values
        assert a.numel() == 0 or a.data_ptr() != b.data_ptr()  # a caller may write its own


def test_alloc_free_roundtrip() -> None:
    pool = _pool(4)
    a = pool.alloc(3)
    assert a is not None and a.dtype == torch.int64 and a.tolist() == [0, 1, 2]
    assert pool.available_size() == 1
    assert pool.alloc(2) is None  # not enough: nothing taken
    assert pool.available_size() == 1
    one = pool.alloc_slot()
    assert one == 3 and pool.alloc_slot() is None
    pool.free(a[1:])
    pool.free(one)
    assert pool.available_size() == 3
    pool.free(torch.tensor(0))  # a 0-d tensor is one slot
    assert pool.available_size() == 4
    empty = pool.alloc(0)
    assert empty is not None and empty.numel() == 0
    pool.check_consistency()


def test_double_free_is_an_error_and_changes_nothing() -> None:
    pool = _pool()
    a = pool.alloc(2)
    assert a is not None
    pool.free(a[:1])
    before = _snapshot(pool)
    with pytest.raises(DoubleFreeError):
        pool.free(a)  # slot a[0] is free already: a[1] must stay allocated
    with pytest.raises(DoubleFreeError):
        pool.free(torch.tensor([int(a[1]), int(a[1])]))  # the same slot twice in one call
    with pytest.raises(DoubleFreeError):
        pool.free(5)  # never allocated
    assert _same(_snapshot(pool), before)
    pool.check_consistency()


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([6]),
        torch.tensor([-1]),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([0.0]),
        [0],
        True,
    ],
)
def test_bad_indices_are_refused(bad: object) -> None:
    pool = _pool()
    pool.alloc(2)
    before = _snapshot(pool)
    with pytest.raises(InvalidIndicesError):
        pool.free(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidIndicesError):
        pool.copy(0, bad)  # type: ignore[arg-type]
    assert _same(_snapshot(pool), before)


def test_copy_between_slots() -> None:
    pool = _pool()
    a = pool.alloc(4)
    assert a is not None
    pool.conv[0] = 1.5
    pool.temporal[0] = -2.0
    pool.conv[1] = 7.0
    pool.copy(0, 2)
    assert torch.equal(pool.conv[2], pool.conv[0]) and torch.equal(
        pool.temporal[2], pool.temporal[0]
    )
    pool.copy(torch.tensor([0, 1]), torch.tensor([3, 2]))  # pairwise, one torch op per tensor
    assert torch.equal(pool.conv[3], pool.conv[0]) and torch.equal(pool.conv[2], pool.conv[1])
    pool.copy(1, 1)  # a no-op
    before = _snapshot(pool)
    with pytest.raises(InvalidIndicesError):
        pool.copy(5, 0)  # source not allocated
    with pytest.raises(InvalidIndicesError):
        pool.copy(0, 5)  # target not allocated
    with pytest.raises(InvalidIndicesError):
        pool.copy(torch.tensor([0, 1]), torch.tensor([2, 2]))  # repeated target
    with pytest.raises(InvalidIndicesError):
        pool.copy(torch.tensor([0, 1]), torch.tensor([2]))  # count mismatch
    assert _same(_snapshot(pool), before)


def test_tree_owned_slots_cannot_be_freed_or_overwritten() -> None:
    pool = _pool()
    slot = pool.alloc_slot()
    other = pool.alloc_slot()
    assert slot is not None and other is not None
    pool.adopt(slot)
    assert pool.is_tree_owned(slot) and pool.is_allocated(slot)
    before = _snapshot(pool)
    with pytest.raises(TreeOwnedSlotError):
        pool.free(slot)
    with pytest.raises(TreeOwnedSlotError):
        pool.free(torch.tensor([other, slot]))  # all or nothing: `other` stays allocated
    with pytest.raises(TreeOwnedSlotError):
        pool.copy(other, slot)
    with pytest.raises(TreeOwnedSlotError):
        pool.check_held(slot)
    assert _same(_snapshot(pool), before)
    pool.copy(slot, other)  # reading a tree-owned state is fine (copy-on-write)
    pool.release_tree_slot(slot)
    assert not pool.is_allocated(slot)
    assert pool.num_tree_owned() == 0
    pool.check_consistency()


def test_gather_scatter_roundtrip() -> None:
    pool = _pool()
    idx = pool.alloc(2)
    assert idx is not None
    pool.conv[idx] = torch.arange(2 * 12, dtype=torch.float32).reshape(2, 3, 4)
    conv, temporal = pool.gather(idx)
    dst = pool.alloc(2)
    assert dst is not None
    pool.scatter(dst, conv, temporal)
    assert torch.equal(pool.conv[dst], pool.conv[idx])


@pytest.mark.parametrize(
    ("size", "conv", "ssm"), [(0, (2,), (2,)), (4, (), (2,)), (4, (2, 0), (2,)), (4, (2,), (-1,))]
)
def test_bad_config(size: int, conv: tuple[int, ...], ssm: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError):
        MambaPool(size, conv, ssm)


def test_negative_alloc_is_refused() -> None:
    with pytest.raises(InvalidIndicesError):
        _pool().alloc(-1)
