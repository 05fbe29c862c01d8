"""Eviction strategies: the order in which Full leaves leave the device (and the host).

The Full component keeps its evictable leaves in a lazy heap (``urc.components.full``); a
strategy says what that heap orders by and which leaves go before the heap's order.  It is
the only place a policy lives: adding one is a class here plus an ``EvictionPolicy`` member.

The interface is small:

* :meth:`EvictionStrategy.key_function`: the heap key of a leaf (smallest is evicted first),
  a plain callable (an ``attrgetter`` where it can be: it runs for every candidate).  It is
  evaluated when the leaf is pushed and again when its entry surfaces, and the entry is
  re-keyed when the two differ.  So a key that grows is always honoured; a key that can
  *drop* while the leaf sits in the heap needs :attr:`EvictionStrategy.rekey_on_release`
  (the leaf gets a fresh entry on every release, insert and split).
* :meth:`EvictionStrategy.superseded` / :meth:`EvictionStrategy.still_superseded`: when a
  node gets its second child the strategy may name the older sibling; the Full component
  queues it and evicts it before the heap's order while the strategy still says so.

Which strategy the cache uses is ``CacheConfig.eviction_policy``; LRU is the default and is
exactly SGLang's order; BELADY needs ``CacheConfig.next_use``.  Host-only leaves are evicted
in the same key order.  The auxiliary components (SWA, Mamba) keep their LRU lists: they evict
when their own pools run out, and the Full order decides which prefixes stay.

Cost: O(1) per key and per fork (Belady: O(depth) per key for its oracle, measurement only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from operator import attrgetter
from typing import Any, Protocol

from urc.errors import ConfigError
from urc.node import TreeNode

__all__ = [
    "EvictionPolicy",
    "BeladyStrategy",
    "EvictionStrategy",
    "ForkAwareStrategy",
    "LruStrategy",
    "NextUseOracle",
    "OrderByStrategy",
    "make_strategy",
]


class EvictionPolicy(Enum):
    """Order in which Full device and host leaves are evicted (first = evicted first);
    each member is a strategy in ``urc.eviction_policy``."""

    LRU = "lru"  # least recently used
    LFU = "lfu"  # fewest hits, then least recently used
    FIFO = "fifo"  # oldest inserted
    PRIORITY = "priority"  # lowest insert priority, then least recently used
    FORK_AWARE = "fork-aware"  # LRU, but a branch the traffic just forked away from goes first
    BELADY = "belady"  # furthest next use: offline, needs ``next_use`` (measurement only)


HeapKey = Callable[[TreeNode], Any]


class NextUseOracle(Protocol):
    """Knows the future (for :class:`BeladyStrategy`): the position in the workload of the
    next request that will use ``node``'s first page, or a number past the end if none."""

    def next_use(self, node: TreeNode) -> int: ...


class EvictionStrategy(ABC):
    """What the Full eviction heaps order by (see the module docstring for the rules)."""

    __slots__ = ()

    # Whether a leaf needs a fresh heap entry whenever it is used (its key may have dropped).
    # False for every policy whose keys only grow.
    rekey_on_release: bool = False
    # Whether :meth:`superseded` is worth asking at each fork (off: no call on the insert path).
    marks_forks: bool = False

    @abstractmethod
    def key_function(self) -> HeapKey:
        """The heap key of a node; smaller keys are evicted first."""

    def superseded(self, parent: TreeNode) -> TreeNode | None:
        """``parent`` just got its second child: a sibling to evict first, if any."""
        return None

    def still_superseded(self, node: TreeNode) -> bool:
        """Whether a node :meth:`superseded` named is still to be evicted first."""
        return False


class OrderByStrategy(EvictionStrategy):
    """Leaves in the order of node attributes (compared as a tuple, first name first): SGLang's
    LRU, LFU, FIFO and priority orders."""

    __slots__ = ("_fields",)

    def __init__(self, *fields: str) -> None:
        self._fields = fields

    def key_function(self) -> HeapKey:
        return attrgetter(*self._fields)


class LruStrategy(OrderByStrategy):
    """Least recently used first: SGLang's order."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__("last_access_time")


class ForkAwareStrategy(LruStrategy):
    """LRU, except that a branch the traffic has just left is evicted first.

    When a node that had one child gets a second, the older child is a branch the traffic
    just forked away from: a conversation's next turn diverged from its previous prompt (an
    edited or regenerated message, a trimmed context), an agent re-planned from an earlier
    step.  That leaf goes before the LRU order, unless it was used again since, or its parent
    got a third child meanwhile.  Only the fork from one child to two marks a branch: the
    children of a widely shared prefix (a system prompt with many conversations below it)
    are never marked.

    The signal is read from the tree alone (no counters to tune); the heap key is LRU's, so
    every operation costs what it costs under LRU plus O(1) per fork, and on a workload
    without forks the order is exactly LRU's.
    """

    __slots__ = ()

    marks_forks = True

    def superseded(self, parent: TreeNode) -> TreeNode | None:
        if parent.parent is None or len(parent.children) != 2:
            return None
        older = min(parent.children.values(), key=attrgetter("last_access_time"))
        return older if self.still_superseded(older) else None

    def still_superseded(self, node: TreeNode) -> bool:
        parent = node.parent
        if parent is None or parent.parent is None or len(parent.children) != 2:
            return False
        t = node.last_access_time
        return any(sibling.last_access_time > t for sibling in parent.children.values())


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

    def key_function(self) -> HeapKey:
        next_use = self._oracle.next_use
        return lambda node: -next_use(node)


_SIMPLE: dict[EvictionPolicy, Callable[[], EvictionStrategy]] = {
    EvictionPolicy.LRU: LruStrategy,
    EvictionPolicy.LFU: lambda: OrderByStrategy("hit_count", "last_access_time"),
    EvictionPolicy.FIFO: lambda: OrderByStrategy("creation_time"),
    EvictionPolicy.PRIORITY: lambda: OrderByStrategy("priority", "last_access_time"),
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
