"""Eviction: ``UnifiedRadixCache.evict`` (device) and ``evict_host`` (host), and the leaf
and cascade steps the components' eviction drivers call.

Who frees what: each component's ``drive_eviction`` picks its victims (Full: device leaves
from its heap; SWA and Mamba: their LRU lists) and calls :func:`evict_device_leaf` for a
leaf or :func:`cascade_evict` for an internal node; both free through the components'
``evict_component`` hooks, by priority, and never free locked data.  A node whose data is
all gone is unlinked (:func:`drop_if_empty`), and so is each ancestor left empty.  Under
write-back a device leaf without a host copy is backed up first, through the state's
``write_back`` hook (set by the host tier: this module never imports the transfers).

Functions of a :class:`~urc.state.CacheState`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from urc.errors import InvalidInputError
from urc.host_protocol import WritePolicy
from urc.locking import dec_lock_ref, inc_lock_ref
from urc.node import FULL_INDEX, NUM_COMPONENT_TYPES, Tier, TreeNode
from urc.params import EvictParams, EvictResult

if TYPE_CHECKING:
    from urc.components.base import TreeComponent
    from urc.state import CacheState

__all__ = [
    "Evictor",
    "alloc_tokens",
    "cascade_evict",
    "drop_if_empty",
    "evict",
    "evict_device_leaf",
    "evict_host",
    "evict_host_leaf",
    "exceeds_pool",
]

# The bench's evict phase: the tier as a module constant (an Enum attribute load costs
# ~0.1 µs) and ``evict``'s result built straight from the per-component tracker.
_DEVICE = Tier.DEVICE
_new_tuple = tuple.__new__
assert len(EvictResult._fields) == NUM_COMPONENT_TYPES


def evict(state: CacheState, params: EvictParams) -> EvictResult:
    """Free at least the requested amounts where possible (whole nodes, so maybe more).

    Never frees locked data.  Returns what was freed per component.
    """
    if params.num_tokens < 0 or params.swa_num_tokens < 0 or params.mamba_num < 0:
        raise InvalidInputError(f"evict amounts must not be negative: {params}")
    tracker = [0] * NUM_COMPONENT_TYPES
    for c in state.hooks.evict_drivers:
        if c.evict_request(params) > 0:
            c.drive_eviction(params, tracker)
    evicted = state.counters.evicted
    for k in state.hooks.device_evict_keys:
        n = tracker[k[0]]
        if n:
            evicted[k] = evicted.get(k, 0) + n
    return _new_tuple(EvictResult, tracker)  # EvictResult(*tracker), minus the call


def evict_device_leaf(state: CacheState, node: TreeNode, tracker: list[int]) -> bool:
    """Evict every component's device data of the device leaf ``node``.

    Without a host copy the node is deleted (and any ancestors left with no data); with
    one it is demoted to a host-only node.  Under write-back a node without a host copy is
    backed up first; if that fails (host full), nothing happens and False is returned.
    Caller checked that nothing on it is locked.
    """
    fcd = node.full
    assert fcd is not None
    if state.host_tier is not None and fcd.host_value is None:
        if state.write_policy is WritePolicy.WRITE_BACK:
            write_back = state.write_back
            if write_back is None or not write_back(node):
                return False
        elif node.children:
            return False  # host-only children need this node's structure: keep it
    data = node.data
    for c, ct in state.hooks.evict_order:
        if data[ct].value is not None:  # type: ignore[union-attr]
            tracker[ct] += c.evict_component(node, _DEVICE)
    if state.kv_events is not None:
        state.kv_events.removed_from_device(node)
    if fcd.host_value is not None:
        _demoted(state, node)
        return True
    if node.children:  # host-only children keep it as structure (write-back)
        drop_if_empty(state, node, tracker)
        return True
    parent = node.parent
    assert parent is not None
    state.tree.unlink(node)  # nothing is left on it: no need to ask the components again
    drop_if_empty(state, parent, tracker)
    return True


def _demoted(state: CacheState, node: TreeNode) -> None:
    """``node`` just lost its device data but keeps its host copy."""
    if not node.children:
        state.full.note_host_leaf(node)
    parent = node.parent
    assert parent is not None
    if parent.heap_entry is None and state.full.is_device_leaf(parent):
        state.full.note_leaf(parent)


def cascade_evict(
    state: CacheState, node: TreeNode, trigger: TreeComponent, tracker: list[int]
) -> None:
    """Evict ``trigger``'s device data on ``node`` and, by priority, the data of every
    component with priority <= the trigger's (on a leaf all priorities are 0, so the
    node goes).  Higher-priority data that is locked on a leaf is kept; locked
    lower-priority data is a bug (assertion)."""
    is_leaf = not node.children
    if is_leaf and not node.full.lock_ref:
        if evict_device_leaf(state, node, tracker):
            return
        is_leaf = False  # it could not go (write-back with a full host): tombstone it
    trigger_prio = trigger.eviction_priority(False)
    p = trigger.eviction_priority(is_leaf)
    for c in reversed(state.components):
        if c.eviction_priority(is_leaf) > p or not c.node_has_component_data(node):
            continue
        cd = node.data[c.component_type]
        assert cd is not None
        if cd.lock_ref:
            assert c.eviction_priority(False) > trigger_prio, (
                f"cascade from {trigger.component_type.name} hit locked "
                f"{c.component_type.name} on node {node.id} (lock {cd.lock_ref})"
            )
            continue
        tracker[c.component_type] += c.evict_component(node, _DEVICE)
    drop_if_empty(state, node, tracker)


def drop_if_empty(state: CacheState, node: TreeNode, tracker: list[int]) -> None:
    """Delete ``node`` and then each ancestor that is left childless with no data on any
    tier; a childless ancestor that still has Full on device becomes an evictable leaf."""
    full = state.full
    while node.parent is not None and not node.children:
        cd = node.data[FULL_INDEX]
        assert cd is not None
        if cd.value is not None:
            if node.heap_entry is None and full.is_device_leaf(node):
                full.note_leaf(node)
            return
        if cd.host_value is not None:
            if not node.in_host_heap and state.full.is_host_leaf(node):
                state.full.note_host_leaf(node)
            return
        assert cd.lock_ref == 0, f"node {node.id} without data is locked ({cd.lock_ref})"
        for c in reversed(state.components):
            if c.node_has_component_data(node):
                tracker[c.component_type] += c.evict_component(node, _DEVICE)
        parent = node.parent
        state.tree.unlink(node)
        node = parent
    if node.parent is not None and node.heap_entry is None and full.is_device_leaf(node):
        full.note_leaf(node)


def alloc_tokens(state: CacheState, num_tokens: int, evict_if_short: bool = True) -> Tensor | None:
    """Full slots for ``num_tokens`` tokens from the cache's allocator; when it is short and
    ``evict_if_short``, evict what every pool lacks (each component adds its own shortfall:
    ``add_alloc_shortfall``, e.g. the SWA side of a paired allocator) and try once more.

    Returns the slots (the caller's), or None when they cannot be had; an eviction it made
    stays made (invisible to callers).  A request larger than the whole pool (see
    :func:`exceeds_pool`) evicts nothing: no eviction could make it fit."""
    allocator = state.token_to_kv_pool_allocator
    out = allocator.alloc(num_tokens)
    if out is None and evict_if_short and not exceeds_pool(state, num_tokens):
        ps = state.page_size
        need = -(-num_tokens // ps) * ps
        params = EvictParams(num_tokens=max(0, need - allocator.available_size()))
        for c in state.components:
            params = c.add_alloc_shortfall(params, num_tokens)
        evict(state, params)
        out = allocator.alloc(num_tokens)
    return out


def exceeds_pool(state: CacheState, num_tokens: int) -> bool:
    """True when ``num_tokens`` tokens (page-rounded) exceed the Full pool's whole size:
    the allocation cannot succeed even with the tree empty."""
    ps = state.page_size
    return -(-num_tokens // ps) * ps > state.token_to_kv_pool_allocator.size


def evict_host(state: CacheState, num_tokens: int) -> int:
    """Free host-only leaves without host locks, oldest first, cascading to ancestors left
    empty, until ``num_tokens`` Full host tokens are freed; returns the tokens freed."""
    if num_tokens <= 0:
        return 0
    tracker = [0] * NUM_COMPONENT_TYPES
    state.full.drive_host_eviction(num_tokens, tracker)
    evicted = state.counters.evicted
    for c in state.components:
        n = tracker[c.component_type]
        if n:
            key = (c.component_type, Tier.HOST)
            evicted[key] = evicted.get(key, 0) + n
    return tracker[FULL_INDEX]


def evict_host_leaf(state: CacheState, node: TreeNode, tracker: list[int]) -> None:
    """Free every host copy of the host-only leaf ``node`` and delete it."""
    for events in state.tier_events:
        events.host_evicted(node)
    if state.kv_events is not None:
        state.kv_events.removed_from_host(node)
    for c in state.components:
        cd = node.data[c.component_type]
        assert cd is not None
        if cd.host_value is not None:
            tracker[c.component_type] += c.evict_host(node)
    parent = node.parent
    assert parent is not None
    state.tree.unlink(node)
    drop_if_empty(state, parent, tracker)


class Evictor:
    """The cache-wide eviction steps of one cache, as its components call them from their
    eviction drivers and allocators (a component is given this, not the cache)."""

    __slots__ = ("_state",)

    def __init__(self, state: CacheState) -> None:
        self._state = state

    def evict(self, params: EvictParams, protect: TreeNode | None = None) -> EvictResult:
        """:func:`evict`; ``protect`` (with its ancestors) is locked meanwhile, so it
        survives (its lock is released with its own receipt afterwards)."""
        state = self._state
        if protect is None or protect.parent is None:
            return evict(state, params)
        receipt = inc_lock_ref(state, protect)
        try:
            return evict(state, params)
        finally:
            dec_lock_ref(state, protect, receipt.to_dec_params())

    def evict_device_leaf(self, node: TreeNode, tracker: list[int]) -> bool:
        """:func:`evict_device_leaf` on this state."""
        return evict_device_leaf(self._state, node, tracker)

    def cascade(self, node: TreeNode, trigger: TreeComponent, tracker: list[int]) -> None:
        """:func:`cascade_evict` on this state."""
        cascade_evict(self._state, node, trigger, tracker)

    def evict_host_leaf(self, node: TreeNode, tracker: list[int]) -> None:
        """:func:`evict_host_leaf` on this cache."""
        evict_host_leaf(self._state, node, tracker)
