"""Per-component LRU list (one per auxiliary component and tier).

An ``OrderedDict`` keyed by node id gives O(1) insert, remove and promote (``move_to_end`` is
~0.03 µs, cheaper than relinking an intrusive list in Python) and iteration from the LRU end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import islice

from urc.node import TreeNode

__all__ = ["LRUList"]


class LRUList:
    """Nodes in least- to most-recently-used order."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        # id -> node, least recently used first.  Public for hot loops that test membership
        # or move entries themselves (SWA's refresh); the methods keep the same order rules.
        self.entries: OrderedDict[int, TreeNode] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, node: TreeNode) -> bool:
        return node.id in self.entries

    def insert_mru(self, node: TreeNode) -> None:
        """Add ``node`` (or move it) to the most-recently-used end."""
        od = self.entries
        od[node.id] = node
        od.move_to_end(node.id)

    def promote(self, node: TreeNode) -> None:
        """Move ``node`` to the MRU end if it is in the list."""
        if node.id in self.entries:
            self.entries.move_to_end(node.id)

    def remove(self, node: TreeNode) -> None:
        """Remove ``node``; a node not in the list is ignored."""
        self.entries.pop(node.id, None)

    def clear(self) -> None:
        self.entries.clear()

    def first_where(self, accept: Callable[[TreeNode], bool]) -> TreeNode | None:
        """The least-recently-used node for which ``accept`` is true (skips locked nodes)."""
        for node in self.entries.values():
            if accept(node):
                return node
        return None

    def ids(self) -> list[int]:
        """Node ids from LRU to MRU (for tests and sanity checks)."""
        return list(self.entries)

    def oldest(self, n: int) -> list[TreeNode]:
        """Up to ``n`` nodes from the least-recently-used end (a copy: safe to mutate)."""
        return list(islice(self.entries.values(), n))
