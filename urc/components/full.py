"""FULL: full-attention KV, the anchor component every node carries.

Eviction takes device leaves in the order of the cache's strategy (``urc.eviction_policy``):
first the leaves it queued to go first, then from a persistent heap.  Keys grow (access
times, hit counts and priorities never decrease; a strategy whose key can drop asks for fresh
entries), so an entry whose node was touched since it was pushed is simply re-pushed with the
new key when it surfaces: an ``evict`` call costs O(k log n) for k freed leaves instead of
rebuilding a heap of every leaf.

Heap entry rules: ``node.heap_entry`` is the entry the heap holds for the node (the last one
pushed; ``None`` when it has none).  A node that stops being an evictable leaf because
it was locked or deleted keeps its entry; the entry is dropped when it surfaces.  A leaf that
gets a child is an internal node for good, or until its subtree goes: its entry is orphaned
(``heap_entry`` cleared, the entry remembered by identity in ``_dead``), so that dropping it
reads no node -- on a pop, or all of them at once when they are a quarter of the heap (one
pass over the entries, cheaper than a pop each: in a large tree the oldest entries, the
first an eviction meets, are mostly such, and each pop would sift a cold heap).  A node that
becomes an evictable leaf is pushed unless it already has an entry (whose key is then stale
and gets re-keyed on pop).

Lock counting: a Full ``lock_ref`` counts the locks taken on the node itself plus its locked
children, not (as in SGLang) every lock below it.  "Locked" (``lock_ref > 0``), the protected
set and the evictable/protected sizes are exactly SGLang's; what changes is cost: a lock walks up
only until it meets a node that was already locked (and a release only until a count stays
above zero), so locking a path whose upper part is shared with live requests is O(new nodes)
instead of O(depth).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from urc.components.base import EvictionSteps, EvictTracker, TreeComponent
from urc.errors import InvalidLockError
from urc.eviction_policy import make_strategy
from urc.node import FULL_INDEX, ComponentData, ComponentType, Tier, TreeNode
from urc.reuse_hint import ReuseHint

if TYPE_CHECKING:
    import torch

    from urc.config import CacheConfig
    from urc.params import DecLockRefParams, EvictParams, IncLockRefResult
    from urc.pools.cache_pools import CachePools
    from urc.tree import Tree

__all__ = ["FullComponent", "check_full_lock"]


def _first_locked(node: TreeNode, start: int) -> TreeNode:
    """The node with id ``start`` (a receipt's ``full_start_id``) at or above ``node``."""
    while node.id != start:
        parent = node.parent
        if parent is None:
            raise InvalidLockError(f"the receipt's lock start {start} is not above it")
        node = parent
    return node


def check_full_lock(node: TreeNode, params: DecLockRefParams | None) -> None:
    """Full's release check (changes nothing): raise :class:`InvalidLockError` unless the
    Full lock that receipt ``params`` releases on ``node`` is held.  Also run by components
    that release before Full and check its lock themselves (``release_implies_full_lock``)."""
    if params is not None and params.full_start_id is not None:
        node = _first_locked(node, params.full_start_id)
    cd = node.full
    assert cd is not None
    if cd.lock_ref <= 0 and node.parent is not None:
        raise InvalidLockError(f"dec_lock_ref on node {node.id}, which is not locked")


class FullComponent(TreeComponent):
    """Full-attention KV: a path lock to the root; evicted leaf by leaf."""

    component_type = ComponentType.FULL

    def __init__(
        self, tree: Tree, pools: CachePools, config: CacheConfig, evictor: EvictionSteps
    ) -> None:
        super().__init__(tree, pools, config, evictor)
        self.allocator = alloc = pools.token_allocator
        # Allocators that track tree ownership take load-back slots over at commit.
        self._adopt = getattr(alloc, "adopt", None)
        self._free_owned = getattr(alloc, "free_owned", alloc.free)
        # What the heaps order by (``urc.eviction_policy``), and the leaves it wants evicted
        # before that order (oldest fork first; checked again when their turn comes).
        self.strategy = make_strategy(
            config.eviction_policy, config.next_use, config.eviction_params
        )
        self._key = self.strategy.key_function()
        self._rekey_on_release = self.strategy.rekey_on_release
        self._marks_forks = self.strategy.marks_forks
        self._rekey_before_evict = self.strategy.rekey_before_evict
        self._keeps_node_state = self.strategy.keeps_node_state
        self._first: deque[TreeNode] = deque()
        self._partial = config.partial_leaf_eviction
        self._heap: list[tuple[Any, int, TreeNode]] = []
        # id() of the orphaned entries still in the heap (see ``note_child``); each is alive
        # (held by the heap) while it is here, so no id in it can name another object.
        self._dead: set[int] = set()
        # Host-only leaves (HiCache), same lazy rules with ``node.in_host_heap``.
        self._host_heap: list[tuple[Any, int, TreeNode]] = []

    def value_len(self, data: ComponentData) -> int:
        v = data.value
        return 0 if v is None else v.shape[0]

    # ------------------------------------------------------------------ eviction
    def eviction_priority(self, is_leaf: bool) -> int:
        return 0 if is_leaf else 2

    def evict_request(self, params: EvictParams) -> int:
        return params.num_tokens

    def note_child(self, parent: TreeNode) -> None:
        """``parent`` just got a child on device: if it was a leaf with a heap entry, that
        entry is dead now.  Once dead entries are half the heap, compact it: one pass over
        the heap costs less than popping each dead entry during an eviction.  A second child
        is a fork: the strategy may queue the branch left behind to be evicted first."""
        n = len(parent.children)
        if n == 2 and self._marks_forks:
            older = self.strategy.superseded(parent)  # a fork: a branch left behind?
            if older is not None:
                self._first.append(older)
                if len(self._first) > self.tree.num_nodes + 64:
                    self._first = deque(x for x in self._first if self._goes_first(x))
        elif n == 1 and parent.heap_entry is not None:
            # Its entry is dead: orphan it (a leaf again, the node gets a fresh one).
            entry = parent.heap_entry
            parent.heap_entry = None
            dead = self._dead
            dead.add(id(entry))
            if len(dead) > 64 and 4 * len(dead) > len(self._heap):
                self._drop_dead()

    def note_leaf(self, node: TreeNode) -> None:
        """Make sure ``node`` (which may have become an evictable leaf) has a heap entry."""
        if node.heap_entry is None:
            entry = node.heap_entry = (self._key(node), node.id, node)
            heapq.heappush(self._heap, entry)
            if len(self._heap) > 2 * self.tree.num_nodes + 64:
                self._compact()

    def _rekey_all(self) -> None:
        """Give every live entry its current key (orphaned and stale entries are dropped) and
        re-heap: for strategies whose keys drop on every use (``rekey_before_evict``)."""
        key = self._key
        keep = []
        for entry in self._heap:
            node = entry[2]
            if node.heap_entry is entry:
                node.heap_entry = fresh = (key(node), entry[1], node)
                keep.append(fresh)
        heapq.heapify(keep)
        self._heap = keep
        self._dead.clear()

    def _compact(self) -> None:
        """Drop entries of nodes that are gone or no longer leaves, and entries a node's
        fresh one superseded (``note_hint``; orphaned ones too): keeps the heap O(nodes)."""
        keep = []
        for entry in self._heap:
            node = entry[2]
            if node.heap_entry is not entry:
                continue  # superseded or orphaned: the node's own entry, if any, is elsewhere
            if self.is_device_leaf(node):
                keep.append(entry)
            else:
                node.heap_entry = None
        heapq.heapify(keep)
        self._heap = keep
        self._dead.clear()  # those kept are ordinary entries now (their node is a leaf)

    def _drop_dead(self) -> None:
        """Drop the orphaned entries (by identity: no node is read) and re-heap the rest."""
        dead = self._dead
        keep = [e for e in self._heap if id(e) not in dead]
        dead.clear()
        heapq.heapify(keep)
        self._heap = keep

    def is_device_leaf(self, node: TreeNode) -> bool:
        """An unlocked node with Full data on device and no child with Full data on device."""
        if node.deleted or node.parent is None:
            return False
        cd = node.full
        if cd.value is None or cd.lock_ref:
            return False
        children = node.children
        if children and self.host_tier is None:
            return False  # without a host tier every child is on device
        for child in children.values():  # noqa: SIM110  (no generator for the usual leaf)
            if child.full.value is not None:
                return False
        return True

    def _goes_first(self, node: TreeNode) -> bool:
        return self.is_device_leaf(node) and self.strategy.still_superseded(node)

    def drive_eviction(self, params: EvictParams, tracker: EvictTracker) -> None:
        target = params.num_tokens
        first = self._first
        while first and tracker[FULL_INDEX] < target:
            node = first.popleft()
            if self._goes_first(node):
                above = node.parent
                self._evict_leaf(node, target - tracker[FULL_INDEX], tracker)
                rest = node.parent  # the head a partial eviction split off, if any
                if rest is not above and rest is not None and self._goes_first(rest):
                    first.appendleft(rest)
        if self._rekey_before_evict:
            self._rekey_all()
        heap = self._heap
        key = self._key
        skipped: dict[int, TreeNode] = {}
        pop = heapq.heappop
        replace = heapq.heapreplace
        dead = self._dead
        while tracker[FULL_INDEX] < target and heap:
            entry = heap[0]
            if dead and id(entry) in dead:  # orphaned: its node is not read
                pop(heap)
                dead.discard(id(entry))
                continue
            k, nid, node = entry
            if nid in skipped or not self.is_device_leaf(node):
                pop(heap)
                node.heap_entry = None
                continue
            nk = key(node)
            if nk != k:
                # Re-keyed in place: one sift, not pop + push.
                entry = node.heap_entry = (nk, nid, node)
                replace(heap, entry)
                continue
            pop(heap)
            node.heap_entry = None
            if not self._evict_leaf(node, target - tracker[FULL_INDEX], tracker):
                skipped[nid] = node  # could not be demoted (host full): keep it this call
        for node in skipped.values():
            if self.is_device_leaf(node):
                self.note_leaf(node)

    def _evict_leaf(self, leaf: TreeNode, need: int, tracker: EvictTracker) -> bool:
        """Evict the device leaf ``leaf`` (only its tail pages with partial-leaf eviction);
        False if it could not go (write-back with a full host)."""
        if self._partial:
            leaf = self._tail_to_evict(leaf, need)
        return self.evictor.evict_device_leaf(leaf, tracker)

    def _tail_to_evict(self, leaf: TreeNode, need: int) -> TreeNode:
        """The part of ``leaf`` to evict when ``need`` more tokens are wanted: the whole leaf,
        or (split off) its last ``ceil(need / page)`` pages.

        ``leaf`` (key ``[0, n)``) after a split at ``k = n - take``:
          ``[0, k)``  a new upper node: keeps its data and ``leaf``'s last access time (an
                      eviction is not a use), and becomes an evictable leaf once the tail
                      is gone;
          ``[k, n)``  ``leaf`` itself, ``take`` tokens: returned, evicted by the caller.
        """
        page = self.tree.page_size
        take = -(-need // page) * page
        n = leaf.key_len
        if take >= n:
            return leaf
        assert (n - take) % page == 0, f"leaf {leaf.id}: {n} tokens, split at {n - take}"
        t = leaf.last_access_time
        upper = self.tree.split(leaf, n - take)
        upper.last_access_time = t
        return leaf

    def note_hint(self, path: Sequence[TreeNode], hint: ReuseHint) -> None:
        """A finished request's ``path`` was inserted with ``hint``: the strategy re-keys
        it; a node whose key dropped gets a fresh heap entry (the old one, larger, is
        dropped when it surfaces), so keys that only grew stay lazily honoured."""
        heap = self._heap
        for node in self.strategy.note_hint(path, hint):
            if node.heap_entry is not None:
                entry = node.heap_entry = (self._key(node), node.id, node)
                heapq.heappush(heap, entry)
        if len(heap) > 2 * self.tree.num_nodes + 64:
            self._compact()  # drops the entries these superseded

    def uses_hook(self, name: str) -> bool:
        return name != "on_insert_end" or self._rekey_on_release

    def on_insert_end(self, path: Sequence[TreeNode]) -> None:
        # Only for strategies whose keys drop on use (Belady): an insert through a leaf that
        # is in the heap is a use (the request may have matched before the leaf existed).
        node = path[-1] if path else None
        if node is not None and node.heap_entry is not None and self.is_device_leaf(node):
            entry = node.heap_entry = (self._key(node), node.id, node)
            heapq.heappush(self._heap, entry)

    # ------------------------------------------------------------------ host eviction
    def note_host_leaf(self, node: TreeNode) -> None:
        """Make sure ``node`` (which may have become an evictable host leaf) has an entry."""
        if not node.in_host_heap:
            node.in_host_heap = True
            heapq.heappush(self._host_heap, (self._key(node), node.id, node))

    def is_host_leaf(self, node: TreeNode) -> bool:
        """A childless node with Full data only on host and no host lock on any component."""
        if node.deleted or node.parent is None or node.children:
            return False
        cd = node.data[FULL_INDEX]
        assert cd is not None
        if cd.value is not None or cd.host_value is None:
            return False
        return not any(d is not None and d.host_lock_ref for d in node.data)

    def drive_host_eviction(self, num_tokens: int, tracker: EvictTracker) -> None:
        """Free host-only leaves, oldest first, until ``tracker[FULL] >= num_tokens``."""
        key = self._key
        if self._rekey_before_evict:
            self._host_heap = [(key(e[2]), e[1], e[2]) for e in self._host_heap]
            heapq.heapify(self._host_heap)
        heap = self._host_heap
        while tracker[FULL_INDEX] < num_tokens and heap:
            k, nid, node = heapq.heappop(heap)
            node.in_host_heap = False
            if not self.is_host_leaf(node):
                continue
            nk = key(node)
            if nk != k:
                node.in_host_heap = True
                heapq.heappush(heap, (nk, nid, node))
                continue
            self.evictor.evict_host_leaf(node, tracker)

    def evict_component(self, node: TreeNode, tier: Tier = Tier.DEVICE) -> int:
        assert tier is Tier.DEVICE, "host tiers are evicted by the HiCache layer"
        cd = node.data[FULL_INDEX]
        assert cd is not None
        value = cd.value
        assert value is not None and cd.lock_ref == 0, (
            f"evicting Full of node {node.id}: value={value is not None} lock={cd.lock_ref}"
        )
        cd.value = None
        self._free_owned(value)
        n = node.key_len  # == len(value) (check_node)
        self.evictable_size -= n
        return n

    def host_mirror_buffers(self) -> list[tuple[torch.Tensor, int]] | None:
        kv = self.pools.kv_pool
        return None if kv is None else kv.slot_buffers()

    def release_load_slots(self, device: torch.Tensor) -> None:
        self._free_owned(device)

    def commit_load(self, pieces: Sequence[TreeNode], device: torch.Tensor) -> None:
        """The default commit; the load's slots a piece takes become the tree's."""
        adopt = self._adopt
        if adopt is not None:
            pos = 0
            for piece in pieces:
                n = piece.key_len
                cd = piece.data[FULL_INDEX]
                assert cd is not None
                if cd.value is None:
                    adopt(device[pos : pos + n])
                pos += n
        super().commit_load(pieces, device)

    # ------------------------------------------------------------------ locks
    def acquire_component_lock(self, node: TreeNode, result: IncLockRefResult) -> None:
        # Host-only nodes at the bottom of the path hold no device data: skip them, and record
        # where the lock starts so release starts there too, even if they are loaded back
        # (and split) meanwhile.  A split keeps the original node as the lower piece, so the
        # recorded id stays the lowest locked node.
        cd = node.full
        assert cd is not None
        if cd.value is None:
            # Full acquires first: raising here changes nothing.  A lease on a host-only
            # node would protect fewer tokens than its depth, and host eviction may delete
            # the node under it (load it back first).
            raise InvalidLockError(f"inc_lock_ref on node {node.id}, which is not on device")
        # Counting rule (see the module docstring): only nodes going 0 -> 1 tell their parent.
        # (The first step is unrolled: most locks stop after it or after one more node.)
        cd.lock_ref += 1
        if cd.lock_ref != 1:
            return  # ``result.delta`` stays 0 (the cache's receipt starts there)
        delta = node.key_len
        node = node.parent  # type: ignore[assignment]
        while node.parent is not None:
            cd = node.full
            cd.lock_ref += 1
            if cd.lock_ref != 1:
                break  # already protected: so is everything above it
            delta += node.key_len
            node = node.parent
        self.evictable_size -= delta
        self.protected_size += delta
        result.delta = delta

    def check_release(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        check_full_lock(node, params)

    def release_component_lock(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        if params is not None and params.full_start_id is not None:
            node = _first_locked(node, params.full_start_id)
            if node.parent is None:
                return  # the lock covered host-only nodes only
        cd = node.full
        assert cd is not None
        if cd.lock_ref <= 0:  # validated here too: Full may be the first (only) release
            raise InvalidLockError(f"dec_lock_ref on node {node.id}, which is not locked")
        cd.lock_ref -= 1
        if cd.lock_ref:
            return  # still protected by other locks or locked children
        # Only the first node can become an evictable leaf: every node above it has it (on
        # device) as a child.  A strategy whose keys drop on use wants a fresh entry.
        if (node.heap_entry is None or self._rekey_on_release) and self.is_device_leaf(node):
            node.heap_entry = None
            self.note_leaf(node)
        delta = node.key_len
        node = node.parent  # type: ignore[assignment]
        while node.parent is not None:
            cd = node.full
            assert cd is not None and cd.lock_ref > 0, f"node {node.id} lock_ref {cd}"
            cd.lock_ref -= 1
            if cd.lock_ref:
                break  # still protected by other locks or locked children
            delta += node.key_len
            node = node.parent
        self.evictable_size += delta
        self.protected_size -= delta

    # ------------------------------------------------------------------ split
    def redistribute_on_node_split(self, new_parent: TreeNode, child: TreeNode) -> None:
        c = child.data[FULL_INDEX]
        p = new_parent.data[FULL_INDEX]
        assert c is not None and p is not None
        k = new_parent.key_len
        if c.value is not None:
            p.value = c.value[:k]
            c.value = c.value[k:]
        if c.host_value is not None:
            p.host_value = c.host_value[:k]
            c.host_value = c.host_value[k:]
        # The new parent holds no lock of its own; its one child counts if it is locked.
        p.lock_ref = 1 if c.lock_ref else 0
        p.host_lock_ref = c.host_lock_ref
        if self._keeps_node_state:
            self.strategy.note_split(new_parent, child)
        if self._rekey_on_release and child.heap_entry is not None and self.is_device_leaf(child):
            # ``child`` now starts further in: a key read from its first page has changed.
            entry = child.heap_entry = (self._key(child), child.id, child)
            heapq.heappush(self._heap, entry)

    # ------------------------------------------------------------------ pools and checks
    def pool_capacity(self) -> int:
        return self.allocator.size

    def pool_available(self) -> int:
        return self.allocator.available_size()

    def check_node(self, node: TreeNode) -> None:
        cd = node.data[FULL_INDEX]
        assert cd is not None
        if cd.value is not None:
            assert cd.value.shape[0] == node.key_len, (
                f"node {node.id}: Full value len {cd.value.shape[0]} != key len {node.key_len}"
            )
            parent = node.parent
            assert parent is not None
            if parent.parent is not None:
                pcd = parent.data[FULL_INDEX]
                assert pcd is not None and pcd.value is not None, (
                    f"node {node.id} has Full on device but its parent {parent.id} does not"
                )
                assert pcd.lock_ref or not cd.lock_ref, (
                    f"child {node.id} is locked ({cd.lock_ref}) but its parent {parent.id} is not"
                )
        else:
            assert cd.lock_ref == 0, f"node {node.id}: Full tombstone with lock {cd.lock_ref}"
        locked_children = sum(1 for ch in node.children.values() if ch.lock_ref)
        assert cd.lock_ref >= locked_children, (
            f"node {node.id}: Full lock {cd.lock_ref} < its {locked_children} locked children"
        )
        if cd.host_value is not None:
            assert cd.host_value.shape[0] == node.key_len, (
                f"node {node.id}: Full host value len {cd.host_value.shape[0]} != {node.key_len}"
            )

    def check_structures(self, nodes: Sequence[TreeNode]) -> None:
        count = getattr(self.allocator, "num_tree_slots", None)
        if count is not None:  # conservation: the tree owns exactly the slots it holds
            owned = count()
            held = self.evictable_size + self.protected_size
            assert owned == held, f"{owned} Full slots tree-owned, the tree holds {held}"
        for node in nodes:
            d_leaf = self.is_device_leaf(node)
            h_leaf = self.is_host_leaf(node)
            assert not (d_leaf and h_leaf), f"node {node.id} is both a device and a host leaf"
            if d_leaf:
                assert node.heap_entry is not None, (
                    f"evictable leaf {node.id} is not in the eviction heap"
                )
            if h_leaf:
                assert node.in_host_heap, f"host leaf {node.id} is not in the host heap"

    def reset(self) -> None:
        super().reset()
        self._heap = []
        self._dead = set()
        self._host_heap = []
        self._first.clear()
