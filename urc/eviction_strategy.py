"""The interface of an eviction strategy (``urc.eviction_policy`` has the policies and the
rules a strategy follows; this module holds the base class alone, so that strategies in
modules of their own, such as ``urc.session_eviction``, and the policy table can import it
without importing each other)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from urc.node import TreeNode
from urc.reuse_hint import ReuseHint

__all__ = ["EvictionStrategy", "HeapKey"]

HeapKey = Callable[[TreeNode], Any]


class EvictionStrategy(ABC):
    """What the Full eviction heaps order by (see the module docstring for the rules)."""

    __slots__ = ()

    # Whether a leaf needs a fresh heap entry whenever it is used (its key may have dropped).
    # False for every policy whose keys only grow.
    rekey_on_release: bool = False
    # Whether :meth:`superseded` is worth asking at each fork (off: no call on the insert path).
    marks_forks: bool = False
    # Whether keys drop on every use, so the heap is re-keyed before each eviction.
    rekey_before_evict: bool = False
    # Whether the strategy keeps ``node.eviction_state`` (then :meth:`note_split` is called).
    keeps_node_state: bool = False
    # Whether :meth:`note_hint` is worth calling (off: a hint costs one attribute test).
    uses_hints: bool = False

    @abstractmethod
    def key_function(self) -> HeapKey:
        """The heap key of a node; smaller keys are evicted first."""

    def superseded(self, parent: TreeNode) -> TreeNode | None:
        """``parent`` just got its second child: a sibling to evict first, if any."""
        return None

    def still_superseded(self, node: TreeNode) -> bool:
        """Whether a node :meth:`superseded` named is still to be evicted first."""
        return False

    def note_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """``lower`` was just split: ``upper`` is its new parent (their keys are final)."""

    def note_hint(self, path: Sequence[TreeNode], hint: ReuseHint) -> Sequence[TreeNode]:
        """A finished request was cached with ``hint`` (:mod:`urc.reuse_hint`); ``path``
        is its inserted path, root excluded.  Returns the nodes whose key dropped (the Full
        component gives those in its heap a fresh entry).  Called only when
        :attr:`uses_hints`."""
        return ()
