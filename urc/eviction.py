"""Device eviction: ``UnifiedRadixCache.evict`` and the leaf and cascade steps the
components' eviction drivers call.

Who frees what: each component's ``drive_eviction`` picks its victims (Full: device leaves
from its heap; SWA and Mamba: their LRU lists) and calls :func:`evict_device_leaf` for a
leaf or :func:`cascade_evict` for an internal node; both free through the components'
``evict_component`` hooks, by priority, and never free locked data.  A node whose data is
all gone is unlinked (:func:`drop_if_empty`), and so is each ancestor left empty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from urc.errors import InvalidInputError
from urc.host.protocol import WritePolicy
from urc.node import NUM_COMPONENT_TYPES, Tier, TreeNode
from urc.params import EvictParams, EvictResult

if TYPE_CHECKING:
    from urc.cache import UnifiedRadixCache
    from urc.components.base import TreeComponent

__all__ = ["Evictor", "cascade_evict", "drop_if_empty", "evict", "evict_device_leaf"]

_FULL = 0
_DEVICE = Tier.DEVICE
_new_tuple = tuple.__new__
# ``evict`` builds its result straight from the per-component tracker.
assert len(EvictResult._fields) == NUM_COMPONENT_TYPES


def evict(cache: UnifiedRadixCache, params: EvictParams) -> EvictResult:
    """Free at least the requested amounts where possible (whole nodes, so maybe more).

    Never frees locked data.  Returns what was freed per component.
    """
    if params.num_tokens < 0 or params.swa_num_tokens < 0 or params.mamba_num < 0:
        raise InvalidInputError(f"evict amounts must not be negative: {params}")
    tracker = [0] * NUM_COMPONENT_TYPES
    for c in cache.hooks.evict_drivers:
        if c.evict_request(params) > 0:
            c.drive_eviction(params, tracker)
    evicted = cache.counters.evicted
    for k in cache.hooks.device_evict_keys:
        n = tracker[k[0]]
        if n:
            evicted[k] = evicted.get(k, 0) + n
    return _new_tuple(EvictResult, tracker)  # EvictResult(*tracker), minus the call


def evict_device_leaf(cache: UnifiedRadixCache, node: TreeNode, tracker: list[int]) -> bool:
    """Evict every component's device data of the device leaf ``node``.

    Without a host copy the node is deleted (and any ancestors left with no data); with
    one it is demoted to a host-only node.  Under write-back a node without a host copy is
    backed up first; if that fails (host full), nothing happens and False is returned.
    Caller checked that nothing on it is locked.
    """
    fcd = node.full
    assert fcd is not None
    if cache.host_tier is not None and fcd.host_value is None:
        if cache.write_policy is WritePolicy.WRITE_BACK:
            if not cache.write_backup(node):
                return False
        elif node.children:
            return False  # host-only children need this node's structure: keep it
    data = node.data
    for c, ct in cache.hooks.evict_order:
        if data[ct].value is not None:  # type: ignore[union-attr]
            tracker[ct] += c.evict_component(node, _DEVICE)
    if fcd.host_value is not None:
        _demoted(cache, node)
        return True
    if node.children:  # host-only children keep it as structure (write-back)
        drop_if_empty(cache, node, tracker)
        return True
    parent = node.parent
    assert parent is not None
    cache.delete_leaf(node)  # nothing is left on it: no need to ask the components again
    drop_if_empty(cache, parent, tracker)
    return True


def _demoted(cache: UnifiedRadixCache, node: TreeNode) -> None:
    """``node`` just lost its device data but keeps its host copy."""
    if not node.children:
        cache.full.note_host_leaf(node)
    parent = node.parent
    assert parent is not None
    if parent.heap_entry is None and cache.full.is_device_leaf(parent):
        cache.full.note_leaf(parent)


def cascade_evict(
    cache: UnifiedRadixCache, node: TreeNode, trigger: TreeComponent, tracker: list[int]
) -> None:
    """Evict ``trigger``'s device data on ``node`` and, by priority, the data of every
    component with priority <= the trigger's (on a leaf all priorities are 0, so the
    node goes).  Higher-priority data that is locked on a leaf is kept; locked
    lower-priority data is a bug (assertion)."""
    is_leaf = not node.children
    if is_leaf and not node.data[_FULL].lock_ref:  # type: ignore[union-attr]
        if evict_device_leaf(cache, node, tracker):
            return
        is_leaf = False  # it could not go (write-back with a full host): tombstone it
    trigger_prio = trigger.eviction_priority(False)
    p = trigger.eviction_priority(is_leaf)
    for c in reversed(cache.components):
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
    drop_if_empty(cache, node, tracker)


def drop_if_empty(cache: UnifiedRadixCache, node: TreeNode, tracker: list[int]) -> None:
    """Delete ``node`` and then each ancestor that is left childless with no data on any
    tier; a childless ancestor that still has Full on device becomes an evictable leaf."""
    full = cache.full
    while node.parent is not None and not node.children:
        cd = node.data[_FULL]
        assert cd is not None
        if cd.value is not None:
            if node.heap_entry is None and full.is_device_leaf(node):
                full.note_leaf(node)
            return
        if cd.host_value is not None:
            if not node.in_host_heap and cache.full.is_host_leaf(node):
                cache.full.note_host_leaf(node)
            return
        assert cd.lock_ref == 0, f"node {node.id} without data is locked ({cd.lock_ref})"
        for c in reversed(cache.components):
            if c.node_has_component_data(node):
                tracker[c.component_type] += c.evict_component(node, _DEVICE)
        parent = node.parent
        cache.delete_leaf(node)
        node = parent
    if node.parent is not None and node.heap_entry is None and full.is_device_leaf(node):
        full.note_leaf(node)


class Evictor:
    """The cache-wide eviction steps of one cache, as its components call them from their
    eviction drivers and allocators (a component is given this, not the cache)."""

    __slots__ = ("_cache",)

    def __init__(self, cache: UnifiedRadixCache) -> None:
        self._cache = cache

    def evict(self, params: EvictParams, protect: TreeNode | None = None) -> EvictResult:
        """``cache.evict(params)``; ``protect`` (with its ancestors) is locked meanwhile, so
        it survives (its lock is released with its own receipt afterwards)."""
        cache = self._cache
        if protect is None or protect.parent is None:
            return cache.evict(params)
        receipt = cache.inc_lock_ref(protect)
        try:
            return cache.evict(params)
        finally:
            cache.dec_lock_ref(protect, receipt.to_dec_params())

    def evict_device_leaf(self, node: TreeNode, tracker: list[int]) -> bool:
        """:func:`evict_device_leaf` on this cache."""
        return evict_device_leaf(self._cache, node, tracker)

    def cascade(self, node: TreeNode, trigger: TreeComponent, tracker: list[int]) -> None:
        """:func:`cascade_evict` on this cache."""
        cascade_evict(self._cache, node, trigger, tracker)

    def evict_host_leaf(self, node: TreeNode, tracker: list[int]) -> None:
        """Free every host copy of the host-only leaf ``node`` and delete it."""
        self._cache.evict_host_leaf(node, tracker)
