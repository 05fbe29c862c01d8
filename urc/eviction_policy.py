"""Eviction strategies: the order in which Full leaves leave the device (and the host).

The Full component keeps its evictable leaves in a lazy heap (``urc.components.full``); a
strategy says what that heap orders by and which leaves go before the heap's order.  It is
the only place a policy lives: adding one is a class here, an ``EvictionPolicy`` member
and its ``_STRATEGIES`` entry.

The interface is small:

* :meth:`EvictionStrategy.key_function`: the heap key of a leaf (smallest is evicted first),
  a plain callable (an ``attrgetter`` where it can be: it runs for every candidate).  It is
  evaluated when the leaf is pushed and again when its entry surfaces, and the entry is
  re-keyed when the two differ.  So a key that grows is always honoured; a key that can
  *drop* while the leaf sits in the heap needs :attr:`EvictionStrategy.rekey_on_release`
  (the leaf gets a fresh entry on every release, insert and split).
* :attr:`EvictionStrategy.rekey_before_evict`: a key that drops on *every* use (MRU) cannot
  be kept fresh lazily; the heap is re-keyed from scratch at the start of each eviction
  (O(leaves) per ``evict``, as SGLang rebuilds its heap on every call).
* :meth:`EvictionStrategy.superseded` / :meth:`EvictionStrategy.still_superseded`: when a
  node gets its second child the strategy may name the older sibling; the Full component
  queues it and evicts it before the heap's order while the strategy still says so.
* :meth:`EvictionStrategy.note_split` (when :attr:`EvictionStrategy.keeps_node_state`): a
  strategy that keeps per-node state in ``node.eviction_state`` hands it on at a split.

Which strategy the cache uses is ``CacheConfig.eviction_policy``, built with the policy's
parameters as given (``CacheConfig.eviction_params``: the strategy's keyword arguments, as
SGLang's ``--radix-eviction-policy-config``; :func:`policy_parameters` lists them).  LRU is
the default and is exactly SGLang's order, and so are LFU, FIFO, MRU, FILO, PRIORITY, SLRU
and TLRU (SGLang 0.5.23's ``evict_policy.py``; ties, which SGLang breaks by access time,
cannot occur for them); BELADY needs ``CacheConfig.next_use``; SESSION_AWARE
(``urc.session_eviction``) and RETURN_TIME (``urc.return_time_eviction``) use the serving
layer's hints (``urc.reuse_hint``) and are LRU without them.  Host-only leaves are evicted
in the same key order.  The auxiliary components (SWA, Mamba) keep their LRU
lists: they evict when their own pools run out, and the Full order decides which prefixes
stay.

Cost: O(1) per key and per fork (Belady: O(depth) per key for its oracle, measurement only).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from enum import Enum
from operator import attrgetter
from typing import Any, Protocol

from urc.errors import ConfigError
from urc.eviction_strategy import EvictionStrategy, HeapKey
from urc.node import TreeNode
from urc.return_time_eviction import ReturnTimeStrategy
from urc.session_eviction import SessionAwareStrategy

__all__ = [
    "EvictionPolicy",
    "BeladyStrategy",
    "EvictionStrategy",
    "ForkAwareStrategy",
    "LruStrategy",
    "MruStrategy",
    "NewestFirstStrategy",
    "NextUseOracle",
    "OrderByStrategy",
    "ReturnTimeStrategy",
    "SessionAwareStrategy",
    "SlruStrategy",
    "TlruStrategy",
    "make_strategy",
    "policy_parameters",
    "tlru_state",
]


class EvictionPolicy(Enum):
    """Order in which Full device and host leaves are evicted (first = evicted first);
    each member is a strategy in ``urc.eviction_policy``."""

    LRU = "lru"  # least recently used
    LFU = "lfu"  # fewest hits, then least recently used
    FIFO = "fifo"  # oldest inserted
    PRIORITY = "priority"  # lowest insert priority, then least recently used
    MRU = "mru"  # most recently used
    FILO = "filo"  # newest inserted
    SLRU = "slru"  # segmented LRU: fewer than ``slru_protected_threshold`` hits first
    TLRU = "tlru"  # tail-optimized LRU: ``tlru_threshold``, ``tlru_next_prompt_estimate``
    FORK_AWARE = "fork-aware"  # LRU, but a branch the traffic just forked away from goes first
    # Serving hints (``urc.reuse_hint``): sessions that went cold first, a stable set of the
    # hot ones kept whole; LRU without hints (``urc.session_eviction``).
    SESSION_AWARE = "session-aware"
    # Serving hints: a return time predicted per finished request from gaps learned online,
    # late ones expiring; furthest return first, LRU without hints (``urc.return_time_eviction``).
    RETURN_TIME = "return-time"
    BELADY = "belady"  # furthest next use: offline, needs ``next_use`` (measurement only)


class NextUseOracle(Protocol):
    """Knows the future (for :class:`BeladyStrategy`): the position in the workload of the
    next request that will use ``node``'s first page, or a number past the end if none."""

    def next_use(self, node: TreeNode) -> int: ...


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


class MruStrategy(EvictionStrategy):
    """Most recently used first (SGLang's ``mru``).  Every use lowers a leaf's key, so the
    heap is re-keyed before each eviction (:attr:`EvictionStrategy.rekey_before_evict`)."""

    __slots__ = ()

    rekey_before_evict = True

    def key_function(self) -> HeapKey:
        return lambda node: -node.last_access_time


class SlruStrategy(EvictionStrategy):
    """Segmented LRU (SGLang's ``slru``): leaves with fewer than ``protected_threshold`` hits
    (the probationary segment) go first, least recently used first within a segment."""

    __slots__ = ("_threshold",)

    def __init__(self, protected_threshold: int = 2) -> None:
        _check_count("slru protected_threshold", protected_threshold)
        self._threshold = protected_threshold

    def key_function(self) -> HeapKey:
        t = self._threshold
        return lambda node: (1 if node.hit_count >= t else 0, node.last_access_time)


class TlruStrategy(EvictionStrategy):
    """Tail-optimized LRU (Zhang et al., arXiv:2510.15152; SGLang's ``tlru``).

    A conversation whose history is ``L`` tokens and whose next prompt is expected to add
    ``next_prompt_estimate`` tokens needs only ``L + next_prompt_estimate - threshold``
    tokens cached to keep its next prefill within budget; a leaf whose parent already ends
    at or past that budget is "TEL-safe" and goes before every other leaf, then LRU order.
    ``L`` is the branch's high-water depth: the deepest end any node ever had at or below
    the leaf, which does not shrink when the tail is evicted (so a trimmed conversation
    stops after ``threshold - next_prompt_estimate`` tokens instead of going to nothing).
    Both parameters are in tokens.

    Per-node state (``node.eviction_state``): ``[end, history]``, the node's end position
    and its high-water depth, set the first time a key needs it (every new leaf's key is
    read when it enters the heap, which raises its ancestors' histories), and handed on at a
    split (the upper part inherits the lower part's history).  Keys only grow, except that
    a split moves a leaf's start further in (its parent ends later): the leaf gets a fresh
    heap entry then (:attr:`EvictionStrategy.rekey_on_release`).  Cost: O(depth) on the
    first key of a node, O(1) after.
    """

    __slots__ = ("_slack",)

    rekey_on_release = True
    keeps_node_state = True

    def __init__(self, threshold: int = 0, next_prompt_estimate: int = 0) -> None:
        _check_count("tlru threshold", threshold)
        _check_count("tlru next_prompt_estimate", next_prompt_estimate)
        self._slack = next_prompt_estimate - threshold

    def key_function(self) -> HeapKey:
        slack = self._slack

        def key(node: TreeNode) -> tuple[int, int]:
            end, history = tlru_state(node)
            safe = end - node.key_len >= max(history + slack, 0)
            return (-1 if safe else 0, node.last_access_time)

        return key

    def note_split(self, upper: TreeNode, lower: TreeNode) -> None:
        st = lower.eviction_state
        if st is not None:  # else both get theirs when first needed
            upper.eviction_state = [st[0] - lower.key_len, st[1]]


def tlru_state(node: TreeNode) -> list[int]:
    """``node.eviction_state`` for :class:`TlruStrategy` (``[end, history]``), set first if
    missing: for ``node`` and each ancestor without one, top down, and then every ancestor's
    history is raised to ``node``'s (mutates those nodes' ``eviction_state``)."""
    st = node.eviction_state
    if st is not None:
        return st  # type: ignore[no-any-return]
    chain = []
    cur: TreeNode | None = node
    while cur is not None and cur.eviction_state is None:
        chain.append(cur)
        cur = cur.parent
    end = 0 if cur is None else cur.eviction_state[0]
    for n in reversed(chain):
        end = end + n.key_len if n.parent is not None else 0
        history = end
        for c in n.children.values():
            cs = c.eviction_state
            if cs is not None and cs[1] > history:
                history = cs[1]
        n.eviction_state = [end, history]
    st = node.eviction_state
    h = st[1]
    up = node.parent
    while up is not None and up.eviction_state[1] < h:
        up.eviction_state[1] = h
        up = up.parent
    return st  # type: ignore[no-any-return]


def _check_count(name: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int (not a bool) >= 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")


class NewestFirstStrategy(EvictionStrategy):
    """Last inserted first (SGLang's ``filo``)."""

    __slots__ = ()

    def key_function(self) -> HeapKey:
        return lambda node: (-node.creation_time, node.last_access_time)


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


# The strategy of each policy but BELADY (which needs an oracle); each is called with the
# policy's parameters as given (``CacheConfig.eviction_params``: its keyword arguments).
_STRATEGIES: dict[EvictionPolicy, Callable[..., EvictionStrategy]] = {
    EvictionPolicy.LRU: LruStrategy,
    EvictionPolicy.LFU: lambda: OrderByStrategy("hit_count", "last_access_time"),
    EvictionPolicy.FIFO: lambda: OrderByStrategy("creation_time"),
    EvictionPolicy.MRU: MruStrategy,
    # Newest first; SGLang breaks a creation-time tie (the parts of one split node) by
    # access time.
    EvictionPolicy.FILO: NewestFirstStrategy,
    EvictionPolicy.PRIORITY: lambda: OrderByStrategy("priority", "last_access_time"),
    EvictionPolicy.FORK_AWARE: ForkAwareStrategy,
    EvictionPolicy.SLRU: SlruStrategy,
    EvictionPolicy.TLRU: TlruStrategy,
    EvictionPolicy.SESSION_AWARE: SessionAwareStrategy,
    EvictionPolicy.RETURN_TIME: ReturnTimeStrategy,
}


def policy_parameters(policy: EvictionPolicy) -> dict[str, Any]:
    """The parameters ``policy`` takes (its strategy's keyword arguments) with their
    defaults; empty for a policy without any (BELADY's oracle is not a parameter)."""
    if policy is EvictionPolicy.BELADY:
        return {}
    return {
        name: p.default
        for name, p in inspect.signature(_STRATEGIES[policy]).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def make_strategy(
    policy: EvictionPolicy,
    oracle: NextUseOracle | None = None,
    params: Mapping[str, Any] | None = None,
) -> EvictionStrategy:
    """A fresh strategy for ``policy`` with its parameters ``params`` as given (keyword
    arguments of its strategy class, e.g. ``{"protected_threshold": 3}`` for SLRU, SGLang's
    ``--radix-eviction-policy-config`` names; :func:`policy_parameters` lists them).

    Raises:
        ConfigError: BELADY without an ``oracle``, or an ``oracle`` with another policy; a
            parameter the policy does not take, or a value its strategy refuses.
    """
    params = params or {}
    if policy is EvictionPolicy.BELADY:
        if oracle is None:
            raise ConfigError("the belady policy needs a next-use oracle (it is offline)")
        if params:
            raise ConfigError(f"the belady policy takes no parameters, got {sorted(params)}")
        return BeladyStrategy(oracle)
    if oracle is not None:
        raise ConfigError(f"a next-use oracle is only used by belady, not {policy.name}")
    factory = _STRATEGIES[policy]
    unknown = sorted(set(params) - set(policy_parameters(policy)))
    if unknown:
        takes = ", ".join(policy_parameters(policy)) or "none"
        raise ConfigError(f"{policy.value} takes no parameter {unknown} (it takes {takes})")
    try:
        return factory(**params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # a value of the wrong type (e.g. from JSON)
        raise ConfigError(f"bad {policy.value} parameters {dict(params)}: {exc}") from None
