"""Page bookkeeping of the token allocator: a compiled implementation and its numpy twin.

:func:`py_count_held`, :func:`py_release`, :func:`py_release_held` (a checked free) and
:func:`py_unmap` (the SWA side of a free) are the reference; ``urc._native._pages`` (built from
``urc/_native/pages.c`` next to the compiled walk) computes exactly the same results in one
pass over the indices, without the temporaries and dispatch of several numpy calls (a free or
an insert's ownership check was a dozen of them).  Which set an allocator runs
follows the cache's :attr:`urc.config.CacheConfig.walk_impl` (:func:`select_page_ops`):
``PYTHON`` is the twin everywhere, ``AUTO`` the compiled code where it was built.

Arrays: ``state`` int8, one entry per page (non-zero = allocated); ``stack`` int64 (the
free-page stack, ``stack[:top]`` free); ``page_map`` int64 (a page's page in another pool,
-1 for none); ``idx`` int64 token indices, possibly strided, of
which ``idx[start:end]`` is used (slicing a host view is cheaper than slicing a tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from urc.fastpath import WalkImpl, choose_impl

__all__ = [
    "PYTHON_OPS",
    "PageOps",
    "Unmap",
    "native_pages_available",
    "py_count_held",
    "py_release",
    "py_release_held",
    "py_unmap",
    "select_page_ops",
]


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
    stack: np.ndarray,
    top: int,
    idx: np.ndarray,
    start: int,
    end: int,
    step: int,
    shift: int,
) -> int:
    """Mark the pages ``idx[start:end][::step] >> shift`` free and push them on ``stack``
    above ``top`` (copies: the caller may reuse ``idx``); returns the new top.  No allocation
    check (the caller did it); ``ValueError`` when the stack would overflow, ``IndexError``
    for a page outside ``[0, len(state))`` -- raised before anything changes (``stack``
    above ``top`` is free space: an implementation may use it as scratch, so ``idx`` must not
    be a view of it)."""
    return _release(state, stack, top, _pages(idx, start, end, step, shift), False)


def py_release_held(
    state: np.ndarray,
    stack: np.ndarray,
    top: int,
    idx: np.ndarray,
    start: int,
    end: int,
    step: int,
    shift: int,
) -> int:
    """:func:`py_release` of pages that must all be allocated: ``-1``, with nothing changed,
    when one is not (``IndexError`` / ``ValueError`` as :func:`py_release`, first).  A free
    checked in one pass over ``idx`` (the compiled twin checks its staged copy)."""
    return _release(state, stack, top, _pages(idx, start, end, step, shift), True)


def _release(
    state: np.ndarray, stack: np.ndarray, top: int, pages: np.ndarray, need_held: bool
) -> int:
    n = pages.shape[0]
    if top + n > stack.shape[0]:
        raise ValueError("release: more pages than the stack holds")
    if n and (int(pages.min()) < 0 or int(pages.max()) >= state.shape[0]):
        raise IndexError("release: page out of range")
    if need_held and int(np.count_nonzero(state[pages])) != n:
        return -1
    state[pages] = 0
    stack[top : top + n] = pages
    return int(top + n)


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
    already -1 release nothing).  The pages must be distinct (the allocator's contract; a
    repeat is a bug that ``check_consistency`` reports).  ``IndexError`` for a page outside
    the map or a named page outside ``state``, ``ValueError`` when the stack would overflow
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
    page_map[pages] = -1
    state[named] = 0
    stack[top : top + n] = named
    return int(top + n)


CountHeld = Callable[[np.ndarray, np.ndarray, int, int, int, int, int], int]
Release = Callable[[np.ndarray, np.ndarray, int, np.ndarray, int, int, int, int], int]
Unmap = Callable[[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, int, int, int, int], int]


class PageOps(NamedTuple):
    """One implementation of the primitives."""

    count_held: CountHeld
    release: Release
    release_held: Release
    unmap: Unmap


PYTHON_OPS = PageOps(py_count_held, py_release, py_release_held, py_unmap)


def _native() -> PageOps | None:
    try:
        from urc._native._pages import count_held, release, release_held, unmap
    except ImportError:
        return None
    return PageOps(count_held, release, release_held, unmap)


_NATIVE = _native()


def native_pages_available() -> bool:
    """Whether the compiled page bookkeeping was built and imports."""
    return _NATIVE is not None


def select_page_ops(impl: WalkImpl) -> PageOps:
    """The primitives ``impl`` names (:class:`~urc.errors.ConfigError` for ``NATIVE`` when the
    extension is absent)."""
    return choose_impl(impl, _NATIVE, PYTHON_OPS, "urc._native._pages")
