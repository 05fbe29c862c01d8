"""Node keys off the cyclic garbage collector.

A node's key is a packed ``array('q')`` of token ids or, for EAGLE bigram keys, a list of
int pairs (``urc.key``) that the tree never mutates (a split slices new ones): it can never
be part of a reference cycle, yet while it is tracked every young key is visited by the next
collections -- a bigram list token by token: for a 16k-token leaf that is 16k visits of cold
objects; with Python's default GC thresholds that about doubled a long-context insert.
:func:`untrack_key` takes a new key off the collector's lists (``urc._native._gckeys``,
built with the other C accelerators; reference counting still frees it).  Without the
extension it does nothing: the keys stay tracked, which costs collection time but changes no
result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["untrack_key"]


def _keep_tracked(key: Any) -> None:
    """The fallback without the C extension: nothing to do."""


def _native_untrack() -> Callable[[Any], None]:
    try:
        from urc._native._gckeys import untrack
    except ImportError:
        return _keep_tracked
    return untrack  # type: ignore[no-any-return]


#: ``untrack_key(key)``: take the key (a list or an ``array``) off the cyclic GC (anything
#: else: no-op).
untrack_key: Callable[[Any], None] = _native_untrack()
