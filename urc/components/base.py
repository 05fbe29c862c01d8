"""``TreeComponent``: the hooks through which one kind of model state lives in the tree.

The cache walks keys and the tree (``urc.tree.Tree``) keeps the node structure; every
physical action -- allocating, freeing, copying, translating indices, locking, choosing what
to evict -- happens in a component hook.  A component is built with its collaborators: the
tree, the pools, the config (its spec) and the cache-wide eviction steps
(:class:`EvictionSteps`, implemented by ``urc.eviction.Evictor``); it never sees the cache
itself.  A cache holds one component per
:class:`~urc.node.ComponentType`; FULL is always present and is the anchor: a node exists
while its Full data exists on some tier.  The big picture: docs/architecture.md §1 (the
layers: the tree is logical, components own physical resources) and §3 (the path of an
eviction through these hooks).

Hooks are called in component order (FULL, SWA, MAMBA) unless stated otherwise.  An optional
hook (a field of :class:`urc.hooks.ComponentHooks`) is called only on the components whose
class overrides it and whose :meth:`TreeComponent.uses_hook` agrees (the cache builds
per-hook lists), so a default costs nothing on the hot path.

Each hook's docstring says what it mutates, which operation calls it (match, insert, split,
evict, lock/unlock, request caching, host tier, checks), what it returns or raises, and then
one line per kind: Full (``full.py``), SWA (``swa.py``, ``swa_window.py``, ``swa_data.py``)
and Mamba (``mamba.py``, ``mamba_requests.py``); "default" means the kind keeps the base
behaviour.

Units: each component counts its sizes in its own unit (tokens for FULL and SWA, state slots
for MAMBA) and says which in :attr:`TreeComponent.unit`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from urc.components.host_hooks import HostTierHooks
from urc.components.request_hooks import RequestHooks
from urc.node import ComponentData, ComponentType, SizeUnit, Tier, TreeNode

if TYPE_CHECKING:
    from urc.config import CacheConfig
    from urc.host_protocol import HostTier
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
    from urc.tree import Tree

__all__ = ["EvictTracker", "EvictionSteps", "MatchValidator", "PathValidator", "TreeComponent"]

# ``validate(node)``: may the match end at ``node``?  Stateful: called top-down on every node
# of one walk (see :meth:`TreeComponent.create_match_validator`).
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


class TreeComponent(HostTierHooks, RequestHooks, ABC):
    """One kind of cached model state (see the module docstring for the calling rules).

    Class attributes a subclass sets:

    - ``component_type``: its :class:`~urc.node.ComponentType`, the index of its data in
      ``node.data`` and in an :data:`EvictTracker` (Full: FULL; SWA: SWA; Mamba: MAMBA).
    - ``unit``: what its sizes, pool figures and evict request count (Full and SWA: tokens,
      the default; Mamba: ``SizeUnit.STATES``, one per state slot).
    - ``release_implies_full_lock``: see below (Full: False; SWA and Mamba: True).
    """

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
        switch an override off, so it costs nothing on the hot path when unused).  Mutates
        nothing; asked by ``urc.hooks.ComponentHooks.of`` when the cache builds its hook table
        (at construction, and again in ``attach_host_tier``).

        - Full: ``on_insert_end`` only under a strategy whose keys drop on use (Belady).
        - SWA: ``finalize_match_result`` only with a host tier (host hits only).
        - Mamba: default (every override).
        """
        return True

    def attach_host_tier(self, tier: HostTier) -> None:
        """The cache got a host tier (HiCache): host copies go there from now on.

        Sets ``self.host_tier``; called by ``UnifiedRadixCache.attach_host_tier``, which
        then rebuilds the hook table (``uses_hook`` may answer differently now).

        - Full, SWA, Mamba: default.
        """
        self.host_tier = tier

    # ------------------------------------------------------------------ node data
    def new_data(self) -> ComponentData:
        """Fresh, empty data for a new node (a tombstone with no locks).

        Called for every node the tree creates (``Tree.new_node`` / ``new_root``, so also the
        upper node of a split, before ``redistribute_on_node_split``).

        - Full: default.
        - SWA: an :class:`~urc.components.swa_data.SWAData` (window-lock ``uuid`` and
          ``restored`` stamps, both unset).
        - Mamba: a :class:`~urc.components.mamba_data.MambaData` (its lock tests
          ``on_device``; ``slot`` names the state's pool slot).
        """
        return ComponentData()

    @abstractmethod
    def value_len(self, data: ComponentData) -> int:
        """Size of ``data``'s device value in this component's unit (0 for a tombstone).

        Read-only; used by ``sanity_check`` to recompute the sizes and by the default
        ``commit_load``.

        - Full: the value's length (the node's ``key_len`` tokens).
        - SWA: the same (its value translates the Full value token by token).
        - Mamba: 1 for a state slot, else 0.
        """

    def node_has_component_data(self, node: TreeNode, tier: Tier = Tier.DEVICE) -> bool:
        """Whether ``node`` holds this component's data on ``tier``.

        Read-only; asked by ``cascade_evict`` and ``drop_if_empty`` (eviction) and by
        ``UnifiedRadixCache.reset`` before they call ``evict_component`` / ``evict_host``.

        - Full: default.
        - SWA: default (False on an SWA tombstone).
        - Mamba: overridden with the same answer (a cheaper lookup).
        """
        cd = node.data[self.component_type]
        assert cd is not None
        return (cd.value if tier is Tier.DEVICE else cd.host_value) is not None

    # ------------------------------------------------------------------ match
    def validate_match(self, params: MatchPrefixParams) -> None:
        """Raise :class:`~urc.errors.InvalidInputError` if ``params`` are invalid for this
        component (e.g. Mamba copy-on-write without a request).  Called before any change.

        Mutates nothing; called first by ``match_prefix`` and ``match_path``.

        - Full: not overridden.
        - SWA: not overridden.
        - Mamba: ``cow_mamba`` needs ``params.req``; a ``req.mamba_pool_idx`` it has must be a
          caller-held 1-element int64 slot (``InvalidIndicesError`` / ``TreeOwnedSlotError``).
        """

    def create_match_validator(self, match_device_only: bool) -> MatchValidator | None:
        """A fresh stateful predicate for one match walk, or ``None`` (accepts every node).

        A match with a host tier makes two per walk (device-only, any tier) and calls them
        on every node it enters, top-down; a node is a valid boundary only when every
        validator returns True.  Mutates only the validator's own state.

        - Full: ``None`` (not overridden).
        - SWA: True where the SWA tokens up to the nearest tombstone fill a window (or reach
          the root); window 8: a tombstone -> False, then 4-token nodes -> False, True.
        - Mamba: True only on a node holding a state (tombstone, plain inner node -> False).
        """
        return None

    def create_path_validator(
        self, path: Sequence[TreeNode], match_device_only: bool
    ) -> PathValidator | None:
        """What :meth:`create_match_validator` answers on each node of a walk of ``path``,
        asked in any order (``match_path`` asks from the deepest node up and stops at the
        first yes, so a component that can answer from a few nodes near ``i`` makes a
        re-match cost O(1) in the path's depth).  The default runs the walk's validator
        over the whole path once.  Read-only; used when several components validate.

        - Full: default (``None``: no validator).
        - SWA: looks at most one window above ``path[i - 1]``; e.g. ``check(i)`` is False
          when ``path[i - 1]`` is a tombstone.
        - Mamba: ``check(i)`` is whether ``path[i - 1]`` holds a state.
        """
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
        validating component asks this instead, saving the validator's construction).

        - Full: default (``len(path)``).
        - SWA: :func:`~urc.components.swa_window.deepest_window_boundary`.
        - Mamba: the deepest node with a state; e.g. 1 for ``[A (state), B (none)]``.
        """
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
        of asking :meth:`deepest_boundary`; both must answer alike (the suite checks it).
        Asked of the validating components when the hook table is built.

        - Full: default (``None``; Full validates nothing, so it is not asked).
        - SWA: its spec's ``window``.
        - Mamba: 0 (the state must be on the node itself).
        """
        return None

    def on_match_end(self, path: Sequence[TreeNode], best_len: int) -> None:
        """Refresh eviction order after a match; ``path[:best_len]`` is the accepted part.

        Called by every match (``match_prefix``, ``match_path``) after the path is stamped,
        with ``best_len`` the best match on any tier; mutates this component's LRU only.

        - Full: not overridden (its heap re-keys lazily from the stamped access times).
        - SWA: moves the nodes covering one window plus a page above ``path[best_len - 1]``
          to the MRU end, ancestors first.
        - Mamba: promotes the state of ``path[best_len - 1]`` only (checkpoints above keep
          their age).
        """

    def finalize_match_result(
        self,
        result: MatchResult,
        params: MatchPrefixParams,
        path: Sequence[TreeNode],
        best_len: int,
        visited_tokens: int,
    ) -> MatchResult:
        """Adjust the result (e.g. Mamba copy-on-write); returns the (new) result.

        Called last in every match, after ``on_match_end``, each component getting the
        previous one's result; ``best_len``: the device hit, ``visited_tokens``: the tokens
        walked.

        - Full: not overridden.
        - SWA: sets ``swa_host_hit_length`` (``host_hit_tokens``); only with a host tier.
        - Mamba: sets ``mamba_host_hit_length`` and ``mamba_branching_seqlen`` (also on
          ``params.req``); with ``cow_mamba`` copies the hit's state into the request's slot
          (allocating one, maybe evicting a state); no slot -> a miss at the root.
        """
        return result

    def host_hit_tokens(self, result: MatchResult) -> int:
        """Tokens past the device hit (up to ``result.best_match_node``) whose data of this
        component can be restored from host: by default the nodes whose host copy exists,
        counted from the device hit down without a gap.  Read-only.

        - Full: default (not called: ``host_hit_length`` is Full's own).
        - SWA: default, called by its ``finalize_match_result``.
        - Mamba: default, unused (its ``finalize_match_result`` counts down to the deepest
          node with a host state instead).
        """
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
        component (``key_len``: the key's length in tree tokens).  Called before any change,
        and must make none to the tree: ``insert`` has walked it already and uses that path.

        Called by ``insert`` once the key and value checked out.

        - Full: not overridden (``insert`` checks the value itself).
        - SWA: ``swa_evicted_seqlen`` must be in ``[0, key_len]`` (``key_len + 1`` for EAGLE).
        - Mamba: ``mamba_value`` (if any) must be a caller-held 1-element int64 slot and the
          key page-aligned; remembers the slot for ``commit_insert_component_data``.
        """

    def recover_after_unevict(
        self, node: TreeNode, total_prefix_len: int, params: InsertParams
    ) -> None:
        """``node`` was host-only and just got fresh Full device slots from an insert at key
        position ``total_prefix_len``; rebuild this component's device data if it can.

        Called by ``insert`` for each host-only node its walk passes (after Full's value and
        sizes are set).  Returns nothing.

        - Full: not overridden (``insert`` set its value).
        - SWA: the part at and past the insert's boundary gets SWA if its slots still map
          SWA pages (split off above if needed); the rest stays a tombstone, pages freed.
        - Mamba: not overridden (the node has no device state until a load-back).
        """

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
        (the whole incoming value: slice only when needed, a slice costs more than most of
        these calls).  Returns ``consumed_from`` (relative to the node): the component owns
        the incoming slots from there on; ``insert`` frees the duplicates
        ``[dup_start, min(consumed_from))``.  Default: nothing consumed.

        - Full, Mamba: not overridden.
        - SWA: recovers a tombstone from incoming slots inside the window (may split it): Full
          unlocked: adopts them (returns the start); locked: moves the SWA pages onto Full's.
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
        should treat as the target (the lower part after a split).  Called by ``insert``
        after the walk and the new leaf (whose Full value ``insert`` set).

        - Full: not overridden.
        - SWA: a new leaf only: the part below the boundary stays a tombstone (split off,
          SWA freed), the rest gets SWA, capped to one page-aligned window (split above).
        - Mamba: a target with a state keeps it (``result.mamba_exist = True``); else it
          adopts ``params.mamba_value``'s slot (MRU in the LRU).
        """
        return node

    def on_insert_end(self, path: Sequence[TreeNode]) -> None:
        """Refresh eviction order after an insert; ``path`` ends at the target node.

        Called last by ``insert``, after the commit hooks; mutates eviction order only.

        - Full: re-keys the target leaf's heap entry (only under a strategy whose keys drop
          on use: ``uses_hook``).
        - SWA: refreshes the window above ``path[-1]`` (as ``on_match_end``).
        - Mamba: not overridden (the commit already promoted the target's state).
        """

    # ------------------------------------------------------------------ split
    @abstractmethod
    def redistribute_on_node_split(self, new_parent: TreeNode, child: TreeNode) -> None:
        """``child`` was split: ``new_parent`` takes the first ``new_parent.key_len`` tokens.

        Move this component's data so both parts are consistent; sizes must not change.
        Called by ``Tree.split`` (match, insert, eviction, hooks) for every component.

        - Full: slices device and host values; the upper part counts 1 lock if ``child`` is
          locked, and copies the host lock.
        - SWA: slices values, copies lock counts and ``restored``; the window-lock ``uuid``
          moves up; both go to the LRU's MRU end, the upper part first.
        - Mamba: the state stays with ``child`` (the upper part gets none); ``child`` is
          promoted in the LRU.
        """

    # ------------------------------------------------------------------ eviction
    def eviction_priority(self, is_leaf: bool) -> int:
        """Cascade priority: evicting a trigger also evicts components of priority <= its.

        Read by ``cascade_evict`` and by ``dec_swa_lock_only`` (components below SWA's
        internal priority release early).

        - Full: 0 on a leaf, 2 inside the tree.
        - SWA: 0 on a leaf, 1 inside the tree.
        - Mamba: default (0: an internal state goes alone).
        """
        return 0

    def evict_request(self, params: EvictParams) -> int:
        """How much of this component ``params`` asks to free (in this component's unit).

        Read by ``evict``: a driver is run only when this is positive.

        - Full: ``num_tokens``.
        - SWA: ``swa_num_tokens``.
        - Mamba: ``mamba_num``.
        """
        return 0

    def drive_eviction(self, params: EvictParams, tracker: EvictTracker) -> None:
        """Free this component's data until ``tracker[ct] >= evict_request(params)``.

        Called by ``evict`` in component order, one ``tracker`` for all (what an earlier
        driver's cascades freed counts); picks victims and frees them through
        :class:`EvictionSteps`, never locked data; stops early when nothing is left.

        - Full: device leaves from its strategy's queue, then heap (with partial-leaf eviction,
          only tail pages); a leaf that cannot be demoted is skipped.
        - SWA: oldest unlocked LRU nodes, cascaded (a leaf goes, an inner node tombstoned).
        - Mamba: oldest unlocked state: an inner node loses it alone; a leaf is cascaded.
        """

    @abstractmethod
    def evict_component(self, node: TreeNode, tier: Tier = Tier.DEVICE) -> int:
        """Free this component's data on ``tier`` of ``node`` (making it a tombstone there).

        The data must not be locked.  Returns the amount freed in this component's unit.
        Called by ``evict_device_leaf`` (last component first), ``cascade_evict``,
        ``drop_if_empty``, Mamba's driver and ``reset``; never unlinks the node.  Every
        kind asserts ``tier is Tier.DEVICE`` (host copies go through ``evict_host``).

        - Full: frees its token slots; returns ``key_len``.
        - SWA: frees the SWA pages its Full slots map (Full kept); leaves the LRU;
          returns ``key_len``.
        - Mamba: releases the state slot to the pool; leaves the LRU; returns 1.
        """

    # ------------------------------------------------------------------ locks
    @abstractmethod
    def acquire_component_lock(self, node: TreeNode, result: IncLockRefResult) -> None:
        """Protect ``node``'s data (and whatever else this component pins) from eviction.

        Called by ``inc_lock_ref`` (requests, eviction's ``protect``, host-tier pins) on a
        live non-root node; moves sizes to protected and fills the receipt ``result``.

        - Full: the path to the root, up to the first node already locked (``delta``;
          ``full_start_id`` when the bottom nodes are host-only).
        - SWA: one window of SWA nodes up from ``node``, skipping tombstones (recorded);
          stamps ``swa_uuid_for_lock`` and ``swa_lock_epoch``.
        - Mamba: the node's own state (with SWA, only where SWA's lock there exceeds
          Mamba's); a node it does not lock is recorded as skipped.
        """

    def check_release(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        """Raise :class:`~urc.errors.InvalidLockError` if releasing would be invalid.

        Called by ``dec_lock_ref`` before any release, for every component except the one
        released first (the last in component order), so a refused release changes nothing;
        Full's also skipped when every other kind has ``release_implies_full_lock``.

        - Full: the receipt's Full lock must be held; skipped with the current kinds.
        - SWA: the window walk must fit the receipt; kept as the release's plan.
        - Mamba: not overridden (released first when present).
        """

    @abstractmethod
    def release_component_lock(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        """Undo exactly what ``acquire_component_lock`` did for this receipt.

        Raises :class:`~urc.errors.InvalidLockError` *before changing anything* when the
        release is invalid: the component released first gets no ``check_release`` call.
        Called by ``dec_lock_ref`` in reverse component order (MAMBA, SWA, FULL); SWA's also
        by ``dec_swa_lock_only``.  Moves sizes back from protected to evictable.

        - Full: walks up from ``full_start_id`` until a count stays above zero; a node that
          becomes an evictable leaf goes back into the heap.
        - SWA: nothing with ``skip_swa``; checks the Full lock, then unlocks the window.
        - Mamba: the node's state, unless the receipt skipped it (or ``skip_swa``).
        """

    def release_lock_early(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        """A higher-priority component released its part of the lock on ``node`` early (SWA:
        ``dec_swa_lock_only`` once decode moved past the window).

        A component whose lock must not outlive it (``full >= swa >= mamba`` per node)
        releases its part of the same receipt here and records it in ``skip_lock_node_ids``;
        the final ``dec_lock_ref`` carries ``params.skip_swa`` and releases nothing of it.

        - Full, SWA: not overridden (Full is above SWA; SWA is the one releasing).
        - Mamba: releases the node's state lock and adds the node to the receipt's skips.
        """

    # ------------------------------------------------------------------ pools and checks
    def pool_capacity(self) -> int:
        """Capacity of this component's device pool, in its unit.

        Read by ``stats``, ``check_pools`` and the host tier's sizing.

        - Full: the token allocator's size.
        - SWA: the SWA side's size (``swa_size``).
        - Mamba: the Mamba pool's slot count.
        """
        return 0

    def pool_available(self) -> int:
        """Free units of this component's device pool.

        Read by ``stats``, ``check_pools`` and ``available_and_evictable_str``.

        - Full: the token allocator's free slots.
        - SWA: the free SWA slots.
        - Mamba: the free state slots.
        """
        return 0

    def check_node(self, node: TreeNode) -> None:
        """Assert this component's per-node invariants (called by ``sanity_check``).

        Read-only; runs after the generic per-node checks (lock ordering across kinds).

        - Full: value length, parent on device, lock counts cover locked children.
        - SWA: value is the translation of Full's and in the LRU; a tombstone maps no SWA.
        - Mamba: Mamba lock <= Full lock; a state is a tree-owned slot in the LRU.
        """

    def check_structures(self, nodes: Sequence[TreeNode]) -> None:
        """Assert this component's eviction structures match ``nodes`` (every live node).

        Read-only; called once per component by ``sanity_check``.

        - Full: every device leaf in the heap, every host leaf in the host heap.
        - SWA: the LRU holds exactly the nodes with SWA.
        - Mamba: the LRU and the data's slots match the nodes with state; pool ownership
          agrees.
        """

    def reset(self) -> None:
        """Forget all eviction structures (the tree is being cleared).

        Called by ``UnifiedRadixCache.reset`` after every node's data was freed; zeroes
        the sizes.

        - Full: also empties its heaps and fork queue.
        - SWA: also empties its LRU.
        - Mamba: also empties its LRU.
        """
        self.evictable_size = 0
        self.protected_size = 0
        self.host_evictable_size = 0
        self.host_protected_size = 0
