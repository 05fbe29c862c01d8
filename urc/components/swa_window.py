"""The sliding window's rules: where a match may end, and which of a request's SWA slots
have slid out of the window.

A match may end at a node only if the SWA KV of the last ``window`` tokens up to its end is
there: the tokens back to the nearest SWA tombstone above fill a window, or no tombstone is
above (a path from the root without tombstones is always valid).  A request's own tokens::

    [0, cache_protected_len)          tree-owned: never freed here
    [start, new)                      slid out of the window: SWA slots freed, where
                                      start = max(swa_evicted_seqlen, cache_protected_len)
                                      new = floor_page(pre_len - max(window, page_size))
    [new, pre_len)                    still in the window (SWA kept)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from urc.errors import InvalidInputError, InvalidLockError
from urc.fastpath import WalkImpl, choose_impl
from urc.node import ComponentType, TreeNode

if TYPE_CHECKING:
    from urc.components.swa_data import SWAData
    from urc.params import DecLockRefParams
    from urc.pools.req_to_token import ReqToTokenPool
    from urc.pools.swa import SWATokenSlotAllocator
    from urc.request_protocol import CachingRequest

__all__ = [
    "WindowWalks",
    "deepest_window_boundary",
    "free_out_of_window",
    "py_window_locked",
    "py_window_release",
    "select_window_walks",
    "window_match_validator",
    "window_path_validator",
]

_SWA = ComponentType.SWA


def _has_window_kv(node: TreeNode) -> bool:
    return node.data[_SWA].value is not None  # type: ignore[union-attr]


def _has_window_kv_any_tier(node: TreeNode) -> bool:
    # Host pass: a host-only node's SWA host copy is data (a load-back restores it); a node
    # on device counts only with SWA on device (a load-back leaves it as is).
    cd = node.data[_SWA]
    assert cd is not None
    if cd.value is not None:
        return True
    return cd.host_value is not None and node.full.value is None


def window_match_validator(window: int, device_only: bool) -> Callable[[TreeNode], bool]:
    """A walk's validator (called top-down on every node it enters): may the match end at
    this node?"""
    has = _has_window_kv if device_only else _has_window_kv_any_tier
    # Contiguous SWA tokens above (and including) the current node.  Starts satisfied.
    acc = window

    def validate(node: TreeNode) -> bool:
        nonlocal acc
        if not has(node):
            acc = 0
            return False
        acc += node.key_len
        return acc >= window

    return validate


def window_path_validator(
    path: Sequence[TreeNode], window: int, device_only: bool
) -> Callable[[int], bool]:
    """What :func:`window_match_validator` answers at ``path[i - 1]``, asked in any order:
    from the nodes just above it only (at most one window of tokens)."""
    has = _has_window_kv if device_only else _has_window_kv_any_tier

    def validate(i: int) -> bool:
        if not has(path[i - 1]):
            return False
        acc = 0
        for j in range(i - 1, -1, -1):
            node = path[j]
            if not has(node):
                return False
            acc += node.key_len
            if acc >= window:
                return True
        return True

    return validate


def deepest_window_boundary(path: Sequence[TreeNode], window: int, device_only: bool) -> int:
    """The first ``i`` that :func:`window_path_validator` accepts, asked from ``len(path)``
    down (0: none), without building the validator."""
    has = _has_window_kv if device_only else _has_window_kv_any_tier
    for i in range(len(path), 0, -1):
        if not has(path[i - 1]):
            continue
        acc = 0
        for j in range(i - 1, -1, -1):
            node = path[j]
            if not has(node):
                break  # a tombstone within the window above: not a boundary
            acc += node.key_len
            if acc >= window:
                return i
        else:
            return i  # SWA data all the way up from the root
    return 0


def free_out_of_window(
    req: CachingRequest,
    pre_len: int,
    window: int,
    page_size: int,
    req_to_token: ReqToTokenPool,
    allocator: SWATokenSlotAllocator,
) -> int:
    """Free the SWA side of ``req``'s slots in ``[start, new)`` (see the module docstring;
    ``pre_len``: the request's sequence length so far), set ``req.swa_evicted_seqlen =
    new`` and return the SWA tokens freed.  Raises :class:`~urc.errors.InvalidInputError`
    for a request without a ``req_to_token`` row."""
    row = req.req_pool_idx
    if row is None:
        raise InvalidInputError(f"request {req.rid} has no req_pool_idx")
    start = max(req.swa_evicted_seqlen, req.cache_protected_len)
    new = pre_len - max(window, page_size)
    new -= new % page_size
    if new <= start:
        return 0
    freed = allocator.free_swa(req_to_token.read(row, start, new))
    req.swa_evicted_seqlen = new
    return freed


# A node was locked by a receipt (uuid, skip, epoch) iff it holds SWA, was not skipped at
# acquire, and was not recovered after the acquire (restore stamp newer than the epoch).
def py_window_locked(
    node: TreeNode, index: ComponentType, params: DecLockRefParams | None, window: int
) -> list[TreeNode]:
    """The nodes a window-lock release from ``node`` would unlock, bottom-up: the walk up
    counts the nodes the receipt ``params`` (``swa_uuid_for_lock``,
    ``skip_lock_node_ids[index]``, ``swa_lock_epoch``) locked -- SWA data at
    ``node.data[index]`` -- and ends at the node stamped with its uuid (for a receipt without
    one: at the root, before ``window`` tokens).  Changes nothing.

    Raises :class:`InvalidLockError` unless every counted node is locked and the walk ends
    where the receipt says.  The compiled twin is ``urc._native._walk.window_locked``."""
    return _window_walk(node, index, params, window, False)[0]


def py_window_release(
    node: TreeNode, index: ComponentType, params: DecLockRefParams | None, window: int
) -> int:
    """Release the window lock of ``params`` from ``node``: lowers the lock counts of the
    nodes :func:`py_window_locked` names (one pass) and returns the tokens that became
    evictable.  Raises like it, and then first restores the counts it lowered.  The compiled
    twin is ``urc._native._walk.window_release``."""
    return _window_walk(node, index, params, window, True)[1]


def _window_walk(
    node: TreeNode,
    index: ComponentType,
    params: DecLockRefParams | None,
    window: int,
    apply: bool,
) -> tuple[list[TreeNode], int]:
    if params is None:
        uuid = skip = epoch = None
    else:
        uuid = params.swa_uuid_for_lock
        skip = params.skip_lock_node_ids.get(index)
        epoch = params.swa_lock_epoch
    acc = 0
    delta = 0
    locked: list[TreeNode] = []
    try:
        while node.parent is not None:
            cd: SWAData = node.data[index]  # type: ignore[assignment]  # (SWA's new_data)
            if (
                cd.on_device
                and (skip is None or node.id not in skip)
                and (epoch is None or cd.restored <= epoch)
            ):
                if cd.lock_ref <= 0:
                    raise InvalidLockError(f"SWA release on node {node.id}, which is not locked")
                locked.append(node)
                if apply:
                    cd.lock_ref -= 1
                    if cd.lock_ref == 0:
                        delta += node.key_len
                if uuid is None:
                    acc += node.key_len
                    if acc >= window:
                        # Acquire would have stamped a boundary here: no receipt.
                        raise InvalidLockError(
                            "SWA release without the lock's swa_uuid_for_lock receipt"
                        )
                elif cd.uuid == uuid:
                    return locked, delta
            node = node.parent
        if uuid is not None:
            raise InvalidLockError(
                f"SWA lock receipt {uuid} does not name a window boundary on this path"
            )
    except InvalidLockError:
        if apply:
            for n in locked:
                n.data[index].lock_ref += 1  # type: ignore[union-attr]
        raise
    return locked, delta


class WindowWalks(NamedTuple):
    """The window-lock walks of one implementation (:func:`select_window_walks`)."""

    locked: Callable[[TreeNode, ComponentType, DecLockRefParams | None, int], list[TreeNode]]
    release: Callable[[TreeNode, ComponentType, DecLockRefParams | None, int], int]


_PYTHON_WALKS = WindowWalks(py_window_locked, py_window_release)


def _native_window_walks() -> WindowWalks | None:
    try:
        from urc._native._walk import window_locked, window_release
    except ImportError:
        return None
    return WindowWalks(window_locked, window_release)


_NATIVE_WALKS = _native_window_walks()


def select_window_walks(impl: WalkImpl) -> WindowWalks:
    """The window-lock walks ``impl`` names (as :func:`urc.fastpath.select_walk`)."""
    return choose_impl(impl, _NATIVE_WALKS, _PYTHON_WALKS, "urc._native._walk")
