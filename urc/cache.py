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

from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch

from urc import checks, eviction, insertion, locking, matching, request_caching
from urc.config import CacheConfig, build_pools
from urc.errors import InvalidLockError, OutOfMemoryError
from urc.hooks import ComponentHooks
from urc.host import transfers as host_transfers
from urc.host_protocol import HostTier, TierEvents, WritePolicy
from urc.key import RadixKey
from urc.kv_events import KVEvent, KVEventRecorder
from urc.node import FULL_INDEX, ComponentType, Tier, TreeNode
from urc.params import (
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from urc.pools.cache_pools import CachePools
from urc.req import Req
from urc.request_protocol import CachingRequest
from urc.reuse_hint import ReuseHint
from urc.state import CacheState
from urc.stats import CacheStats, StatsSnapshotter

__all__ = ["UnifiedRadixCache", "build_cache"]


class UnifiedRadixCache(CacheState):
    """The radix tree and its components (see the module docstring).

    A :class:`~urc.state.CacheState` (the fields every operation works on) with SGLang's
    method surface; each method forwards to the operation module that owns it.
    """

    __slots__ = ("_snapshots",)

    def __init__(self, config: CacheConfig, pools: CachePools) -> None:
        super().__init__(config, pools, eviction.Evictor)
        self._snapshots = StatsSnapshotter(self)

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

    def free_request_kv(self, value: torch.Tensor) -> None:
        """Free Full slots a request holds (checked: a slot that is not allocated raises
        :class:`~urc.errors.DoubleFreeError` and nothing is freed)."""
        self.free_checked(value)

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

    def alloc_tokens(self, num_tokens: int, evict: bool = True) -> torch.Tensor | None:
        """Full slots for ``num_tokens`` tokens, evicting what every pool lacks first when
        short and ``evict`` (see :func:`urc.eviction.alloc_tokens`); None when they cannot
        be had.

        Raises :class:`~urc.errors.OutOfMemoryError` (nothing evicted) when ``num_tokens``
        exceeds the whole Full pool: no eviction could make room."""
        if eviction.exceeds_pool(self, num_tokens):
            raise OutOfMemoryError(
                f"cannot allocate {num_tokens} slots: larger than the whole pool "
                f"({self.token_to_kv_pool_allocator.size} slots); nothing was evicted"
            )
        return eviction.alloc_tokens(self, num_tokens, evict)

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
        # Eviction under write-back backs a leaf up through this hook: the transfer itself,
        # bound to this state (eviction never imports the transfers, nor goes through the
        # facade).
        self.write_back = partial(host_transfers.write_backup, self)

    def subscribe(self, events: TierEvents) -> None:
        """Deliver the tier events (:class:`~urc.host_protocol.TierEvents`) to ``events``
        from now on (after the subscribers already there; subscribing twice delivers
        once)."""
        if events not in self.tier_events:
            self.tier_events = (*self.tier_events, events)

    def unsubscribe(self, events: TierEvents) -> None:
        """Stop delivering tier events to ``events`` (no-op if it is not subscribed)."""
        self.tier_events = tuple(e for e in self.tier_events if e is not events)

    def write_backup(self, node: TreeNode) -> int:
        """Back ``node`` up to host now (with its ancestors that lack a copy); returns the
        tokens backed up, 0 when impossible."""
        return host_transfers.write_backup(self, node)

    def load_back(self, node: TreeNode, threshold: int = 0) -> int:
        """Load the host-only part of the path to ``node`` to device now; returns tokens
        loaded (0 when below ``threshold`` or no device memory could be found)."""
        return host_transfers.load_back(self, node, threshold)

    def evict_host(self, num_tokens: int) -> int:
        """Free host-only leaves (no host lock), oldest first; returns Full tokens freed."""
        return eviction.evict_host(self, num_tokens)

    def evict_host_leaf(self, node: TreeNode, tracker: list[int]) -> None:
        """Free every host copy of the host-only leaf ``node`` and delete it."""
        eviction.evict_host_leaf(self, node, tracker)

    def insert_host(self, key: RadixKey, host_value: torch.Tensor, start: int) -> int:
        """Attach host data read from a lower tier (L3 storage) for ``key[start:start + n]``
        (``host_value``: ``n`` Full host slots, owned by the tree from now on); returns the
        tokens placed on new host-only nodes.  See :func:`urc.host.transfers.insert_host`."""
        return host_transfers.insert_host(self, key, host_value, start)

    def inc_host_lock_ref(self, node: TreeNode) -> None:
        """Pin ``node``'s host copy against host eviction."""
        if node.parent is not None:
            locking.host_lock(self, node, 1)

    def dec_host_lock_ref(self, node: TreeNode) -> None:
        """Release :meth:`inc_host_lock_ref` (``InvalidLockError`` if not host-locked)."""
        if node.parent is not None:
            locking.host_lock(self, node, -1)

    # ================================================================== locks
    # The lock operations themselves, as methods (no forwarding call on the hot path): see
    # :mod:`urc.locking` for their contracts.
    inc_lock_ref = locking.inc_lock_ref
    dec_lock_ref = locking.dec_lock_ref
    dec_swa_lock_only = locking.dec_swa_lock_only

    # ================================================================== the request layer
    # SGLang 0.5.23's request surface, over any ``CachingRequest`` (see
    # :mod:`urc.request_caching` for the contracts).
    lock = request_caching.lock
    unlock = request_caching.unlock
    move_lock = request_caching.move_lock
    release_swa = request_caching.release_swa

    def checkpoint(
        self, req: CachingRequest, up_to: int, *, finished: bool = False
    ) -> InsertResult | None:
        """Insert ``req``'s ``[0, up_to)`` and move its lock onto it
        (:func:`urc.request_caching.checkpoint`)."""
        return request_caching.checkpoint(self, req, up_to, finished=finished)

    def release(self, req: CachingRequest, *, checkpointed: bool) -> None:
        """Release ``req``'s lock and (unless ``checkpointed``) its component state
        (:func:`urc.request_caching.release`)."""
        request_caching.release(self, req, checkpointed=checkpointed)

    def cache_finished_req(
        self,
        req: Req,
        is_insert: bool = True,
        *,
        kv_len_to_handle: int | None = None,
        hint: ReuseHint | None = None,
    ) -> None:
        """Hand a finished request's KV to the tree and release everything it held;
        ``kv_len_to_handle`` caps the tokens cached; ``hint`` tells the eviction policy
        when the prefix is likely used next (``urc.reuse_hint``; see
        :func:`urc.request_caching.cache_finished_req` for the KV ranges)."""
        request_caching.cache_finished_req(self, req, is_insert, kv_len_to_handle, hint)

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
        c = self.by_type.get(ct)
        return 0 if c is None else c.evictable_size

    def component_protected_size(self, ct: ComponentType) -> int:
        """Protected device size of component ``ct`` in its unit (0 when absent)."""
        c = self.by_type.get(ct)
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
        return ComponentType.SWA in self.by_type

    def supports_mamba(self) -> bool:
        return ComponentType.MAMBA in self.by_type

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
            if (cd := n.data[FULL_INDEX]) is not None and cd.value is not None
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
            for c in self.components_rev:
                if c.node_has_component_data(node):
                    c.evict_component(node, Tier.DEVICE)
                if c.node_has_component_data(node, Tier.HOST):
                    c.evict_host(node)
            node.deleted = True
        self.pending_backups.clear()
        for c in self.components:
            c.reset()
        self.tree.reset()
        if self.kv_events is not None:
            self.kv_events.cleared()

    # ================================================================== KV events
    def enable_kv_events(self, notify: Callable[[], None] | None = None) -> KVEventRecorder:
        """Record KV events from now on (:mod:`urc.kv_events`; SGLang's
        ``enable_kv_cache_events``) and return the recorder; already on: the same recorder,
        its ``notify`` replaced when one is given.  ``notify`` is called from the cache's
        owner when the event queue goes from empty to non-empty (it must not change the
        tree)."""
        rec = self.kv_events
        if rec is None:
            rec = self.kv_events = KVEventRecorder(self.page_size, notify)
        elif notify is not None:
            rec.notify = notify
        return rec

    def disable_kv_events(self) -> None:
        """Stop recording KV events; events not taken yet are dropped."""
        self.kv_events = None

    def take_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call, oldest first (SGLang's
        ``take_events``); empty while events are off."""
        rec = self.kv_events
        return rec.take() if rec is not None else []

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
