"""``TreeComponent``: the hooks through which one kind of model state lives in the tree.

The cache walks keys and the tree (``urc.tree.Tree``) keeps the node structure; every
physical action -- allocating, freeing, copying, translating indices, locking, choosing what
to evict -- happens in a component hook.  A component is built with its collaborators: the
tree, the pools, the config (its spec) and the cache-wide eviction steps
(:class:`EvictionSteps`, implemented by ``urc.eviction.Evictor``); it never sees the cache
itself.  A cache holds one component per
:class:`~urc.tree.ComponentType`; FULL is always present and is the anchor: a node exists
while its Full data exists on some tier.

Hooks are called in component order (FULL, SWA, MAMBA) unless stated otherwise.  A hook the
subclass does not override is never called on the hot path (the cache builds per-hook lists
of the components that override it), so defaults cost nothing.

Units: each component counts its sizes in its own unit (tokens for FULL and SWA, state slots
for MAMBA) and says which in :attr:`TreeComponent.unit`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from urc.node import ComponentData, ComponentType, SizeUnit, Tier, TreeNode

if TYPE_CHECKING:
    from urc.config import CacheConfig
    from urc.host.protocol import HostPart, HostTier, TransferItem
    from urc.params import (
        DecLockRefParams,
        EvictParams,
        EvictResult,
        IncLockRefResult,
        InsertParams,
        InsertResult,
        MatchPrefixParams,
        MatchResult,
    )
    from urc.pools.cache_pools import CachePools
    from urc.req import Req
    from urc.tree import Tree

__all__ = ["EvictTracker", "EvictionSteps", "MatchValidator", "PathValidator", "TreeComponent"]

MatchValidator = Callable[[TreeNode], bool]
# ``check(i)``: may a match of a known path end at its ``i``-th node (1-based)?
PathValidator = Callable[[int], bool]
# Units freed so far by one ``evict`` call, indexed by ComponentType.
EvictTracker = list[int]


class EvictionSteps(Protocol):
    """The cache-wide eviction steps a component's eviction driver and allocator call (each
    frees through every component's hooks, by priority; :mod:`urc.eviction`)."""

    def evict(self, params: EvictParams, protect: TreeNode | None = None) -> EvictResult:
        """Evict as ``UnifiedRadixCache.evict`` does, keeping ``protect``'s path."""
        ...

    def evict_device_leaf(self, node: TreeNode, tracker: EvictTracker) -> bool:
        """Evict (or demote) the unlocked device leaf ``node``; False when it must stay."""
        ...

    def cascade(self, node: TreeNode, trigger: TreeComponent, tracker: EvictTracker) -> None:
        """Evict ``trigger``'s data on ``node`` and what depends on it."""
        ...

    def evict_host_leaf(self, node: TreeNode, tracker: EvictTracker) -> None:
        """Free every host copy of the host-only leaf ``node`` and delete it."""
        ...


class TreeComponent(ABC):
    """One kind of cached model state (see the module docstring for the calling rules)."""

    component_type: ClassVar[ComponentType]
    unit: ClassVar[SizeUnit] = SizeUnit.TOKENS
    #: Released first, a release of this component that changes anything proves that the
    #: node's Full lock is held (it locks only data that the same acquire locked on that
    #: node with Full), so Full's ``check_release`` before it can be skipped.
    release_implies_full_lock: ClassVar[bool] = False

    def __init__(
        self, tree: Tree, pools: CachePools, config: CacheConfig, evictor: EvictionSteps
    ) -> None:
        # Collaborators: the tree's structure, the pools, the config (and this component's
        # spec in it), and the cache-wide eviction steps.  No reference to the cache.
        self.tree = tree
        self.pools = pools
        self.config = config
        self.evictor = evictor
        self.host_tier: HostTier | None = None  # see attach_host_tier
        # Device sizes in this component's unit: data on unlocked / locked nodes.
        self.evictable_size = 0
        self.protected_size = 0
        # Host sizes: host copies without / with a host lock.
        self.host_evictable_size = 0
        self.host_protected_size = 0

    def uses_hook(self, name: str) -> bool:
        """Whether this instance wants the hook ``name`` it overrides called (a config can
        switch an override off, so it costs nothing on the hot path when unused)."""
        return True

    def attach_host_tier(self, tier: HostTier) -> None:
        """The cache got a host tier (HiCache): host copies go there from now on."""
        self.host_tier = tier

    # ------------------------------------------------------------------ node data
    def new_data(self) -> ComponentData:
        """Fresh, empty data for a new node (a tombstone with no locks)."""
        return ComponentData()

    @abstractmethod
    def value_len(self, data: ComponentData) -> int:
        """Size of ``data``'s device value in this component's unit (0 for a tombstone)."""

    def node_has_component_data(self, node: TreeNode, tier: Tier = Tier.DEVICE) -> bool:
        """Whether ``node`` holds this component's data on ``tier``."""
        cd = node.data[self.component_type]
        assert cd is not None
        return (cd.value if tier is Tier.DEVICE else cd.host_value) is not None

    # ------------------------------------------------------------------ match
    def validate_match(self, params: MatchPrefixParams) -> None:
        """Raise :class:`~urc.errors.InvalidInputError` if ``params`` are invalid for this
        component (e.g. Mamba copy-on-write without a request).  Called before any change."""

    def create_match_validator(self, match_device_only: bool) -> MatchValidator | None:
        """A fresh stateful predicate for one match walk, or ``None`` (accepts every node).

        The walk calls it on every node it enters, top-down; a node is a valid match
        boundary only when every component's validator returns True for it.
        """
        return None

    def create_path_validator(
        self, path: Sequence[TreeNode], match_device_only: bool
    ) -> PathValidator | None:
        """What :meth:`create_match_validator` answers on each node of a walk of ``path``,
        asked in any order (``match_path`` asks from the deepest node up and stops at the
        first yes, so a component that can answer from a few nodes near ``i`` makes a
        re-match cost O(1) in the path's depth).  The default runs the walk's validator
        over the whole path once."""
        validate = self.create_match_validator(match_device_only)
        if validate is None:
            return None
        answers = [True, *[validate(node) for node in path]]
        return answers.__getitem__

    def deepest_boundary(self, path: Sequence[TreeNode], match_device_only: bool) -> int:
        """The largest ``i`` (``0 <= i <= len(path)``) at which this component's path validator
        accepts ``path[:i]`` (``i = 0`` always counts), asked from the deepest node up; for a
        component without validators, ``len(path)``.  The default asks
        :meth:`create_path_validator`; a component may answer directly (a match with one
        validating component asks this instead, saving the validator's construction)."""
        check = self.create_path_validator(path, match_device_only)
        if check is None:
            return len(path)
        for i in range(len(path), 0, -1):
            if check(i):
                return i
        return 0

    def device_match_window(self) -> int | None:
        """This component's device-only boundary rule when it is a window rule, else
        ``None`` (its validators decide).  ``w``: a match may end at a node only where the
        component's device value is on the node and on the nodes above it that the last
        ``w`` tokens up to its end reach (see :func:`urc.fastpath.py_deepest_boundary`).
        With a rule, a match without a host tier finds its hit in one compiled pass instead
        of asking :meth:`deepest_boundary`; both must answer alike (the suite checks it)."""
        return None

    def on_match_end(self, path: Sequence[TreeNode], best_len: int) -> None:
        """Refresh eviction order after a match; ``path[:best_len]`` is the accepted part."""

    def finalize_match_result(
        self,
        result: MatchResult,
        params: MatchPrefixParams,
        path: Sequence[TreeNode],
        best_len: int,
        visited_tokens: int,
    ) -> MatchResult:
        """Adjust the result (e.g. Mamba copy-on-write); returns the (new) result."""
        return result

    def host_hit_tokens(self, result: MatchResult) -> int:
        """Tokens past the device hit (up to ``result.best_match_node``) whose data of this
        component can be restored from host: by default the nodes whose host copy exists,
        counted from the device hit down without a gap."""
        if not result.host_hit_length:
            return 0
        segment = []
        node = result.best_match_node
        stop = result.last_device_node
        while node is not stop and node.parent is not None:
            segment.append(node)
            node = node.parent
        total = 0
        ct = self.component_type
        for node in reversed(segment):
            cd = node.data[ct]
            if cd is None or cd.host_value is None:
                break
            total += node.key_len
        return total

    # ------------------------------------------------------------------ insert
    def validate_insert(self, params: InsertParams, key_len: int) -> None:
        """Raise :class:`~urc.errors.InvalidInputError` if ``params`` are invalid for this
        component (``key_len``: the key's length in tree tokens).  Called before any change."""

    def recover_after_unevict(
        self, node: TreeNode, total_prefix_len: int, params: InsertParams
    ) -> None:
        """``node`` was host-only and just got fresh Full device slots from an insert at key
        position ``total_prefix_len``; rebuild this component's device data if it can."""

    def update_component_on_insert_overlap(
        self,
        node: TreeNode,
        prefix_len: int,
        total_prefix_len: int,
        value: torch.Tensor,
        params: InsertParams,
    ) -> int:
        """Called for every existing node an insert walks through.

        The node covers ``prefix_len`` tokens at key position ``total_prefix_len``; its
        incoming Full slots are ``value[total_prefix_len : total_prefix_len + prefix_len]``
        (``value`` is the whole incoming value: slice only when needed -- a tensor slice costs
        more than most of these calls).  Returns ``consumed_from`` (relative to the node): the
        component took ownership of the node's incoming slots from there on; the tree frees
        the duplicates ``[dup_start, min(consumed_from))``.  Default: nothing consumed.
        """
        return prefix_len

    def commit_insert_component_data(
        self,
        node: TreeNode,
        is_new_leaf: bool,
        params: InsertParams,
        result: InsertResult,
    ) -> TreeNode:
        """Attach this component's data to the insert's target ``node``.

        May split ``node`` (via ``tree.split``); returns the node later components
        should treat as the target (the lower part after a split).
        """
        return node

    def on_insert_end(self, path: Sequence[TreeNode]) -> None:
        """Refresh eviction order after an insert; ``path`` ends at the target node."""

    # ------------------------------------------------------------------ split
    @abstractmethod
    def redistribute_on_node_split(self, new_parent: TreeNode, child: TreeNode) -> None:
        """``child`` was split: ``new_parent`` takes the first ``new_parent.key_len`` tokens.

        Move this component's data so both parts are consistent; sizes must not change.
        """

    # ------------------------------------------------------------------ eviction
    def eviction_priority(self, is_leaf: bool) -> int:
        """Cascade priority: evicting a trigger also evicts components of priority <= its."""
        return 0

    def evict_request(self, params: EvictParams) -> int:
        """How much of this component ``params`` asks to free (in this component's unit)."""
        return 0

    def drive_eviction(self, params: EvictParams, tracker: EvictTracker) -> None:
        """Free this component's data until ``tracker[ct] >= evict_request(params)``."""

    @abstractmethod
    def evict_component(self, node: TreeNode, tier: Tier = Tier.DEVICE) -> int:
        """Free this component's data on ``tier`` of ``node`` (making it a tombstone there).

        The data must not be locked.  Returns the amount freed in this component's unit.
        """

    # ------------------------------------------------------------------ locks
    @abstractmethod
    def acquire_component_lock(self, node: TreeNode, result: IncLockRefResult) -> None:
        """Protect ``node``'s data (and whatever else this component pins) from eviction."""

    def check_release(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        """Raise :class:`~urc.errors.InvalidLockError` if releasing would be invalid.

        Called, before any lock is released, for every component except the one released
        first (the last in the cache's component order), so a refused release leaves every
        lock count unchanged.
        """

    @abstractmethod
    def release_component_lock(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        """Undo exactly what ``acquire_component_lock`` did for this receipt.

        Raises :class:`~urc.errors.InvalidLockError` *before changing anything* when the
        release is invalid: the component released first gets no ``check_release`` call.
        """

    def release_lock_early(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        """A higher-priority component released its part of the lock on ``node`` early (SWA:
        ``dec_swa_lock_only`` once decode moved past the window).

        A component whose lock must not outlive it (lock ordering ``full >= swa >= mamba``
        per node) releases its own part of the same receipt here, and records that in
        ``params`` (``skip_lock_node_ids``) so no later release repeats it.  The final
        ``dec_lock_ref`` of that receipt carries ``params.skip_swa``; such a component then
        releases nothing.
        """

    # ------------------------------------------------------------------ request caching
    def validate_caching_req(self, req: Req, is_finished: bool) -> None:
        """Raise :class:`~urc.errors.InvalidInputError` if ``req``'s fields for this component
        are invalid.  Called first by ``cache_finished_req`` / ``cache_unfinished_req``, before
        any change, so a refused request leaves cache, pools and request untouched."""

    def prepare_for_caching_req(
        self, req: Req, params: InsertParams, token_len: int, is_finished: bool
    ) -> int | None:
        """Fill this component's insert params from ``req``.

        Returns the effective cache length (the key is truncated to it), or ``None`` for no
        truncation.
        """
        return None

    def cleanup_after_caching_req(
        self,
        req: Req,
        is_finished: bool,
        insert_result: InsertResult | None,
        params: InsertParams | None,
    ) -> None:
        """Release request-owned resources the tree did not take (after the insert)."""

    # ------------------------------------------------------------------ host tier (HiCache)
    def host_len(self, data: ComponentData) -> int:
        """Size of ``data``'s host copy in this component's unit (0 when there is none)."""
        hv = data.host_value
        return 0 if hv is None else int(hv.shape[0])

    def backup_source(self, node: TreeNode) -> torch.Tensor | None:
        """Device slots (in this component's own pool) to copy to host when ``node`` is
        backed up, or ``None`` when there is nothing to back up.  Default: the device value,
        if it has no host copy yet."""
        cd = node.data[self.component_type]
        assert cd is not None
        return cd.value if cd.host_value is None else None

    def commit_backup(
        self, pieces: Sequence[TreeNode], host: torch.Tensor, source: torch.Tensor
    ) -> None:
        """The copy of ``source`` (what ``backup_source`` returned) into ``host`` finished:
        attach ``host`` to ``pieces`` (the node, possibly split since the backup started;
        top-down).  Default for per-token data: slice by piece length; a piece whose device
        data is no longer ``source``'s (lost or replaced despite the backup's locks) or that
        already has a host copy gets none (its host slots are freed)."""
        tier = self.host_tier
        assert tier is not None
        ct = self.component_type
        pos = 0
        for piece in pieces:
            cd = piece.data[ct]
            assert cd is not None
            n = piece.key_len
            part = host[pos : pos + n]
            src = source[pos : pos + n]
            pos += n
            if cd.value is None or cd.host_value is not None or not torch.equal(cd.value, src):
                tier.host_free(ct, part)
                continue
            cd.host_value = part
            self.add_host(cd, n)

    def commit_host_insert(self, node: TreeNode, start: int, parts: Sequence[HostPart]) -> None:
        """``node`` (key positions ``[start, start + node.key_len)``) just got Full host data
        read from a lower tier (``urc.host.transfers.insert_host``); attach this component's host
        copy from ``parts`` if one fits, recording the rows taken in ``part.taken`` (the
        rest is freed by the caller).  Default for per-token data: the part that covers the
        whole node, sliced to it.  A node that already has a host copy keeps it."""
        cd = node.data[self.component_type]
        assert cd is not None
        if cd.host_value is not None:
            return
        end = start + node.key_len
        for part in parts:
            if part.start <= start and end <= part.end:
                a, b = start - part.start, end - part.start
                cd.host_value = part.host[a:b]
                self.add_host(cd, node.key_len)
                part.taken.append((a, b))
                return

    def add_host(self, cd: ComponentData, n: int) -> None:
        """Count ``n`` units of host data just placed on ``cd`` (protected when host-locked,
        else evictable); the caller set ``cd.host_value``."""
        if cd.host_lock_ref:
            self.host_protected_size += n
        else:
            self.host_evictable_size += n

    def load_target(self, node: TreeNode, full_device: torch.Tensor) -> TransferItem | None:
        """The copy that restores ``node``'s data on load-back: host slots to read and device
        slots to fill (allocate them here if this component has a pool of its own), or
        ``None`` when there is nothing to load.  ``full_device`` are the Full slots reserved
        for the node.  Default: per-token data addressed by Full slots."""
        from urc.host.protocol import TransferItem

        cd = node.data[self.component_type]
        assert cd is not None
        if cd.host_value is None or cd.value is not None:
            return None
        return TransferItem(self.component_type, full_device, cd.host_value)

    def commit_load(self, pieces: Sequence[TreeNode], device: torch.Tensor) -> None:
        """The load-back copy into ``device`` finished: it becomes the device value of
        ``pieces`` (the node, possibly split since; top-down).  Default for per-token data:
        slice by piece length; a piece that got device data meanwhile keeps it."""
        pos = 0
        for piece in pieces:
            cd = piece.data[self.component_type]
            assert cd is not None
            n = piece.key_len
            part = device[pos : pos + n]
            pos += n
            if cd.value is not None:
                self.release_load_slots(part)
                continue
            cd.value = part
            if cd.lock_ref:
                self.protected_size += self.value_len(cd)
            else:
                self.evictable_size += self.value_len(cd)

    def add_alloc_shortfall(self, params: EvictParams, num_tokens: int) -> EvictParams:
        """Allocating Full slots for ``num_tokens`` tokens (a load-back) failed; ``params``
        asks for the Full shortfall.  Returns ``params`` plus what this component must evict
        from device so that the allocation can succeed (a paired allocator also takes this
        component's slots).  Default: ``params``."""
        return params

    def abort_load(self, pieces: Sequence[TreeNode], device: torch.Tensor) -> None:
        """A load-back was dropped: free the slots ``load_target`` reserved."""
        self.release_load_slots(device)

    def release_load_slots(self, device: torch.Tensor) -> None:
        """Free load-back slots that will not be used (Full frees its token slots)."""

    def host_lock(self, node: TreeNode, delta: int) -> None:
        """Add ``delta`` (+1/-1) to ``node``'s host lock, moving host sizes accordingly."""
        cd = node.data[self.component_type]
        assert cd is not None
        before = cd.host_lock_ref
        cd.host_lock_ref = before + delta
        assert cd.host_lock_ref >= 0, f"node {node.id} host lock below zero"
        n = self.host_len(cd)
        if before == 0 and delta > 0:
            self.host_evictable_size -= n
            self.host_protected_size += n
        elif cd.host_lock_ref == 0 and delta < 0:
            self.host_evictable_size += n
            self.host_protected_size -= n

    def evict_host(self, node: TreeNode) -> int:
        """Free ``node``'s host copy of this component (it must not be host-locked)."""
        cd = node.data[self.component_type]
        assert cd is not None and cd.host_value is not None and cd.host_lock_ref == 0
        tier = self.host_tier
        assert tier is not None
        n = self.host_len(cd)
        tier.host_free(self.component_type, cd.host_value)
        cd.host_value = None
        self.host_evictable_size -= n
        return n

    def host_mirror_buffers(self) -> list[tuple[torch.Tensor, int]] | None:
        """This component's device data buffers as ``(tensor, slot dim)`` pairs, for a host
        mirror (``None``: no data to mirror)."""
        return None

    def host_capacity(self) -> int:
        tier = self.host_tier
        return 0 if tier is None else tier.host_capacity(self.component_type)

    def host_available(self) -> int:
        tier = self.host_tier
        return 0 if tier is None else tier.host_available(self.component_type)

    # ------------------------------------------------------------------ pools and checks
    def pool_capacity(self) -> int:
        """Capacity of this component's device pool, in its unit."""
        return 0

    def pool_available(self) -> int:
        """Free units of this component's device pool."""
        return 0

    def check_node(self, node: TreeNode) -> None:
        """Assert this component's per-node invariants (called by ``sanity_check``)."""

    def check_structures(self, nodes: Sequence[TreeNode]) -> None:
        """Assert this component's eviction structures match ``nodes`` (every live node)."""

    def reset(self) -> None:
        """Forget all eviction structures (the tree is being cleared)."""
        self.evictable_size = 0
        self.protected_size = 0
        self.host_evictable_size = 0
        self.host_protected_size = 0
