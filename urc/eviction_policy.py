"""Eviction strategies: the order in which Full leaves leave the device (and the host).

The Full component keeps its evictable leaves in a lazy heap (``urc.components.full``); a
strategy says what that heap orders by and learns from what happens to the tree.  It is the
only place a policy lives, so adding one is a new class here plus an ``EvictionPolicy``
member, and nothing else changes.

The interface is small:

* :meth:`EvictionStrategy.key`: the heap key of a leaf (smallest is evicted first).  It is
  evaluated when the leaf is pushed and again when its entry surfaces, and the entry is
  re-keyed when the two differ.  So a key that grows is always honoured; a key that *drops*
  while the leaf sits in the heap is honoured only if the strategy asks for a fresh entry
  (:attr:`EvictionStrategy.rekey_on_release`, :meth:`EvictionStrategy.superseded`), since
  until then its old, larger key keeps it deeper in the heap than it should be.
* :meth:`EvictionStrategy.superseded`: a node just got its second child; the strategy may
  name the older sibling as superseded (its key dropped: the Full component re-pushes it).

Which strategy the cache uses is ``CacheConfig.eviction_policy``; LRU is the default and is
exactly SGLang's order; BELADY needs ``CacheConfig.next_use``.  The auxiliary components
(SWA, Mamba) keep their LRU lists: they
evict when their own pools run out, and the Full order decides which prefixes stay.

Cost: every key is O(1) (Belady: O(depth) for its oracle, measurement only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from urc.config import EvictionPolicy
from urc.errors import ConfigError
from urc.node import TreeNode

__all__ = [
    "BeladyStrategy",
    "EvictionStrategy",
    "FifoStrategy",
    "LfuStrategy",
    "LruStrategy",
    "NextUseOracle",
    "PriorityStrategy",
    "ForkAwareStrategy",
    "make_strategy",
]


class NextUseOracle(Protocol):
    """Knows the future (for :class:`BeladyStrategy`): the position in the workload of the
    next request that will use ``node``'s first token, or a number past the end if none."""

    def next_use(self, node: TreeNode) -> int: ...


class EvictionStrategy(ABC):
    """What the Full eviction heaps order by (see the module docstring for the rules)."""

    __slots__ = ()

    # Whether a released leaf that is still in the heap needs a fresh entry (its key may
    # have dropped on use).  False for every policy whose keys only grow.
    rekey_on_release: bool = False

    @abstractmethod
    def key(self, node: TreeNode) -> Any:
        """The heap key of ``node`` now; smaller keys are evicted first."""

    def superseded(self, parent: TreeNode) -> TreeNode | None:
        """``parent`` just got its second child: the sibling whose key dropped, if any."""
        return None


class LruStrategy(EvictionStrategy):
    """Least recently used first: SGLang's order."""

    __slots__ = ()

    def key(self, node: TreeNode) -> int:
        return node.last_access_time


class LfuStrategy(EvictionStrategy):
    """Fewest hits first, then least recently used."""

    __slots__ = ()

    def key(self, node: TreeNode) -> tuple[int, int]:
        return (node.hit_count, node.last_access_time)


class FifoStrategy(EvictionStrategy):
    """Oldest inserted first."""

    __slots__ = ()

    def key(self, node: TreeNode) -> int:
        return node.creation_time


class PriorityStrategy(EvictionStrategy):
    """Lowest insert priority first, then least recently used."""

    __slots__ = ()

    def key(self, node: TreeNode) -> tuple[int, int]:
        return (node.priority, node.last_access_time)


class ForkAwareStrategy(EvictionStrategy):
    """LRU, except that a branch the traffic has just left is evicted first.

    When a node that had one child gets a second, the older child is a branch the traffic
    just forked away from: a conversation's next turn diverged from its previous prompt (an
    edited or regenerated message, a trimmed context), an agent re-planned from an earlier
    step.  That leaf is keyed below every other leaf until it is used again; everything else
    is in LRU order.  Only the fork from one child to two marks a branch: the children of a
    widely shared prefix (a system prompt with many conversations below it) are never marked,
    and a marked branch is unmarked as soon as its parent has a third child.

    The signal is read from the tree alone (no counters to tune), costs O(1) per key, and on
    a workload without forks the order is exactly LRU's.  A mark drops a key, so
    :meth:`superseded` names the node and the heap gets a fresh entry.
    """

    __slots__ = ()

    _LEFT = 0
    _LIVE = 1

    def key(self, node: TreeNode) -> tuple[int, int]:
        t = node.last_access_time
        return (self._LEFT if self._is_left(node) else self._LIVE, t)

    @staticmethod
    def _is_left(node: TreeNode) -> bool:
        parent = node.parent
        if parent is None or parent.parent is None or len(parent.children) != 2:
            return False
        return any(s.last_access_time > node.last_access_time for s in parent.children.values())

    def superseded(self, parent: TreeNode) -> TreeNode | None:
        if parent.parent is None or len(parent.children) != 2:
            return None
        older = min(parent.children.values(), key=lambda c: c.last_access_time)
        return older if self._is_left(older) else None


class BeladyStrategy(EvictionStrategy):
    """Furthest next use first: the offline optimum's order (Belady's MIN), for measurement.

    Needs the future (a :class:`NextUseOracle`, e.g. built by ``urc replay`` from the whole
    trace); no server has one.  A leaf's next use moves later when it is used, so its key
    drops then: every release re-pushes it.
    """

    __slots__ = ("_oracle",)

    rekey_on_release = True

    def __init__(self, oracle: NextUseOracle) -> None:
        self._oracle = oracle

    def key(self, node: TreeNode) -> int:
        return -self._oracle.next_use(node)


_SIMPLE: dict[EvictionPolicy, type[EvictionStrategy]] = {
    EvictionPolicy.LRU: LruStrategy,
    EvictionPolicy.LFU: LfuStrategy,
    EvictionPolicy.FIFO: FifoStrategy,
    EvictionPolicy.PRIORITY: PriorityStrategy,
    EvictionPolicy.FORK_AWARE: ForkAwareStrategy,
}


def make_strategy(policy: EvictionPolicy, oracle: NextUseOracle | None = None) -> EvictionStrategy:
    """A fresh strategy for ``policy``.

    Raises:
        ConfigError: BELADY without an ``oracle``, or an ``oracle`` with another policy.
    """
    if policy is EvictionPolicy.BELADY:
        if oracle is None:
            raise ConfigError("the belady policy needs a next-use oracle (it is offline)")
        return BeladyStrategy(oracle)
    if oracle is not None:
        raise ConfigError(f"a next-use oracle is only used by belady, not {policy.name}")
    return _SIMPLE[policy]()
