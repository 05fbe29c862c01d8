"""Tree nodes and their per-component data (the structure that holds them: ``urc.tree``).

A node is logical: it knows its key, its children, per-component ``ComponentData`` (indices
into pools, lock counts) and bookkeeping for eviction order.  It never touches pool tensors;
components do that through hooks.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from itertools import count
from typing import Any

import torch

__all__ = [
    "FULL_INDEX",
    "NUM_COMPONENT_TYPES",
    "ComponentData",
    "ComponentType",
    "PresenceData",
    "SizeUnit",
    "Tier",
    "TreeNode",
]


class ComponentType(IntEnum):
    """The kinds of model state a node can cache; the value indexes ``TreeNode.data``."""

    FULL = 0
    SWA = 1
    MAMBA = 2


NUM_COMPONENT_TYPES = len(ComponentType)


#: ``node.data`` index of the Full data.  A plain int: indexing a tuple with an IntEnum
#: member goes through ``__index__`` (the lock and match walks index on every node).
FULL_INDEX = 0


class SizeUnit(str, Enum):
    """What a component's sizes count (a ``str`` enum: metric names use the value)."""

    TOKENS = "tokens"
    STATES = "states"  # Mamba: one state slot per cached state, whatever its length


class Tier(IntEnum):
    """Where a copy of a component's data lives (nodes hold DEVICE and HOST copies; STORAGE
    is the L3 tier below the host, which keeps pages by hash, not on nodes)."""

    DEVICE = 0
    HOST = 1
    STORAGE = 2


class ComponentData:
    """One component's state on one node.

    ``value`` holds device pool indices (``None`` = tombstone: evicted, node kept);
    ``host_value`` the host-pool indices once HiCache backed it up.  ``lock_ref`` protects the
    device copy, ``host_lock_ref`` the host copy.  A component that keeps more per node
    subclasses it (``urc.components.swa_data.SWAData``).

    ``on_device`` is ``value is not None``.  Here it is derived (and a write only checks
    that it agrees); :class:`PresenceData` stores it, for components whose lock paths test
    it on every node.
    """

    __slots__ = ("host_lock_ref", "host_value", "lock_ref", "value")

    def __init__(self, value: torch.Tensor | None = None) -> None:
        self.value = value
        self.lock_ref = 0
        self.host_value: torch.Tensor | None = None
        self.host_lock_ref = 0

    @property
    def on_device(self) -> bool:
        """Whether ``value`` holds device indices (not a tombstone)."""
        return self.value is not None

    @on_device.setter
    def on_device(self, flag: bool) -> None:
        assert flag is (self.value is not None), f"on_device {flag} with {self!r}"

    def __repr__(self) -> str:
        n = None if self.value is None else self.value.shape[0]
        h = None if self.host_value is None else self.host_value.shape[0]
        return f"ComponentData(len={n}, host_len={h}, lock={self.lock_ref}/{self.host_lock_ref})"


class PresenceData(ComponentData):
    """``ComponentData`` that stores ``on_device`` (every writer of ``value`` sets both;
    ``sanity_check`` verifies it).

    For the components whose locks test presence on every node they lock (SWA's window,
    Mamba's node): reading ``value`` takes a reference to the tensor it holds, and on a
    lock that tensor is an object nothing else touches -- a cache miss of its own on a
    long-context tree (SGLang's bench: a third of a Mamba lock).  Full keeps the plain
    data: its lock tests one node, and a slot more per node costs every Full walk.
    """

    __slots__ = ("on_device",)

    def __init__(self, value: torch.Tensor | None = None) -> None:
        # The fields set here, not through ``super().__init__``: one call per new node
        # (an insert's Mamba data: 2.9% of its instructions with the extra call).
        self.value = value
        self.on_device = value is not None
        self.lock_ref = 0
        self.host_value: torch.Tensor | None = None
        self.host_lock_ref = 0


_ids = count()


class TreeNode:
    """A node of the radix tree: an edge of ``key_len`` tokens below ``parent``.

    ``data[ct]`` is the ``ComponentData`` of component ``ct`` (``None`` for components the
    cache was not built with), one entry per ``ComponentType``; the attributes ``full``,
    ``swa`` and ``mamba`` hold the same objects.  ``last_access_time`` is a logical clock
    (parent < child along a matched path).  ``heap_entry`` is the Full eviction heap's live
    entry for the node (``None``: none); ``deleted`` marks nodes removed from the tree (their
    heap entries are stale).
    """

    __slots__ = (
        "child_key",
        "children",
        "creation_time",
        "data",
        "deleted",
        "eviction_state",
        "full",
        "hash_value",
        "heap_entry",
        "hit_count",
        "id",
        "in_host_heap",
        "key",
        "key_len",
        "last_access_time",
        "mamba",
        "namespace",
        "parent",
        "priority",
        "swa",
    )

    def __init__(
        self,
        key: Any,
        parent: TreeNode | None,
        data: tuple[ComponentData | None, ...],
        namespace: tuple[str | int, ...] | None,
        time: int,
    ) -> None:
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        # The key under which ``parent.children`` holds this node (set when it is linked).
        self.child_key: Any = None
        self.key = key
        self.key_len = len(key)
        self.data = data
        # Each component's data, also reachable as ``data[ct]``: the lock walks and the match
        # loop touch it on every node, and an attribute saves an index and a read of the
        # (cold) tuple.  Every node has Full (the anchor component), so it is typed without
        # ``None``; ``swa`` and ``mamba`` are ``None`` on caches built without them.
        full, swa, mamba = data  # one entry per ComponentType, in its order
        self.full: ComponentData = full  # type: ignore[assignment]
        self.swa = swa
        self.mamba = mamba
        self.namespace = namespace
        self.last_access_time = time
        self.creation_time = time
        self.hit_count = 0
        self.priority = 0
        self.id = next(_ids)
        self.heap_entry: tuple[Any, int, TreeNode] | None = None
        self.in_host_heap = False
        self.deleted = False
        # Page digests for KV events (urc.kv_events: SHA-256 chain from the root; kept, and
        # split with the node, once computed).
        self.hash_value: list[bytes] | None = None
        # Per-node state of the eviction strategy, if it keeps any (``urc.eviction_policy``).
        self.eviction_state: Any = None

    @property
    def evicted(self) -> bool:
        """True when the node's Full data is not on device (SGLang's ``evicted``)."""
        cd = self.full
        return self.parent is not None and (cd is None or cd.value is None)

    @property
    def backuped(self) -> bool:
        """True when the node's Full data has a host copy."""
        cd = self.full
        return cd is not None and cd.host_value is not None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def component_data(self) -> tuple[ComponentData | None, ...]:
        """SGLang's name for :attr:`data` (indexed by ``ComponentType``)."""
        return self.data

    @property
    def lock_ref(self) -> int:
        """Full lock count (SGLang exposes ``node.lock_ref`` on classic trees)."""
        cd = self.full
        return 0 if cd is None else cd.lock_ref

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={self.key_len}, children={len(self.children)})"
