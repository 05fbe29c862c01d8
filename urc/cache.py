"""``UnifiedRadixCache``: one radix tree over token ids for every kind of cached model state.

The synchronous core, with SGLang's ``UnifiedRadixCache`` surface (method names, parameter and
result dataclasses, semantics).  The tree is logical: it matches keys, splits nodes, keeps the
clock and the node structure, and calls component hooks (``urc.components``) for everything
physical.  FULL is the anchor component: a node lives while its Full data lives on some tier.

Costs (K = key length, D = nodes on the path): match and insert are O(K) token comparisons
(one C-level slice comparison per node) plus O(D) interpreter work and O(1) torch calls;
lock/unlock are O(D); evict is O(k log n) for k evicted leaves.

Not thread-safe: one owner mutates it (the async service's actor task, or a scheduler loop).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from urc import checks, eviction, insertion, matching, request_caching
from urc.components import component_class
from urc.components.base import TreeComponent
from urc.components.full import FullComponent
from urc.config import CacheConfig, CachePools, build_pools
from urc.errors import (
    InvalidInputError,
    InvalidLockError,
)
from urc.eviction import Evictor
from urc.fastpath import select_match_tail, select_walk
from urc.hooks import ComponentHooks
from urc.host import transfers as host_transfers
from urc.host.protocol import HostTier, TierEvents, WritePolicy
from urc.key import RadixKey
from urc.node import NUM_COMPONENT_TYPES, ComponentData, ComponentType, Tier, TreeNode
from urc.params import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from urc.req import Req
from urc.stats import CacheCounters, CacheStats, StatsSnapshotter
from urc.tree import Tree

__all__ = ["UnifiedRadixCache", "build_cache"]

_FULL = 0
_new_tuple = tuple.__new__
# ``dec_lock_ref`` results by delta: immutable, so one object per delta serves every release
# (a dict hit costs less than building the tuple; the bench's cold Full unlock: ~10%).
_release_results: dict[int, DecLockRefResult] = {}


def _release_result(delta: int) -> DecLockRefResult:
    if len(_release_results) >= 1024:  # many distinct deltas: start over
        _release_results.clear()
    result = _release_results[delta] = _new_tuple(DecLockRefResult, (delta,))
    return result


_new_object = object.__new__


class UnifiedRadixCache:
    """The radix tree and its components (see the module docstring)."""

    def __init__(self, config: CacheConfig, pools: CachePools) -> None:
        self.config = config
        self.pools = pools
        self.page_size = config.page_size
        self.device = torch.device(config.device)
        #: A miss's pending indices concatenate this (a fresh empty tensor each read).
        self.no_indices = torch.empty(0, dtype=torch.int64, device=self.device)
        #: Index tensors live in host memory (numpy views of them are free).
        self.on_cpu = self.device.type == "cpu"
        self.is_eagle = config.is_eagle
        self.req_to_token_pool = pools.req_to_token_pool
        self.token_to_kv_pool_allocator = pools.token_allocator
        alloc = pools.token_allocator
        self._free_checked = alloc.free
        # Tree-owned slots were checked when the tree adopted them (insert): free them
        # without re-validating.  Allocators of callers' own pools may lack the fast path.
        self._free_owned = getattr(alloc, "free_owned", alloc.free)
        use_page_ops = getattr(alloc, "use_page_ops", None)
        if use_page_ops is not None:  # the page bookkeeping follows the walk (urc.pools.pageops)
            use_page_ops(config.walk_impl)
        self.counters = CacheCounters()
        self._snapshots = StatsSnapshotter(self)
        # HiCache (``attach_host_tier``): nodes may then live on device, host, or both.
        self.host_tier: HostTier | None = None
        self.write_policy: WritePolicy | None = None
        self.backup_threshold: int | None = None
        # Nodes whose hit count reached the write-through threshold, waiting for a backup.
        self.pending_backups: dict[int, TreeNode] = {}
        self.backups_in_flight: set[int] = set()
        # The tiers below device that listen (``subscribe``): see ``urc.host.protocol.TierEvents``.
        self.tier_events: tuple[TierEvents, ...] = ()
        # The tree's structure and the eviction steps first: components are built with them.
        self.tree = tree = Tree(
            config.page_size,
            config.is_eagle,
            self.device,
            select_walk(config.walk_impl),
            select_match_tail(config.walk_impl),
        )
        self.evictor = Evictor(self)
        self.components: list[TreeComponent] = [
            component_class(ct)(tree, pools, config, self.evictor) for ct in config.components
        ]
        full = self.components[0]
        assert isinstance(full, FullComponent)
        self.full: FullComponent = full
        self._components_rev = self.components[::-1]
        self._by_type: dict[ComponentType, TreeComponent] = {
            c.component_type: c for c in self.components
        }
        comps = self.components
        self.hooks = hooks = ComponentHooks.of(comps)
        # Lock hooks as bound methods: a lock or an unlock is a handful of attribute loads,
        # so the per-component method lookup is worth saving.
        self._acquire = [c.acquire_component_lock for c in comps]
        self._release = [c.release_component_lock for c in self._components_rev]
        # The component released first validates inside its own release (the hook contract:
        # raise before changing anything), so only the later ones need a separate check --
        # not Full's (released last) when every release before it that changes anything
        # proves the Full lock: then a failing Full release follows only releases that
        # changed nothing.
        first = self._components_rev[0]
        full_implied = all(
            c.release_implies_full_lock for c in self._components_rev if c is not full
        )
        self._check_release = [
            c.check_release
            for c in hooks.release_checks
            if c is not first and not (c is full and full_implied)
        ]
        tree.bind(self._new_data, [c.redistribute_on_node_split for c in comps])

    # ================================================================== structure
    @property
    def root(self) -> TreeNode:
        return self.tree.root

    @property
    def root_node(self) -> TreeNode:
        """SGLang's name for :attr:`root`."""
        return self.tree.root

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    def _new_data(self) -> tuple[ComponentData | None, ...]:
        data: list[ComponentData | None] = [None] * NUM_COMPONENT_TYPES
        for c in self.components:
            data[c.component_type] = c.new_data()
        return tuple(data)

    def component(self, ct: ComponentType) -> TreeComponent:
        """The component of type ``ct`` (``KeyError`` if the cache was built without it)."""
        return self._by_type[ct]

    def has_component(self, ct: ComponentType) -> bool:
        return ct in self._by_type

    def touch(self, node: TreeNode) -> None:
        """Stamp ``node`` with a fresh clock tick (it was just used)."""
        self.tree.touch(node)

    def split_node(self, child: TreeNode, k: int) -> TreeNode:
        """Split ``child`` after ``k`` tokens; returns the new upper node (see
        :meth:`urc.tree.Tree.split`)."""
        return self.tree.split(child, k)

    def path_to(self, node: TreeNode) -> list[TreeNode]:
        """The nodes from the root's child down to ``node`` (empty for the root)."""
        return self.tree.path_to(node)

    def delete_leaf(self, node: TreeNode) -> None:
        """Unlink a childless node that no component holds data for any more."""
        self.tree.unlink(node)

    def free_full(self, value: torch.Tensor) -> None:
        """Return tree-owned Full (token) slots to the allocator (which queues them: see
        :meth:`~urc.pools.allocator.TokenSlotAllocator.free_owned`)."""
        self._free_owned(value)

    def free_request_kv(self, value: torch.Tensor) -> None:
        """Free Full slots a request holds (checked: a slot that is not allocated raises
        :class:`~urc.errors.DoubleFreeError` and nothing is freed)."""
        self._free_checked(value)

    # ================================================================== match
    # ================================================================== match, insert
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key``.

        Mutates: may split the node where the match ends; refreshes access times (parent <
        child along the path) and component LRUs; Mamba may copy state into ``params.req``.
        Returns the device hit (concatenated indices; only its length with
        ``params.with_indices=False``) and the nodes that end it.  Raises
        :class:`~urc.errors.InvalidInputError` (nothing changed) for invalid params.
        """
        return matching.match_prefix(self, params)

    def path_device_indices(self, node: TreeNode) -> torch.Tensor:
        """The Full device indices on the path from the root down to ``node`` (SGLang
        0.5.23): what ``device_indices`` of a match ending at ``node`` holds, as a fresh
        tensor.  Changes nothing; valid until the next eviction unless the path is locked.
        Raises :class:`~urc.errors.InvalidInputError` when ``node`` was evicted or part of
        its path is not on device."""
        return matching.path_device_indices(self, node)

    def match_path(
        self,
        params: MatchPrefixParams,
        path: list[TreeNode],
        known: tuple[int, torch.Tensor] | None = None,
    ) -> MatchResult:
        """:meth:`match_prefix` of a key the caller knows is exactly the device path
        ``path`` (see :func:`urc.matching.match_path`)."""
        return matching.match_path(self, params, path, known)

    def insert(self, params: InsertParams, resume_from: TreeNode | None = None) -> InsertResult:
        """Insert ``params.key`` -> ``params.value`` (Full device indices); the tree takes
        ownership of the value's slots (see :func:`urc.insertion.insert` for which are kept
        and which freed, and for ``resume_from``).  Raises a subclass of
        :class:`~urc.errors.InvalidInputError` on bad input, before any change.  Returns
        ``prefix_len`` (tokens that were already cached) and the target node."""
        return insertion.insert(self, params, resume_from)

    # ================================================================== evict
    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least the requested amounts where possible (whole nodes, so maybe more).

        Never frees locked data.  Returns what was freed per component (see
        :mod:`urc.eviction`).
        """
        return eviction.evict(self, params)

    # ================================================================== host tier (HiCache)
    def attach_host_tier(self, tier: HostTier, policy: WritePolicy) -> None:
        """Give the cache a host tier: from now on device leaves with a host copy are demoted
        instead of deleted, matches report host hits, and ``policy`` decides backups."""
        self.host_tier = tier
        for c in self.components:
            c.attach_host_tier(tier)
        # A component may want a hook only with a host tier (SWA's finalize_match_result).
        self.hooks = ComponentHooks.of(self.components)
        self.write_policy = policy
        self.backup_threshold = policy.hit_threshold

    def subscribe(self, events: TierEvents) -> None:
        """Deliver the tier events (:class:`~urc.host.protocol.TierEvents`) to ``events``
        from now on (after the subscribers already there; subscribing twice delivers
        once)."""
        if events not in self.tier_events:
            self.tier_events = (*self.tier_events, events)

    def unsubscribe(self, events: TierEvents) -> None:
        """Stop delivering tier events to ``events`` (no-op if it is not subscribed)."""
        self.tier_events = tuple(e for e in self.tier_events if e is not events)

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Back ``node`` up to host now (with its ancestors that lack a copy); returns the
        tokens backed up, 0 when impossible.  (``write_back`` is accepted for SGLang.)"""
        return host_transfers.write_backup(self, node)

    def load_back(self, node: TreeNode, threshold: int = 0) -> int:
        """Load the host-only part of the path to ``node`` to device now; returns tokens
        loaded (0 when below ``threshold`` or no device memory could be found)."""
        return host_transfers.load_back(self, node, threshold)

    def evict_host(
        self, num_tokens: int, component_type: ComponentType = ComponentType.FULL
    ) -> int:
        """Free host-only leaves (no host lock), oldest first; returns Full tokens freed."""
        return host_transfers.evict_host(self, num_tokens)

    def evict_host_leaf(self, node: TreeNode, tracker: list[int]) -> None:
        """Free every host copy of the host-only leaf ``node`` and delete it."""
        host_transfers.evict_host_leaf(self, node, tracker)

    def insert_host(self, key: RadixKey, host_value: torch.Tensor, start: int) -> int:
        """Attach host data read from a lower tier (L3 storage) for ``key[start:start + n]``
        (``host_value``: ``n`` Full host slots, owned by the tree from now on); returns the
        tokens placed on new host-only nodes.  See :func:`urc.host.transfers.insert_host`."""
        return host_transfers.insert_host(self, key, host_value, start)

    def inc_host_lock_ref(self, node: TreeNode) -> None:
        """Pin ``node``'s host copy against host eviction."""
        if node.parent is not None:
            host_transfers.host_lock(self, node, 1)

    def dec_host_lock_ref(self, node: TreeNode) -> None:
        """Release :meth:`inc_host_lock_ref` (``InvalidLockError`` if not host-locked)."""
        if node.parent is not None:
            host_transfers.host_lock(self, node, -1)

    # ================================================================== locks
    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        """Protect ``node``'s data from eviction (Full: the whole path to the root).

        Returns the receipt; pass ``receipt.to_dec_params()`` to :meth:`dec_lock_ref`.
        """
        # The receipt is built field by field: its constructor's keyword parsing would cost
        # as much as a FULL lock itself.
        result = _new_object(IncLockRefResult)
        result.node_id = node.id
        result.skip_lock_node_ids = {}
        result.delta = 0  # Full sets it when the lock protects new tokens
        if node.deleted or node.parent is None:  # one test on the hot path
            if node.deleted:
                raise InvalidLockError(f"inc_lock_ref on node {node.id}, which was evicted")
            return result
        for acquire in self._acquire:
            acquire(node, result)
        return result

    def dec_lock_ref(
        self, node: TreeNode, params: DecLockRefParams | None = None
    ) -> DecLockRefResult:
        """Release a lock taken by :meth:`inc_lock_ref` (``params``: its receipt).

        Raises :class:`~urc.errors.InvalidLockError` (nothing released) when the node is not
        locked or the receipt does not fit.  Returns the Full tokens made evictable.
        """
        if node.parent is None:
            return _release_results.get(0) or _release_result(0)
        if node.deleted:
            raise InvalidLockError(f"dec_lock_ref on node {node.id}, which was evicted")
        # Identity first: a receipt holds the node's own id object, and comparing values
        # would read that (cold) int.
        if (
            params is not None
            and params.node_id is not node.id
            and params.node_id is not None
            and params.node_id != node.id
        ):
            raise InvalidLockError(
                f"receipt for node {params.node_id} used to release node {node.id}"
            )
        for check in self._check_release:
            check(node, params)
        full = self.full
        before = full.protected_size
        for release in self._release:
            release(node, params)
        delta = before - full.protected_size
        result = _release_results.get(delta)
        return _release_result(delta) if result is None else result

    def dec_swa_lock_only(self, node: TreeNode, params: DecLockRefParams | None = None) -> None:
        """Early window release: release the SWA part of a lock while Full stays locked.

        For a request whose decode moved past the window.  Components of lower priority than
        SWA release their part of the same receipt with it (``release_lock_early``), so
        ``full >= swa >= mamba`` lock counts hold.  Sets ``params.skip_swa``; the final
        :meth:`dec_lock_ref` must carry it (``cache_finished_req`` does when
        ``req.swa_lock_released`` is set).  Raises :class:`~urc.errors.InvalidLockError`
        (nothing released) for a receipt that does not fit or was already early-released,
        :class:`~urc.errors.InvalidInputError` on a cache without SWA.
        """
        swa = self._by_type.get(ComponentType.SWA)
        if swa is None:
            raise InvalidInputError("dec_swa_lock_only on a cache without an SWA component")
        if node.parent is None:
            return
        if node.deleted:
            raise InvalidLockError(f"dec_swa_lock_only on node {node.id}, which was evicted")
        if params is not None:
            if params.node_id is not None and params.node_id != node.id:
                raise InvalidLockError(
                    f"receipt for node {params.node_id} used to release node {node.id}"
                )
            if params.skip_swa:
                raise InvalidLockError("the SWA part of this lock was already released")
        swa.release_component_lock(node, params)  # validates before it releases
        prio = swa.eviction_priority(False)
        for c in self.hooks.early_release:
            if c.eviction_priority(False) < prio:
                c.release_lock_early(node, params)
        if params is not None:
            params.skip_swa = True

    # ================================================================== request caching
    def cache_finished_req(
        self, req: Req, is_insert: bool = True, *, kv_len_to_handle: int | None = None
    ) -> None:
        """Hand a finished request's KV to the tree and release everything it held;
        ``kv_len_to_handle`` caps the tokens cached (see
        :func:`urc.request_caching.cache_finished_req` for the KV ranges)."""
        request_caching.cache_finished_req(self, req, is_insert, kv_len_to_handle)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Cache the KV computed so far and move the request's lock onto it (see
        :func:`urc.request_caching.cache_unfinished_req`)."""
        request_caching.cache_unfinished_req(self, req, chunked)

    # ================================================================== sizes
    def evictable_size(self) -> int:
        """Full device tokens on unlocked nodes."""
        return self.full.evictable_size

    def protected_size(self) -> int:
        """Full device tokens on locked nodes."""
        return self.full.protected_size

    def full_evictable_size(self) -> int:
        return self.full.evictable_size

    def full_protected_size(self) -> int:
        return self.full.protected_size

    def component_evictable_size(self, ct: ComponentType) -> int:
        """Evictable device size of component ``ct`` in its unit (0 when absent)."""
        c = self._by_type.get(ct)
        return 0 if c is None else c.evictable_size

    def component_protected_size(self, ct: ComponentType) -> int:
        """Protected device size of component ``ct`` in its unit (0 when absent)."""
        c = self._by_type.get(ct)
        return 0 if c is None else c.protected_size

    def swa_evictable_size(self) -> int:
        return self.component_evictable_size(ComponentType.SWA)

    def swa_protected_size(self) -> int:
        return self.component_protected_size(ComponentType.SWA)

    def mamba_evictable_size(self) -> int:
        return self.component_evictable_size(ComponentType.MAMBA)

    def mamba_protected_size(self) -> int:
        return self.component_protected_size(ComponentType.MAMBA)

    def total_size(self) -> int:
        """Full device tokens held by the tree."""
        return self.full.evictable_size + self.full.protected_size

    def available_and_evictable_str(self) -> str:
        """Free slots plus evictable size, Full first, then one line per other component
        (SGLang's log text)."""
        full = self.full
        free, evictable = full.pool_available(), full.evictable_size
        lines = [
            f"Available full tokens: {free + evictable} "
            f"(full_available_size={free} + full_evictable_size_={evictable})"
        ]
        for c in self.components[1:]:
            free, evictable = c.pool_available(), c.evictable_size
            lines.append(
                f"Available {c.component_type.name.lower()}: {free + evictable} "
                f"(available_size={free} + component_evictable_size_={evictable})"
            )
        return "\n".join(lines) + "\n"

    def supports_swa(self) -> bool:
        return ComponentType.SWA in self._by_type

    def supports_mamba(self) -> bool:
        return ComponentType.MAMBA in self._by_type

    def is_tree_cache(self) -> bool:
        return True

    def is_chunk_cache(self) -> bool:
        return False

    def stats(self) -> CacheStats:
        """A snapshot of sizes (per component and tier) and cumulative counters; O(1) (see
        :class:`urc.stats.StatsSnapshotter`)."""
        return self._snapshots.take()

    # ================================================================== whole-tree operations
    def all_values_flatten(self) -> torch.Tensor:
        """Every Full device index held by the tree."""
        values = [
            cd.value
            for n in self.tree.nodes()
            if (cd := n.data[_FULL]) is not None and cd.value is not None
        ]
        if not values:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(values)

    def reset(self) -> None:
        """Free everything the tree holds and start empty.

        Raises :class:`~urc.errors.InvalidLockError` (nothing changed) while any node is
        locked: its slots are in use by a request.
        """
        nodes = self.tree.nodes()
        for node in nodes:
            for cd in node.data:
                if cd is not None and (cd.lock_ref or cd.host_lock_ref):
                    raise InvalidLockError(f"reset while node {node.id} is locked")
        for node in reversed(nodes):
            for c in self._components_rev:
                if c.node_has_component_data(node):
                    c.evict_component(node, Tier.DEVICE)
                if c.node_has_component_data(node, Tier.HOST):
                    c.evict_host(node)
            node.deleted = True
        self.pending_backups.clear()
        for c in self.components:
            c.reset()
        self.tree.reset()

    def sanity_check(self) -> None:
        """Recompute every invariant from scratch; ``AssertionError`` names the first broken
        one (see :func:`urc.checks.sanity_check`)."""
        checks.sanity_check(self)

    def check_pools(
        self,
        held: Mapping[ComponentType, int] | None = None,
        host_held: Mapping[ComponentType, int] | None = None,
    ) -> None:
        """Assert ``free + evictable + protected + held == capacity`` for every pool (see
        :func:`urc.checks.check_pools`)."""
        checks.check_pools(self, held, host_held)

    def pretty_print(self) -> str:
        """An indented dump of the tree (also printed)."""
        return checks.pretty_print(self)

    def iter_nodes(self) -> Sequence[TreeNode]:
        """Every node but the root (parents before children)."""
        return self.tree.nodes()


def build_cache(config: CacheConfig, pools: CachePools | None = None) -> UnifiedRadixCache:
    """A cache for ``config``, on ``pools`` (built from ``config`` when not given)."""
    return UnifiedRadixCache(config, pools if pools is not None else build_pools(config))
