"""TokenSlotAllocator: paged allocation, O(1) frees, double frees are errors."""

from __future__ import annotations

import pytest
import torch

from urc import ConfigError, DoubleFreeError, InvalidIndicesError, InvalidInputError
from urc.pools.allocator import _CAT_SLOTS, MERGE_BATCH, TokenSlotAllocator, merged_groups


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
    with pytest.raises(DoubleFreeError, match="twice"):  # fits the count: caught by the pass
        a.free(torch.cat([x[:2], x[:1]]))
    a.check_consistency()
    assert a.is_allocated(x) and a.available_size() == 4


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


@pytest.mark.parametrize("sizes", [[1, 2, 3], [40_000], [3, 40_000, 5, 30_000, 3_000, 7]])
def test_merged_groups_keep_the_queue_order_and_group_small_spans(sizes: list[int]) -> None:
    spans = [torch.arange(n, dtype=torch.int64) + 10 * i for i, n in enumerate(sizes)]
    groups = list(merged_groups(spans))
    assert torch.equal(torch.cat(groups), torch.cat(spans))
    # Every group but the last reaches the threshold; no group holds a span past it.
    assert all(g.shape[0] >= _CAT_SLOTS for g in groups[:-1])
    assert len(groups) <= len(spans)


@pytest.mark.parametrize("ps", [1, 4])
def test_queued_frees_stay_queued_until_needed_and_merge_in_queue_order(ps: int) -> None:
    n = 64
    a, b = TokenSlotAllocator(n * ps, ps), TokenSlotAllocator(n * ps, ps)
    spans = [a.alloc(ps * k) for k in (1, 3, 2, 5)]
    for s in spans:
        assert s is not None and torch.equal(s, b.alloc(s.shape[0]))  # type: ignore[arg-type]
    for s in spans:
        a.free_owned(s)  # queued: nothing released yet
        b.free(s)  # released now
    assert a.available_size() == b.available_size()
    assert len(a._pending) == len(spans)
    x, y = a.alloc(n * ps), b.alloc(n * ps)  # a merges: its extents are short
    assert x is not None and y is not None and torch.equal(x, y)
    a.check_consistency()


def test_a_full_queue_merges_at_merge_batch_spans() -> None:
    a = TokenSlotAllocator(2 * MERGE_BATCH, 1)
    for _ in range(MERGE_BATCH - 1):
        x = a.alloc(1)
        assert x is not None
        a.free_owned(x)
    assert len(a._pending) == MERGE_BATCH - 1
    x = a.alloc(1)
    assert x is not None
    a.free_owned(x)
    assert not a._pending
    assert a.available_size() == 2 * MERGE_BATCH
    a.check_consistency()


def _allocators() -> list[tuple[str, object]]:
    from urc.pools.mamba import MambaPool
    from urc.pools.swa import SWATokenSlotAllocator

    return [
        ("full", TokenSlotAllocator(64, 16)),
        ("full+swa", SWATokenSlotAllocator(64, 64, 16)),
        ("mamba", MambaPool(8, (1,), (1,))),
    ]


@pytest.mark.parametrize("count", [2.5, "3", None])
def test_a_count_that_is_not_an_int_is_named_as_given(count: object) -> None:
    """``alloc(2.5)`` names 2.5 (it used to name the page count, 1.0), ``alloc("3")`` is an
    InvalidInputError (it used to be a TypeError from a comparison); nothing is taken."""
    for kind, alloc in _allocators():
        before = alloc.available_size()  # type: ignore[attr-defined]
        with pytest.raises(InvalidInputError, match=f"got {count!r} ") as exc:
            alloc.alloc(count)  # type: ignore[attr-defined]
        assert type(count).__name__ in str(exc.value), kind
        assert alloc.available_size() == before, kind  # type: ignore[attr-defined]
