"""Per-component LRU lists (one per auxiliary component and tier).

:class:`LRUList`: an ``OrderedDict`` keyed by node id gives O(1) insert, remove and promote
(``move_to_end`` is ~0.03 µs) and iteration from the LRU end; a node can only enter at the
MRU end.  :class:`LinkedLRUList`: an intrusive doubly linked list of the nodes' component data
(:class:`LRULink`), as fast to promote from a hot loop, that can also place a node right
next to another one in O(1) (SGLang 0.5.23's split rule: the new upper part of a split node
goes just before the lower part, which keeps its place).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Protocol

from urc.node import TreeNode

__all__ = ["LRULink", "LRUList", "LinkedLRUList"]


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
        n = len(od)
        od[node.id] = node  # a new entry goes to the MRU end
        if len(od) == n:
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


class LRULink(Protocol):
    """The links one node's component data carries in a :class:`LinkedLRUList` (its class
    declares them as slots, all ``None`` at first).  ``lru_next`` is ``None`` exactly when
    the data is in no list; ``lru_node`` is the node, while linked."""

    lru_prev: LRULink | None
    lru_next: LRULink | None
    lru_node: TreeNode | None


class _Sentinel:
    """The head of a :class:`LinkedLRUList` (links, no node)."""

    __slots__ = ("lru_next", "lru_node", "lru_prev")

    def __init__(self) -> None:
        self.lru_prev: LRULink | None = self
        self.lru_next: LRULink | None = self
        self.lru_node: TreeNode | None = None


class LinkedLRUList:
    """Nodes in least- to most-recently-used order, linked through their component data.

    A circular list around a sentinel: ``sentinel.lru_next`` is the least recently used,
    ``sentinel.lru_prev`` the most recently used.  Every operation is O(1) except
    iteration.  The caller passes each node's :class:`LRULink` (its component data); a link
    is in at most one list.
    """

    __slots__ = ("_len", "sentinel")

    def __init__(self) -> None:
        s: LRULink = _Sentinel()
        # Public for hot loops that promote links themselves (SWA's refresh); they keep the
        # same rules as :meth:`move_to_mru`.
        self.sentinel = s
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @staticmethod
    def is_linked(link: LRULink) -> bool:
        """Whether ``link`` is in a list."""
        return link.lru_next is not None

    def push_mru(self, link: LRULink, node: TreeNode) -> None:
        """Add the unlinked ``link`` of ``node`` at the most-recently-used end."""
        assert link.lru_next is None, f"node {node.id} is already in an LRU list"
        s = self.sentinel
        last = s.lru_prev
        assert last is not None
        link.lru_node = node
        link.lru_prev = last
        link.lru_next = s
        last.lru_next = link
        s.lru_prev = link
        self._len += 1

    def move_to_mru(self, link: LRULink) -> None:
        """Move the linked ``link`` to the most-recently-used end."""
        s = self.sentinel
        last = s.lru_prev
        if last is link:
            return
        p = link.lru_prev
        n = link.lru_next
        assert p is not None and n is not None and last is not None
        p.lru_next = n
        n.lru_prev = p
        link.lru_prev = last
        link.lru_next = s
        last.lru_next = link
        s.lru_prev = link

    def insert_before(self, anchor: LRULink, link: LRULink, node: TreeNode) -> None:
        """Add the unlinked ``link`` of ``node`` just before (older than) the linked
        ``anchor``, which keeps its place."""
        assert link.lru_next is None, f"node {node.id} is already in an LRU list"
        p = anchor.lru_prev
        assert p is not None and anchor.lru_next is not None, "anchor is not in the list"
        link.lru_node = node
        link.lru_prev = p
        link.lru_next = anchor
        p.lru_next = link
        anchor.lru_prev = link
        self._len += 1

    def remove(self, link: LRULink) -> None:
        """Unlink the linked ``link``."""
        p = link.lru_prev
        n = link.lru_next
        assert p is not None and n is not None, "removing a link that is in no list"
        p.lru_next = n
        n.lru_prev = p
        link.lru_prev = link.lru_next = None
        link.lru_node = None
        self._len -= 1

    def clear(self) -> None:
        """Unlink everything."""
        s = self.sentinel
        x = s.lru_next
        while x is not s:
            assert x is not None
            nxt = x.lru_next
            x.lru_prev = x.lru_next = None
            x.lru_node = None
            x = nxt
        s.lru_prev = s.lru_next = s
        self._len = 0

    def oldest(self, n: int) -> list[TreeNode]:
        """Up to ``n`` nodes from the least-recently-used end (a copy: safe to mutate)."""
        out: list[TreeNode] = []
        s = self.sentinel
        x = s.lru_next
        while x is not s and len(out) < n:
            assert x is not None and x.lru_node is not None
            out.append(x.lru_node)
            x = x.lru_next
        return out

    def ids(self) -> list[int]:
        """Node ids from LRU to MRU (for tests and sanity checks)."""
        return [node.id for node in self.oldest(self._len)]
