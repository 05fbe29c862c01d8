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
per site, nothing else); on, a site appends one tuple, and hashing waits for ``take``.  A
stored node yields one ``BlockStored`` per page, chained by ``parent_block_hash``; a removed
node one ``BlockRemoved`` with all its pages.  A new event is merged into the newest one when
SGLang's recorder would merge them: removals on the same medium; stores on the same medium,
of the same block size, whose first page continues the newest one's last page.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
_STORED_GPU, _STORED_CPU, _REMOVED_GPU, _REMOVED_CPU, _CLEARED = range(5)


class KVEventRecorder:
    """Queue of KV events for one cache (see the module docstring).

    Recording is O(1) per node: an operation appends the node, its key and its parent as
    they are at that moment; the page hashes (one SHA-256 per page) are computed, and the
    events built and merged, when they are taken.  That is exact because a page's hash
    depends only on the tokens of its path from the root, which a node keeps: a split keeps
    the node as the lower piece (its last page unchanged) and gives it new key lists (the
    recorded one is never mutated), and an unlinked node keeps its parent.

    ``notify`` (optional) is called, from the cache's owner, when the queue goes from empty
    to non-empty: a publisher schedules its drain there (it must not change the tree).
    Page digests are kept on the nodes (``TreeNode.hash_value``, split with the node).
    """

    __slots__ = ("_queue", "notify", "page_size")

    def __init__(self, page_size: int, notify: Callable[[], None] | None = None) -> None:
        self.page_size = page_size
        self.notify = notify
        # (what, node, its key, its parent) per recorded event, oldest first.
        self._queue: list[tuple[int, TreeNode | None, Any, TreeNode | None]] = []

    # ------------------------------------------------------------------ the operations' calls
    def stored_on_device(self, node: TreeNode) -> None:
        """``node``'s pages are now on device (a new leaf, an un-evicted or loaded node)."""
        self._record(_STORED_GPU, node)

    def stored_on_host(self, node: TreeNode) -> None:
        """``node``'s pages now have a host copy (backup committed, host insert)."""
        self._record(_STORED_CPU, node)

    def removed_from_device(self, node: TreeNode) -> None:
        """``node``'s device pages are gone (deleted or demoted)."""
        self._record(_REMOVED_GPU, node)

    def removed_from_host(self, node: TreeNode) -> None:
        """``node``'s host copy is gone."""
        self._record(_REMOVED_CPU, node)

    def cleared(self) -> None:
        """The cache was reset."""
        queue = self._queue
        queue.append((_CLEARED, None, None, None))
        if len(queue) == 1 and self.notify is not None:
            self.notify()

    def _record(self, what: int, node: TreeNode) -> None:
        queue = self._queue
        queue.append((what, node, node.key, node.parent))
        if len(queue) == 1 and self.notify is not None:
            self.notify()

    def __len__(self) -> int:
        """Events recorded and not taken yet (before merging)."""
        return len(self._queue)

    # ------------------------------------------------------------------ taking
    def take(self) -> list[KVEvent]:
        """Every event recorded since the last call, oldest first, merged as SGLang's
        recorder merges them; the queue is left empty.  Computes the page hashes not known
        yet (one SHA-256 per page)."""
        queue = self._queue
        self._queue = []
        out: list[KVEvent] = []
        for what, node, key, parent in queue:
            if what == _CLEARED:
                out.append(AllBlocksCleared())
                continue
            assert node is not None and parent is not None
            digests = self._digests_of(node, key, parent)
            if what <= _STORED_CPU:
                medium = _GPU if what == _STORED_GPU else _CPU
                parent_hash = None
                if parent.parent is not None:
                    parent_hash = hash_to_int64(self.digests(parent)[-1])
                ps = self.page_size
                for i, d in enumerate(digests):
                    page = list(key[i * ps : (i + 1) * ps])
                    h = hash_to_int64(d)
                    _merge(out, BlockStored([h], parent_hash, page, len(page), None, medium))
                    parent_hash = h
            elif digests:
                medium = _GPU if what == _REMOVED_GPU else _CPU
                _merge(out, BlockRemoved([hash_to_int64(d) for d in digests], medium))
        return out

    def digests(self, node: TreeNode) -> list[bytes]:
        """``node``'s page digests as it is now, computed (and kept on the nodes) for it and
        for every ancestor that lacks them."""
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

    def _digests_of(self, node: TreeNode, key: Any, parent: TreeNode) -> list[bytes]:
        """The digests of ``key``'s pages below ``parent`` (``node``'s key and parent when
        the event was recorded)."""
        if node.key is key and node.parent is parent:
            return self.digests(node)  # unchanged since: cached on the node
        prior = self.digests(parent)[-1] if parent.parent is not None else None
        return page_digests(key, prior, self.page_size)


def _merge(out: list[KVEvent], event: BlockStored | BlockRemoved) -> None:
    """Append ``event``, or merge it into the newest event as SGLang's recorder does."""
    if out:
        tail = out[-1]
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
    out.append(event)
