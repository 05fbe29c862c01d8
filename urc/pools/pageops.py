"""Page bookkeeping of the token allocator: a compiled implementation and its numpy twin.

:func:`py_count_held`, :func:`py_release`, :func:`py_release_held` (a checked free),
:func:`py_take` (an allocation), :func:`py_claim` (a checked change of owner: the tree adopting
an insert's slots) and :func:`py_unmap` (the SWA side of a free) are the reference;
``urc._native._pages`` (built from ``urc/_native/pages.c`` next to the compiled walk)
computes exactly the same results in one pass over the indices, without the temporaries
and dispatch of several numpy calls (a free or an insert's ownership check was a dozen of
them).  Which set an allocator runs follows the cache's
:attr:`urc.config.CacheConfig.walk_impl` (:func:`select_page_ops`): ``PYTHON`` is the twin
everywhere, ``AUTO`` the compiled code where it was built.

Arrays: ``state`` int8, one entry per page (0 free, 1 held by a caller, 2 owned by the tree;
see :mod:`urc.pools.allocator`); ``lo`` and ``length``
int64, the token allocator's free list: a stack of extents, pages ``[lo[e], lo[e] +
length[e])`` free for ``e < nxt`` (a free pushes the runs of consecutive pages it frees, so
a value costs a few extents, not one entry per page); ``stack`` int64, the SWA page pool's
free pages (``stack[:top]``); ``page_map`` int64 (a page's page in another pool, -1 for
none); ``idx`` int64 token indices, possibly strided, of which ``idx[start:end]`` is used
(slicing a host view is cheaper than slicing a tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from urc.fastpath import WalkImpl, choose_impl

__all__ = [
    "FREE",
    "HELD",
    "PYTHON_OPS",
    "TREE",
    "PageOps",
    "Unmap",
    "native_pages_available",
    "py_claim",
    "py_count_held",
    "py_release",
    "py_release_held",
    "py_take",
    "py_unmap",
    "select_page_ops",
]


#: Page states (``state``): free, held by a caller (allocated to it), owned by the tree.
FREE, HELD, TREE = 0, 1, 2


def _pages(idx: np.ndarray, start: int, end: int, step: int, shift: int) -> np.ndarray:
    h = idx[start:end]
    if step == 1 and shift == 0:
        return h
    return h[::step] >> shift


def py_count_held(
    state: np.ndarray, idx: np.ndarray, start: int, end: int, step: int, shift: int, bound: int
) -> int:
    """How many of the pages ``ix[::step] >> shift`` are allocated (``state != 0``, repeats
    counted each time), where ``ix = idx[start:end]``;
    ``-1`` when one of them is outside ``[0, len(state))`` or, with ``bound >= 0``, when any
    entry of ``ix`` is outside ``[0, bound)``.  Changes nothing."""
    h = _pages(idx, start, end, 1, 0)
    if h.shape[0] == 0:
        return 0
    if bound >= 0 and (int(h.min()) < 0 or int(h.max()) >= bound):
        return -1
    pages = _pages(h, 0, h.shape[0], step, shift)
    if int(pages.min()) < 0 or int(pages.max()) >= state.shape[0]:
        return -1
    return int(np.count_nonzero(state[pages]))


def py_release(
    state: np.ndarray,
    lo: np.ndarray,
    length: np.ndarray,
    nxt: int,
    idx: np.ndarray,
    start: int,
    end: int,
    step: int,
    shift: int,
) -> int:
    """Mark the pages ``idx[start:end][::step] >> shift`` free and push them on the free
    extents (``lo[e]``, ``length[e]``: pages ``[lo, lo + length)``; ``e < nxt`` in use) as
    the maximal runs of consecutive pages they hold, in order, the first joining the top
    extent when it continues it; returns the new ``nxt``.
    No allocation check (the caller did it); ``ValueError`` when the extents would
    overflow, ``IndexError`` for a page outside ``[0, len(state))`` -- raised before anything
    changes (the extents above ``nxt`` are free space: an implementation may use them as
    scratch)."""
    return _release(state, lo, length, nxt, _pages(idx, start, end, step, shift), False)


def py_release_held(
    state: np.ndarray,
    lo: np.ndarray,
    length: np.ndarray,
    nxt: int,
    idx: np.ndarray,
    start: int,
    end: int,
    step: int,
    shift: int,
) -> int:
    """:func:`py_release` of pages that must all be held by a caller (state 1) and distinct:
    ``-1``, with nothing changed, when one is not (``ValueError`` / ``IndexError`` as
    :func:`py_release`, first).  A free checked in one pass over ``idx`` (the compiled twin
    checks each extent as it clears it, and restores the ones it cleared when a later one
    fails: a page repeated in the call is then already free)."""
    return _release(state, lo, length, nxt, _pages(idx, start, end, step, shift), True)


def _release(
    state: np.ndarray,
    lo: np.ndarray,
    length: np.ndarray,
    nxt: int,
    pages: np.ndarray,
    need_held: bool,
) -> int:
    n = pages.shape[0]
    if not n:
        return nxt
    # Extent j is pages[cuts[j]:cuts[j + 1]] (int64 arithmetic, wrapping like the twin's).
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    cuts = np.concatenate(([0], breaks, [n])).astype(np.int64)
    k = cuts.shape[0] - 1
    if nxt + k > lo.shape[0]:
        raise ValueError("release: more extents than the free list holds")
    if int(pages.min()) < 0 or int(pages.max()) >= state.shape[0]:
        raise IndexError("release: page out of range")
    if need_held and (int(np.count_nonzero(state[pages] == HELD)) != n or _repeats(pages)):
        return -1
    state[pages] = 0
    firsts, lens = pages[cuts[:-1]], np.diff(cuts)
    if nxt and int(firsts[0]) == int(lo[nxt - 1] + length[nxt - 1]):
        length[nxt - 1] += lens[0]  # it continues the top extent: one extent
        firsts, lens, k = firsts[1:], lens[1:], k - 1
    lo[nxt : nxt + k] = firsts
    length[nxt : nxt + k] = lens
    return int(nxt + k)


def _repeats(pages: np.ndarray) -> bool:
    """Whether a page occurs twice in ``pages`` (all in range): O(len), one scratch write
    and read per page (an uninitialised scratch the size of the largest page touches only
    the memory of the pages named)."""
    n = pages.shape[0]
    if n < 2:
        return False
    d = np.diff(pages)
    if bool((d > 0).all()) or bool((d < 0).all()):  # monotonic (values mostly are): distinct
        return False
    order = np.arange(n, dtype=np.int64)
    scratch = np.empty(int(pages.max()) + 1, dtype=np.int64)
    scratch[pages] = order  # of a repeated page one position survives, whichever
    return not bool((scratch[pages] == order).all())


def py_claim(
    state: np.ndarray,
    idx: np.ndarray,
    start: int,
    end: int,
    step: int,
    shift: int,
    bound: int,
    frm: int,
    to: int,
) -> int:
    """Move the pages ``ix[::step] >> shift`` (``ix = idx[start:end]``) from state ``frm``
    to state ``to``; returns how many.  ``-1`` when one is outside ``[0, len(state))`` or,
    with ``bound >= 0``, an entry of ``ix`` is outside ``[0, bound)``; ``-2`` when a page
    is not in state ``frm`` or occurs twice -- nothing changed in either case."""
    h = _pages(idx, start, end, 1, 0)
    if h.shape[0] == 0:
        return 0
    if bound >= 0 and (int(h.min()) < 0 or int(h.max()) >= bound):
        return -1
    pages = _pages(h, 0, h.shape[0], step, shift)
    if int(pages.min()) < 0 or int(pages.max()) >= state.shape[0]:
        return -1
    n = pages.shape[0]
    if int(np.count_nonzero(state[pages] == frm)) != n or _repeats(pages):
        return -2
    state[pages] = to
    return int(n)


def py_take(
    state: np.ndarray, lo: np.ndarray, length: np.ndarray, nxt: int, out: np.ndarray
) -> int:
    """Fill ``out`` with free pages taken from the top extent (``nxt - 1``) down, ascending
    within each, and mark them allocated; returns the new ``nxt``.  ``ValueError``, with
    nothing changed, when the extents hold fewer pages than ``len(out)`` or one that the
    take reaches is out of range.  The last extent reached, ``[lo, lo + n)``, when the take
    needs only ``t < n`` of it::

        [lo, lo + t)      handed out (the end of ``out``)
        [lo + t, lo + n)  stays free: the extent becomes (lo + t, n - t), the new top
    """
    need = out.shape[0]
    if need == 0:
        return nxt
    # A valid extent holds a page or more: the take reaches ``need`` extents at most, so only
    # those are read (a long, fragmented free list costs nothing here).
    w = min(nxt, need)
    if w == 0:
        raise ValueError("take: fewer free pages than asked for")
    lens = length[nxt - w : nxt][::-1]  # top first
    starts = lo[nxt - w : nxt][::-1]
    cum = np.cumsum(lens)
    covered = cum >= need
    k = int(np.argmax(covered)) if covered.any() else w - 1  # the last extent reached
    reached_lo, reached_len = starts[: k + 1], lens[: k + 1]
    num_pages = state.shape[0]
    if bool(
        ((reached_lo < 0) | (reached_lo >= num_pages)).any()
        or ((reached_len <= 0) | (reached_len > num_pages - reached_lo)).any()
    ):
        raise ValueError("take: an extent out of range")
    if not covered.any():  # every extent reached, all valid, and too few pages
        raise ValueError("take: fewer free pages than asked for")
    takes = reached_len.copy()
    takes[k] = need - (int(cum[k - 1]) if k else 0)
    firsts = np.cumsum(takes) - takes  # where each extent's pages start in ``out``
    out[:] = np.repeat(reached_lo - firsts, takes) + np.arange(need, dtype=np.int64)
    state[out] = 1
    if takes[k] == reached_len[k]:
        return nxt - k - 1
    lo[nxt - 1 - k] += takes[k]
    length[nxt - 1 - k] -= takes[k]
    return nxt - k


def py_unmap(
    page_map: np.ndarray,
    state: np.ndarray,
    stack: np.ndarray,
    top: int,
    idx: np.ndarray,
    start: int,
    end: int,
    step: int,
    shift: int,
) -> int:
    """Clear the map entries of the pages ``idx[start:end][::step] >> shift`` and release the
    pages of another pool they named: every entry ``s >= 0`` marks page ``s`` free in
    ``state`` and is pushed on ``stack`` above ``top``, in order; returns the new top (entries
    already -1 release nothing, so a page repeated releases once, at its first occurrence).
    ``IndexError`` for a page outside the map or a named page outside ``state``,
    ``ValueError`` when the stack could overflow (every occurrence of a named page counted)
    -- before anything changes."""
    pages = _pages(idx, start, end, step, shift)
    if pages.shape[0] == 0:
        return top
    if int(pages.min()) < 0 or int(pages.max()) >= page_map.shape[0]:
        raise IndexError("unmap: page out of range")
    named = page_map[pages]
    if int(named.min()) < 0:
        named = named[named >= 0]
    n = named.shape[0]
    if n and int(named.max()) >= state.shape[0]:
        raise IndexError("unmap: page out of range")
    if top + n > stack.shape[0]:
        raise ValueError("unmap: more pages than the stack holds")
    if n and _repeats(pages):  # rare (the allocators refuse repeats): first occurrences
        _, first = np.unique(pages, return_index=True)
        pages = pages[np.sort(first)]
        named = page_map[pages]
        named = named[named >= 0]
        n = named.shape[0]
    page_map[pages] = -1
    state[named] = 0
    stack[top : top + n] = named
    return int(top + n)


CountHeld = Callable[[np.ndarray, np.ndarray, int, int, int, int, int], int]
Claim = Callable[[np.ndarray, np.ndarray, int, int, int, int, int, int, int], int]
Release = Callable[[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, int, int, int, int], int]
Take = Callable[[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray], int]
Unmap = Callable[[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, int, int, int, int], int]


class PageOps(NamedTuple):
    """One implementation of the primitives."""

    count_held: CountHeld
    release: Release
    release_held: Release
    take: Take
    unmap: Unmap
    claim: Claim


PYTHON_OPS = PageOps(py_count_held, py_release, py_release_held, py_take, py_unmap, py_claim)


def _native() -> PageOps | None:
    try:
        from urc._native._pages import claim, count_held, release, release_held, take, unmap
    except ImportError:
        return None
    return PageOps(count_held, release, release_held, take, unmap, claim)


_NATIVE = _native()


def native_pages_available() -> bool:
    """Whether the compiled page bookkeeping was built and imports."""
    return _NATIVE is not None


def select_page_ops(impl: WalkImpl) -> PageOps:
    """The primitives ``impl`` names (:class:`~urc.errors.ConfigError` for ``NATIVE`` when the
    extension is absent)."""
    return choose_impl(impl, _NATIVE, PYTHON_OPS, "urc._native._pages")
