"""``KVEventRecorder``: the KV events of one cache, queued and merged as SGLang 0.5.23's
``KVCacheEventRecorder`` (``sglang/srt/mem_cache/events.py``) queues and merges them.

The operations call it where SGLang records (``unified_cache/unified_tree_core.py``):

| operation | event |
|---|---|
| insert: a new device leaf; a host-only node given device slots again | stored, GPU |
| load-back committed | stored, GPU (each node loaded) |
| backup committed (write-through acknowledged, write-back) | stored, CPU_PINNED |
| host insert (from a lower tier) | stored, CPU_PINNED (each node that got a host copy) |
| device leaf evicted: deleted, or demoted to host-only | removed, GPU |
| host-only leaf evicted | removed, CPU_PINNED |
| reset | all blocks cleared |

They reach it through ``state.kv_events`` (``None`` while events are off: one attribute test
per site, nothing else).  A stored node yields one ``BlockStored`` per page, chained by
``parent_block_hash``; a removed node one ``BlockRemoved`` with all its pages.  A new event is
merged into the newest queued one when SGLang's recorder would merge them: removals on the
same medium; stores on the same medium, of the same block size, whose first page continues
the newest one's last page.
"""

from __future__ import annotations

from collections.abc import Callable

from urc.kv_events.block_hash import hash_to_int64, page_digests
from urc.kv_events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    StorageMedium,
)
from urc.node import TreeNode

__all__ = ["KVEventRecorder"]

_GPU = StorageMedium.GPU
_CPU = StorageMedium.CPU


class KVEventRecorder:
    """Queue of KV events for one cache (see the module docstring).

    ``notify`` (optional) is called, from the cache's owner, when the queue goes from empty
    to non-empty: a publisher schedules its drain there (it must not change the tree).
    Page digests are kept on the nodes (``TreeNode.hash_value``, split with the node).
    """

    __slots__ = ("_queue", "notify", "page_size", "recorded")

    def __init__(self, page_size: int, notify: Callable[[], None] | None = None) -> None:
        self.page_size = page_size
        self.notify = notify
        self._queue: list[KVEvent] = []
        #: Events recorded so far (before merging: one per page stored, per node removed).
        self.recorded = 0

    # ------------------------------------------------------------------ the operations' calls
    def stored_on_device(self, node: TreeNode) -> None:
        """``node``'s pages are now on device (a new leaf, an un-evicted or loaded node)."""
        self._stored(node, _GPU)

    def stored_on_host(self, node: TreeNode) -> None:
        """``node``'s pages now have a host copy (backup committed, host insert)."""
        self._stored(node, _CPU)

    def removed_from_device(self, node: TreeNode) -> None:
        """``node``'s device pages are gone (deleted or demoted); call before unlinking it."""
        self._removed(node, _GPU)

    def removed_from_host(self, node: TreeNode) -> None:
        """``node``'s host copy is gone; call before unlinking it."""
        self._removed(node, _CPU)

    def cleared(self) -> None:
        """The cache was reset."""
        self._enqueue(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """Every queued event, oldest first; the queue is left empty."""
        out = self._queue
        self._queue = []
        return out

    def __len__(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ internals
    def digests(self, node: TreeNode) -> list[bytes]:
        """``node``'s page digests, computed (and kept on the nodes) for it and for every
        ancestor that lacks them."""
        hv = node.hash_value
        if hv is not None:
            return hv
        missing: list[TreeNode] = []
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None and walk.hash_value is None:
            missing.append(walk)
            walk = walk.parent
        prior = walk.hash_value[-1] if walk is not None and walk.hash_value else None
        for n in reversed(missing):
            n.hash_value = d = page_digests(n.key, prior, self.page_size)
            if d:
                prior = d[-1]
        assert node.hash_value is not None, f"node {node.id} has no digests"
        return node.hash_value

    def _stored(self, node: TreeNode, medium: StorageMedium) -> None:
        digests = self.digests(node)
        parent = node.parent
        parent_hash: int | None = None
        if parent is not None and parent.parent is not None:
            pd = self.digests(parent)
            if pd:
                parent_hash = hash_to_int64(pd[-1])
        key = node.key
        ps = self.page_size
        for i, d in enumerate(digests):
            page = list(key[i * ps : (i + 1) * ps])
            h = hash_to_int64(d)
            self._enqueue(BlockStored([h], parent_hash, page, len(page), None, medium))
            parent_hash = h
        self.recorded += len(digests)

    def _removed(self, node: TreeNode, medium: StorageMedium) -> None:
        hashes = [hash_to_int64(d) for d in self.digests(node)]
        if hashes:
            self.recorded += 1
            self._enqueue(BlockRemoved(hashes, medium))

    def _enqueue(self, event: KVEvent) -> None:
        queue = self._queue
        if queue:
            tail = queue[-1]
            if type(tail) is BlockRemoved and type(event) is BlockRemoved:
                if tail.medium == event.medium:
                    tail.block_hashes.extend(event.block_hashes)
                    return
            elif (
                type(tail) is BlockStored
                and type(event) is BlockStored
                and tail.medium == event.medium
                and tail.lora_id == event.lora_id
                and tail.block_size == event.block_size
                and tail.cache_salt == event.cache_salt
                and tail.session_id == event.session_id
                and tail.lora_name == event.lora_name
                and tail.block_hashes
                and event.parent_block_hash == tail.block_hashes[-1]
            ):
                tail.block_hashes.extend(event.block_hashes)
                tail.token_ids.extend(event.token_ids)
                return
        else:
            queue.append(event)
            if self.notify is not None:
                self.notify()
            return
        queue.append(event)
