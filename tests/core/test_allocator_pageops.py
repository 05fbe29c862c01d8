"""The allocator's page bookkeeping (``urc.pools.pageops``): the compiled primitives return and
change exactly what their numpy twins do, on random states, strided and out-of-range
indices; and the allocator runs the implementation its cache's ``walk_impl`` names."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from urc import CacheConfig, build_cache
from urc.errors import ConfigError
from urc.fastpath import WalkImpl
from urc.pools.pageops import PYTHON_OPS, PageOps, native_pages_available, select_page_ops

needs_native = pytest.mark.skipif(not native_pages_available(), reason="_pages not built")


@needs_native
@settings(max_examples=200, deadline=None)
@given(
    state=st.lists(st.integers(0, 1), min_size=1, max_size=40),
    idx=st.lists(st.integers(-3, 45), max_size=30),
    step=st.sampled_from([1, 2, 4]),
    shift=st.sampled_from([0, 1, 2]),
    bound=st.sampled_from([-1, 0, 10, 40, 160]),
    stride=st.sampled_from([1, 2]),
    span=st.tuples(st.integers(0, 8), st.integers(0, 40)),
    tensor=st.booleans(),
)
def test_native_count_held_is_the_twin(
    state: list[int],
    idx: list[int],
    step: int,
    shift: int,
    bound: int,
    stride: int,
    span: tuple[int, int],
    tensor: bool,
) -> None:
    native = select_page_ops(WalkImpl.NATIVE)
    s = np.array(state, dtype=np.int8)
    ix = _indices(idx, stride, tensor)
    start, end = _span(ix, span)
    args = (s, ix, start, end, step, shift, bound)
    assert native.count_held(*args) == PYTHON_OPS.count_held(*args)


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    state=st.lists(st.integers(0, 2), min_size=1, max_size=80),
    idx=st.lists(st.integers(-3, 85), max_size=90),
    step=st.sampled_from([1, 2, 4]),
    shift=st.sampled_from([0, 1, 2]),
    bound=st.sampled_from([-1, 0, 10, 80, 320]),
    stride=st.sampled_from([1, 2]),
    span=st.tuples(st.integers(0, 8), st.integers(0, 90)),
    tensor=st.booleans(),
    move=st.sampled_from([(1, 2), (2, 1)]),
    run=st.booleans(),
)
def test_native_claim_is_the_twin(
    state: list[int],
    idx: list[int],
    step: int,
    shift: int,
    bound: int,
    stride: int,
    span: tuple[int, int],
    tensor: bool,
    move: tuple[int, int],
    run: bool,
) -> None:
    """``claim`` (issue 33): the pages move from one state to another, all or none; a page
    out of range is -1, one in another state or named twice -2, nothing changed.  ``run``:
    a run of consecutive pages (the compiled code's block paths) with the drawn indices
    appended."""
    if run:
        idx = list(range(3, 3 + 70)) + idx
        state = state + [move[0]] * 80
    ix = _indices(idx, stride, tensor)
    start, end = _span(ix, (span[0], span[1] + (70 if run else 0)))
    outs = []
    for ops in (select_page_ops(WalkImpl.NATIVE), PYTHON_OPS):
        s = np.array(state, dtype=np.int8)
        res = ops.claim(s, ix, start, end, step, shift, bound, *move)
        outs.append((res, s.tolist()))
    assert outs[0] == outs[1]
    if outs[0][0] < 0:
        assert outs[0][1] == state


@pytest.mark.parametrize("ops", ["python", "native"])
def test_claim_refuses_a_page_named_twice_and_changes_nothing(ops: str) -> None:
    if ops == "native" and not native_pages_available():
        pytest.skip("_pages not built")
    impl = PYTHON_OPS if ops == "python" else select_page_ops(WalkImpl.NATIVE)
    state = np.ones(200, dtype=np.int8)
    for pages in ([5, 6, 5], [*range(100), 50], list(range(64)) * 2):
        ix = np.array(pages, dtype=np.int64)
        assert impl.claim(state, ix, 0, ix.shape[0], 1, 0, -1, 1, 2) == -2
        assert (state == 1).all()
    ix = np.arange(10, 150, dtype=np.int64)
    assert impl.claim(state, ix, 0, 140, 1, 0, -1, 1, 2) == 140
    assert int((state == 2).sum()) == 140


@pytest.mark.parametrize("ops", ["python", "native"])
@pytest.mark.parametrize(
    ("idx", "start", "end", "bound", "held"),
    [
        ([], 0, 0, 0, 0),  # nothing to check: in range whatever the bound
        ([0, 5, 6, 7, 8, 9, 10, 11], 0, 8, 16, 2),  # one below the bound: pages 0 and 1
        ([0, 5, 6, 7, 8, 9, 10, 16], 0, 8, 16, -1),  # an entry at the bound, off a page start
        ([16, 5, 6, 7, 8, 9, 10, 11], 1, 8, 16, 2),  # out of range but before the span
        ([0, -1, 6, 7, 8, 9, 10, 11], 0, 8, 16, -1),  # negative: out of range too
    ],
)
def test_count_held_range_checks_every_entry_of_the_span_at_pages_above_one(
    ops: str, idx: list[int], start: int, end: int, bound: int, held: int
) -> None:
    """Pages of 4 (shift 2): the page lookup reads every 4th entry, the bound all of them."""
    if ops == "native" and not native_pages_available():
        pytest.skip("_pages not built")
    impl = PYTHON_OPS if ops == "python" else select_page_ops(WalkImpl.NATIVE)
    state = np.ones(4, dtype=np.int8)
    ix = np.array(idx, dtype=np.int64)
    assert impl.count_held(state, ix, start, end, 4, 2, bound) == held


def _indices(idx: list[int], stride: int, tensor: bool) -> np.ndarray:
    """Strided views too; of a tensor (what the allocator passes) or not."""
    if tensor:
        return torch.tensor(idx, dtype=torch.int64)[::stride].numpy()
    return np.array(idx, dtype=np.int64)[::stride]


def _span(ix: np.ndarray, span: tuple[int, int]) -> tuple[int, int]:
    n = ix.shape[0]
    start = min(span[0], n)
    return start, max(start, min(span[1], n))


_EXTENT_CAP = 24  # extents the free lists of the twin tests hold


def _release_outcome(
    ops: PageOps,
    op: str,
    state: list[int],
    extents: list[tuple[int, int]],
    ix: np.ndarray,
    span: tuple[int, int, int, int],
    cap: int = _EXTENT_CAP,
) -> tuple[object, list[int], list[tuple[int, int]]]:
    """What ``ops.<op>`` returns (or raises) and leaves: the states and the extents in use
    (above ``nxt`` the extents are free space: the compiled release uses it as scratch)."""
    s = np.array(state, dtype=np.int8)
    lo = np.full(cap, -7, dtype=np.int64)
    length = np.full(cap, -7, dtype=np.int64)
    for e, (a, n) in enumerate(extents):
        lo[e], length[e] = a, n
    try:
        res: object = getattr(ops, op)(s, lo, length, len(extents), ix, *span)
    except (ValueError, IndexError) as e:
        res = type(e)
    nxt = res if isinstance(res, int) and res >= 0 else len(extents)
    return res, s.tolist(), list(zip(lo[:nxt].tolist(), length[:nxt].tolist(), strict=True))


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    state=st.lists(st.integers(0, 2), min_size=1, max_size=40),  # 2: tree-owned
    idx=st.lists(st.integers(-2, 44), max_size=20),
    extents=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), max_size=_EXTENT_CAP),
    step=st.sampled_from([1, 2, 4]),
    shift=st.sampled_from([0, 1, 2]),
    stride=st.sampled_from([1, 2]),
    span=st.tuples(st.integers(0, 8), st.integers(0, 40)),
    tensor=st.booleans(),
    op=st.sampled_from(["release", "release_held"]),
    all_held=st.booleans(),
)
def test_native_release_is_the_twin(
    state: list[int],
    idx: list[int],
    extents: list[tuple[int, int]],
    step: int,
    shift: int,
    stride: int,
    span: tuple[int, int],
    tensor: bool,
    op: str,
    all_held: bool,
) -> None:
    """``release``, and ``release_held`` (-1 and nothing changed unless every page is
    allocated: ``all_held`` makes that case common), onto free lists of up to the capacity
    (overflow raises)."""
    ix = _indices(idx, stride, tensor)
    start, end = _span(ix, span)
    held = [1] * len(state) if all_held else state
    outs = [
        _release_outcome(ops, op, held, extents, ix, (start, end, step, shift))
        for ops in (select_page_ops(WalkImpl.NATIVE), PYTHON_OPS)
    ]
    assert outs[0] == outs[1]


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    state=st.lists(st.integers(0, 1), min_size=1, max_size=40),
    extents=st.lists(st.tuples(st.integers(-2, 44), st.integers(-1, 12)), max_size=8),
    need=st.integers(0, 40),
)
def test_native_take_is_the_twin(
    state: list[int], extents: list[tuple[int, int]], need: int
) -> None:
    """Pages taken from the top extent down (a partly taken one keeps its upper pages);
    too few pages or an extent out of range raises with nothing changed."""
    outs = []
    for ops in (select_page_ops(WalkImpl.NATIVE), PYTHON_OPS):
        s = np.array(state, dtype=np.int8)
        lo = np.array([a for a, _ in extents] + [0], dtype=np.int64)
        length = np.array([n for _, n in extents] + [0], dtype=np.int64)
        out = np.full(need, -7, dtype=np.int64)
        try:
            res: object = ops.take(s, lo, length, len(extents), out)
        except ValueError as e:
            res = type(e)
        outs.append((res, s.tolist(), lo.tolist(), length.tolist(), out.tolist()))
    assert outs[0] == outs[1]
    if outs[0][0] is ValueError:  # nothing changed
        assert outs[0][1] == state and outs[0][4] == [-7] * need


def test_take_after_release_hands_back_what_was_freed_last_first() -> None:
    state = np.zeros(16, dtype=np.int8)
    lo, length = np.zeros(16, dtype=np.int64), np.zeros(16, dtype=np.int64)
    lo[0], length[0] = 0, 16
    out = np.empty(10, dtype=np.int64)
    nxt = PYTHON_OPS.take(state, lo, length, 1, out)
    assert out.tolist() == list(range(10)) and (nxt, lo[0], length[0]) == (1, 10, 6)
    # Freed in two calls, the second continuing the first: one extent [2, 6).
    nxt = PYTHON_OPS.release(state, lo, length, nxt, np.array([2, 3]), 0, 2, 1, 0)
    nxt = PYTHON_OPS.release(state, lo, length, nxt, np.array([4, 5, 8]), 0, 3, 1, 0)
    assert list(zip(lo[:nxt], length[:nxt], strict=True)) == [(10, 6), (2, 4), (8, 1)]
    out = np.empty(3, dtype=np.int64)
    assert PYTHON_OPS.take(state, lo, length, nxt, out) == 2
    assert out.tolist() == [8, 2, 3] and (lo[1], length[1]) == (4, 2)
    assert state.tolist() == [1, 1, 1, 1, 0, 0, 1, 1, 1, 1] + [0] * 6


@needs_native
@settings(max_examples=200, deadline=None)
@given(
    page_map=st.lists(st.integers(-2, 24), min_size=1, max_size=40),
    state=st.lists(st.integers(0, 1), min_size=1, max_size=20),
    # Distinct pages at every shift (the contract: a page repeated is a caller's bug).
    idx=st.lists(st.integers(-2, 44), max_size=20, unique_by=lambda x: x >> 2),
    top=st.integers(0, 30),
    step=st.sampled_from([1, 2, 4]),
    shift=st.sampled_from([0, 1, 2]),
    stride=st.sampled_from([1, 2]),
    span=st.tuples(st.integers(0, 8), st.integers(0, 40)),
    tensor=st.booleans(),
)
def test_native_unmap_is_the_twin(
    page_map: list[int],
    state: list[int],
    idx: list[int],
    top: int,
    step: int,
    shift: int,
    stride: int,
    span: tuple[int, int],
    tensor: bool,
) -> None:
    ix = _indices(idx, stride, tensor)
    start, end = _span(ix, span)
    outs = []
    for ops in (select_page_ops(WalkImpl.NATIVE), PYTHON_OPS):
        m = np.array(page_map, dtype=np.int64)
        s = np.array(state, dtype=np.int8)
        stack = np.full(32, -7, dtype=np.int64)
        try:
            res: object = ops.unmap(m, s, stack, top, ix, start, end, step, shift)
        except (ValueError, IndexError) as e:
            res = type(e)
        outs.append((res, m.tolist(), s.tolist(), stack.tolist()))
    assert outs[0] == outs[1]


def test_unmap_releases_what_the_map_names_once() -> None:
    page_map = np.array([2, -1, 0, 1, -1], dtype=np.int64)
    state = np.ones(3, dtype=np.int8)
    stack = np.zeros(3, dtype=np.int64)
    # Full pages 0, 2 and 1 (tokens 0, 4, 2 at shift 1): 2 and 0 are named, 1 is not.
    top = PYTHON_OPS.unmap(page_map, state, stack, 0, np.array([0, 4, 2]), 0, 3, 1, 1)
    assert top == 2 and stack[:2].tolist() == [2, 0]
    assert page_map.tolist() == [-1, -1, -1, 1, -1] and state.tolist() == [0, 1, 0]
    # Again: the entries are cleared, nothing more is released.
    assert PYTHON_OPS.unmap(page_map, state, stack, 2, np.array([0, 4]), 0, 2, 1, 1) == 2


_RUN_STATE = 200  # pages in the state the run cases index


def _runs() -> list[list[int]]:
    """Blocks of consecutive pages (what values mostly are), up and down, short (the 8-page
    blocks) and long (the 64-page blocks), across the ends of the state and with a broken
    step inside."""
    up, down = list(range(3, 20)), list(range(19, 2, -1))
    long_up, long_down = list(range(5, 160)), list(range(159, 4, -1))
    return [
        up,
        down,
        list(range(-3, 9)),  # through page -1
        list(range(17, 26)),  # past page 24
        list(range(9, -3, -1)),
        [*up[:5], 7, *up[6:]],  # a repeat inside a block
        up[:8] + down[:8],
        [5] * 9,
        long_up,
        long_down,
        list(range(-70, 70)),  # a 64-page block through page -1
        list(range(_RUN_STATE - 100, _RUN_STATE + 40)),  # past the last page
        list(range(70, -70, -1)),
        [*long_up[:40], 7, *long_up[41:]],  # a repeat inside a 64-page block
        [*long_up[:63], long_up[62], *long_up[64:]],  # its last page repeats the one before
        long_up[:64] + long_down[:64],
        long_up[:60] + list(range(100, 110)),  # a run that breaks inside the block
        [5] * 70,
    ]


@needs_native
@pytest.mark.parametrize("pages", _runs())
@pytest.mark.parametrize("held", ["all", "alternate", "all but one"])
def test_native_page_ops_agree_with_the_twin_on_runs(pages: list[int], held: str) -> None:
    native = select_page_ops(WalkImpl.NATIVE)
    state = [1 if held != "alternate" else i % 2 for i in range(_RUN_STATE)]
    if held == "all but one":
        state[100] = 0
    ix = np.array(pages, dtype=np.int64)
    args = (np.array(state, dtype=np.int8), ix, 0, ix.shape[0], 1, 0, -1)
    assert native.count_held(*args) == PYTHON_OPS.count_held(*args)
    for op in ("release", "release_held"):
        for extents in ([], [(_RUN_STATE - 1, 1)], [(pages[0] - 3, 3)]):  # the last continues
            outs = [
                _release_outcome(ops, op, state, extents, ix, (0, ix.shape[0], 1, 0), 400)
                for ops in (native, PYTHON_OPS)
            ]
            assert outs[0] == outs[1], (op, extents)


def test_the_cache_runs_the_page_ops_its_walk_impl_names() -> None:
    for impl in (WalkImpl.PYTHON, WalkImpl.AUTO):
        cache = build_cache(CacheConfig(kv_size=64, walk_impl=impl))
        assert cache.token_to_kv_pool_allocator._ops is select_page_ops(impl)
    assert select_page_ops(WalkImpl.PYTHON) is PYTHON_OPS
    assert (select_page_ops(WalkImpl.AUTO) is not PYTHON_OPS) == native_pages_available()


def test_native_page_ops_without_the_extension_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import urc.pools.pageops as po

    monkeypatch.setattr(po, "_NATIVE", None)
    with pytest.raises(ConfigError, match="not built"):
        select_page_ops(WalkImpl.NATIVE)
    assert select_page_ops(WalkImpl.AUTO) is PYTHON_OPS


@needs_native
def test_native_page_ops_refuse_what_they_cannot_read() -> None:
    native = select_page_ops(WalkImpl.NATIVE)
    s = np.zeros(4, dtype=np.int8)
    for bad in (np.zeros((2, 2), dtype=np.int64), np.zeros(3, dtype=np.int32)):
        with pytest.raises(TypeError):
            native.count_held(s, bad, 0, 3, 1, 0, -1)
