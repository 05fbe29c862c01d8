"""Locks: protect a node's data from eviction, and release that protection.

Functions of a :class:`~urc.state.CacheState`; ``UnifiedRadixCache.inc_lock_ref`` and
``dec_lock_ref`` *are* :func:`inc_lock_ref` and :func:`dec_lock_ref` (class attributes, so a
lock costs no forwarding call).  Each component locks its own data (``acquire_component_lock``
/ ``release_component_lock``): Full the whole path to the root, SWA the nodes inside the
window, Mamba the node itself.  A release validates before it changes anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from urc.errors import InvalidInputError, InvalidLockError
from urc.node import FULL_INDEX, ComponentType, TreeNode
from urc.params import DecLockRefParams, DecLockRefResult, IncLockRefResult

if TYPE_CHECKING:
    from urc.state import CacheState

__all__ = ["dec_lock_ref", "dec_swa_lock_only", "host_lock", "inc_lock_ref"]

# Hot-path constructions (the bench's lock and unlock phases): ``tuple.__new__`` and
# ``object.__new__`` skip the dataclass / NamedTuple constructors' argument parsing.
_new_tuple = tuple.__new__
_new_object = object.__new__
# ``dec_lock_ref`` results by delta: immutable, so one object per delta serves every release
# (a dict hit costs less than building the tuple; the bench's cold Full unlock: ~10%).
_release_results: dict[int, DecLockRefResult] = {}


def _release_result(delta: int) -> DecLockRefResult:
    if len(_release_results) >= 1024:  # many distinct deltas: start over
        _release_results.clear()
    result = _release_results[delta] = _new_tuple(DecLockRefResult, (delta,))
    return result


def inc_lock_ref(state: CacheState, node: TreeNode) -> IncLockRefResult:
    """Protect ``node``'s data from eviction (Full: the whole path to the root).

    Returns the receipt; pass ``receipt.to_dec_params()`` to :func:`dec_lock_ref`.  Raises
    :class:`~urc.errors.InvalidLockError` (nothing locked) for an evicted node.
    """
    # The receipt is built field by field: its constructor's keyword parsing would cost
    # as much as a FULL lock itself.
    result = _new_object(IncLockRefResult)
    result.node_id = node.id
    result.skip_lock_node_ids = {}
    result.delta = 0  # Full sets it when the lock protects new tokens
    if node.deleted or node.parent is None:  # one test on the hot path
        if node.deleted:
            raise InvalidLockError(f"inc_lock_ref on node {node.id}, which was evicted")
        return result
    for acquire in state.acquire_locks:
        acquire(node, result)
    return result


def dec_lock_ref(
    state: CacheState, node: TreeNode, params: DecLockRefParams | None = None
) -> DecLockRefResult:
    """Release a lock taken by :func:`inc_lock_ref` (``params``: its receipt).

    Raises :class:`~urc.errors.InvalidLockError` (nothing released) when the node is not
    locked or the receipt does not fit.  Returns the Full tokens made evictable.
    """
    if node.parent is None:
        return _release_results.get(0) or _release_result(0)
    if node.deleted:
        raise InvalidLockError(f"dec_lock_ref on node {node.id}, which was evicted")
    # Identity first: a receipt holds the node's own id object, and comparing values
    # would read that (cold) int.
    if (
        params is not None
        and params.node_id is not node.id
        and params.node_id is not None
        and params.node_id != node.id
    ):
        raise InvalidLockError(f"receipt for node {params.node_id} used to release node {node.id}")
    for check in state.release_checks:
        check(node, params)
    full = state.full
    before = full.protected_size
    for release in state.release_locks:
        release(node, params)
    delta = before - full.protected_size
    result = _release_results.get(delta)
    return _release_result(delta) if result is None else result


def dec_swa_lock_only(
    state: CacheState, node: TreeNode, params: DecLockRefParams | None = None
) -> None:
    """Early window release: release the SWA part of a lock while Full stays locked.

    For a request whose decode moved past the window.  Components of lower priority than
    SWA release their part of the same receipt with it (``release_lock_early``), so
    ``full >= swa >= mamba`` lock counts hold.  Sets ``params.skip_swa``; the final
    :func:`dec_lock_ref` must carry it (``cache_finished_req`` does when
    ``req.lock.swa_released`` is set).  Raises :class:`~urc.errors.InvalidLockError`
    (nothing released) for a receipt that does not fit or was already early-released,
    :class:`~urc.errors.InvalidInputError` on a cache without SWA.
    """
    swa = state.by_type.get(ComponentType.SWA)
    if swa is None:
        raise InvalidInputError("dec_swa_lock_only on a cache without an SWA component")
    if node.parent is None:
        return
    if node.deleted:
        raise InvalidLockError(f"dec_swa_lock_only on node {node.id}, which was evicted")
    if params is not None:
        if params.node_id is not None and params.node_id != node.id:
            raise InvalidLockError(
                f"receipt for node {params.node_id} used to release node {node.id}"
            )
        if params.skip_swa:
            raise InvalidLockError("the SWA part of this lock was already released")
    swa.release_component_lock(node, params)  # validates before it releases
    prio = swa.eviction_priority(False)
    for c in state.hooks.early_release:
        if c.eviction_priority(False) < prio:
            c.release_lock_early(node, params)
    if params is not None:
        params.skip_swa = True


def host_lock(state: CacheState, node: TreeNode, delta: int) -> None:
    """Add ``delta`` to ``node``'s Full host lock (pins its host copy against host
    eviction).  Raises :class:`~urc.errors.InvalidLockError` (nothing changed) when a
    release finds no host lock."""
    cd = node.data[FULL_INDEX]
    assert cd is not None
    if delta < 0 and cd.host_lock_ref + delta < 0:
        raise InvalidLockError(f"dec_host_lock_ref on node {node.id}, which is not host-locked")
    state.full.host_lock(node, delta)
    if delta < 0 and not node.in_host_heap and state.full.is_host_leaf(node):
        state.full.note_host_leaf(node)
