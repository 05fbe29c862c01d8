"""TokenSlotAllocator: paged allocation, O(1) frees, double frees are errors."""

from __future__ import annotations

import pytest
import torch

from urc import ConfigError, DoubleFreeError, InvalidIndicesError
from urc.pools.allocator import TokenSlotAllocator


@pytest.mark.parametrize("ps", [1, 2, 4, 16, 64])
def test_alloc_returns_whole_pages_and_free_returns_them(ps: int) -> None:
    a = TokenSlotAllocator(64 * ps, ps)
    x = a.alloc(3 * ps + 1)
    assert x is not None and x.shape[0] == 3 * ps + 1
    assert a.available_size() == 64 * ps - 4 * ps
    assert (x[::ps] % ps == 0).all()
    assert torch.equal(x[: 3 * ps].view(3, ps)[:, 0] // ps * ps, x[: 3 * ps].view(3, ps)[:, 0])
    a.free(x)
    assert a.available_size() == 64 * ps
    a.check_consistency()


@pytest.mark.parametrize("ps", [1, 4])
def test_allocations_never_overlap_and_refill_from_freed_pages(ps: int) -> None:
    a = TokenSlotAllocator(16 * ps, ps)
    chunks = [a.alloc(2 * ps) for _ in range(8)]
    assert a.alloc(1) is None
    seen = torch.cat([c for c in chunks if c is not None])
    assert seen.unique().shape[0] == 16 * ps
    for c in chunks[::2]:
        assert c is not None
        a.free(c)
    again = a.alloc(8 * ps)
    assert again is not None
    assert not set(again.tolist()) & set(
        torch.cat([c for c in chunks[1::2] if c is not None]).tolist()
    )
    a.check_consistency()


@pytest.mark.parametrize("ps", [1, 4])
def test_double_free_and_foreign_indices_are_errors_and_change_nothing(ps: int) -> None:
    a = TokenSlotAllocator(8 * ps, ps)
    x = a.alloc(2 * ps)
    assert x is not None
    a.free(x)
    with pytest.raises(DoubleFreeError):
        a.free(x)
    never = torch.arange(7 * ps, 8 * ps)  # allocated? no: only 2 pages were ever handed out
    with pytest.raises(DoubleFreeError):
        a.free(never)
    with pytest.raises(InvalidIndicesError):
        a.free(torch.tensor([8 * ps]))
    with pytest.raises(InvalidIndicesError):
        a.free(torch.tensor([-1]))
    with pytest.raises(InvalidIndicesError):
        a.free(torch.tensor([0], dtype=torch.int32))
    assert a.available_size() == 8 * ps
    a.check_consistency()


def test_a_slot_repeated_in_one_free_is_caught() -> None:
    a = TokenSlotAllocator(8)
    x = a.alloc(4)
    assert x is not None
    with pytest.raises(DoubleFreeError):  # more pages than are allocated: refused up front
        a.free(torch.cat([x, x, x[:1]]))
    a.check_consistency()
    a.free(torch.cat([x[:2], x[:1]]))  # fits: caught by the consistency check
    with pytest.raises(AssertionError):
        a.check_consistency()


@pytest.mark.parametrize(("size", "ps"), [(10, 3), (10, 4), (0, 1), (-8, 4), (8, 0)])
def test_bad_geometry_is_a_config_error(size: int, ps: int) -> None:
    with pytest.raises(ConfigError):
        TokenSlotAllocator(size, ps)


def test_negative_allocation_is_rejected_and_zero_is_empty() -> None:
    a = TokenSlotAllocator(8)
    with pytest.raises(InvalidIndicesError):
        a.alloc(-1)
    z = a.alloc(0)
    assert z is not None and z.shape[0] == 0


def test_check_owned_validates_without_changing_anything() -> None:
    a = TokenSlotAllocator(8)
    x = a.alloc(3)
    assert x is not None
    a.check_owned(x)
    a.free(x)
    with pytest.raises(InvalidIndicesError):
        a.check_owned(x)
    with pytest.raises(InvalidIndicesError):
        a.check_owned(torch.zeros(2, 2, dtype=torch.int64))
    assert a.available_size() == 8


@pytest.mark.parametrize("ps", [1, 4])
def test_free_owned_counts_at_once_and_refills_an_allocation_that_runs_short(ps: int) -> None:
    a = TokenSlotAllocator(8 * ps, ps)
    x, y = a.alloc(4 * ps), a.alloc(4 * ps)
    assert x is not None and y is not None and a.alloc(1) is None
    a.free_owned(x)
    assert a.available_size() == 4 * ps  # queued frees count as free
    z = a.alloc(4 * ps)  # short on the stack: the queue is merged
    assert z is not None and set(z.tolist()) == set(x.tolist())
    a.check_consistency()


def _queued_span() -> tuple[TokenSlotAllocator, torch.Tensor]:
    """An 8-slot allocator with a 4-slot span allocated and then queued by ``free_owned``."""
    a = TokenSlotAllocator(8, 1)
    x = a.alloc(4)
    assert x is not None
    a.free_owned(x)
    return a, x


def test_checked_free_of_a_queued_page_is_a_double_free() -> None:
    a, x = _queued_span()
    with pytest.raises(DoubleFreeError):
        a.free(x[:1])
    assert not a.is_allocated(x[:1])
    a.check_consistency()


def test_consistency_check_catches_an_owned_page_freed_twice() -> None:
    a, x = _queued_span()
    a.free_owned(x[:2])  # a tree bug: the fast path trusts its caller
    with pytest.raises(AssertionError):
        a.check_consistency()
