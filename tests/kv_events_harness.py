"""Shared helpers of the KV-event tests: a router's view rebuilt from events, the tree's
truth to compare it with, and scripted caches with a host tier."""

from __future__ import annotations

from dataclasses import dataclass, field

from urc import UnifiedRadixCache
from urc.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    StorageMedium,
    hash_to_int64,
    page_digests,
)
from urc.node import TreeNode

GPU = StorageMedium.GPU
CPU = StorageMedium.CPU


@dataclass
class RouterView:
    """What a cache-aware router knows of one replica: the pages per medium, rebuilt from the
    replica's events alone.  ``apply`` asserts the stream's own contract: a removed page was
    stored on that medium, a stored chain continues a page the router knows on that medium
    (or starts at the root), a page is never stored twice on one medium."""

    pages: dict[StorageMedium, set[int]] = field(default_factory=lambda: {GPU: set(), CPU: set()})
    stored: int = 0
    removed: int = 0

    def apply(self, events: list[KVEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                assert e.medium is not None
                held = self.pages[e.medium]
                assert e.parent_block_hash is None or e.parent_block_hash in held, (
                    f"{e.medium.value} chain continues unknown page {e.parent_block_hash}"
                )
                assert len(e.token_ids) == e.block_size * len(e.block_hashes), e
                for h in e.block_hashes:
                    assert h not in held, f"page {h} stored twice on {e.medium.value}"
                    held.add(h)
                self.stored += len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert e.medium is not None
                held = self.pages[e.medium]
                for h in e.block_hashes:
                    assert h in held, f"page {h} removed from {e.medium.value} but not held"
                    held.remove(h)
                self.removed += len(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                for s in self.pages.values():
                    s.clear()


def path_tokens(node: TreeNode) -> list[int]:
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(list(node.key))
        node = node.parent
    return [t for p in reversed(parts) for t in p]


def tree_pages(cache: UnifiedRadixCache) -> dict[StorageMedium, set[int]]:
    """The pages the tree holds per medium, each hashed from its whole path (not from the
    digests the recorder keeps on the nodes)."""
    out: dict[StorageMedium, set[int]] = {GPU: set(), CPU: set()}
    ps = cache.page_size
    for node in cache.iter_nodes():
        tokens = path_tokens(node)
        mine = page_digests(tokens, None, ps)[-(node.key_len // ps) :]
        hashes = {hash_to_int64(d) for d in mine}
        if node.full.value is not None:
            out[GPU] |= hashes
        if node.full.host_value is not None:
            out[CPU] |= hashes
    return out
