"""``CacheState``: everything one cache holds, for the operations to work on.

The operation modules (:mod:`urc.locking`, :mod:`urc.matching`, :mod:`urc.insertion`,
:mod:`urc.eviction`, :mod:`urc.request_caching`, :mod:`urc.host.transfers`) are functions of a
``CacheState``; :class:`~urc.cache.UnifiedRadixCache` is a ``CacheState`` plus SGLang's method
surface, and no operation imports it.  An operation never calls back up: it calls the other
operations' functions, or a hook the state holds (``write_back``, set when a host tier is
attached).

What lives here (set once by ``__init__`` unless noted):

| field | what |
|---|---|
| ``config``, ``pools``, ``page_size``, ``device``, ``on_cpu``, ``is_eagle`` | as built |
| ``tree`` | the node structure, the clock and the key walks (:class:`~urc.tree.Tree`) |
| ``components``, ``full``, ``by_type``, ``components_rev`` | the component objects, FULL first |
| ``hooks`` | per-hook lists of the components that override it (rebuilt on attach) |
| ``acquire_locks``, ``release_locks``, ``release_checks`` | the lock hooks, in call order |
| ``counters`` | cumulative counters (:class:`~urc.counters.CacheCounters`) |
| ``host_tier``, ``write_policy``, ``backup_threshold`` | HiCache, once attached |
| ``pending_backups``, ``backups_in_flight``, ``tier_events`` | HiCache bookkeeping |
| ``write_back`` | back a node up to host now (set by the host tier's attach), or None |
| ``kv_events`` | the KV event recorder (:mod:`urc.kv_events`), or None: events off |
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from urc.components import component_class
from urc.components.base import EvictionSteps, TreeComponent
from urc.components.full import FullComponent
from urc.config import CacheConfig
from urc.counters import CacheCounters
from urc.fastpath import select_match_tail, select_walk
from urc.hooks import ComponentHooks
from urc.host_protocol import HostTier, TierEvents, WritePolicy
from urc.node import NUM_COMPONENT_TYPES, ComponentData, ComponentType, TreeNode
from urc.pools.cache_pools import CachePools
from urc.tree import Tree

if TYPE_CHECKING:
    from urc.kv_events.recorder import KVEventRecorder

__all__ = ["CacheState"]


class CacheState:
    """The tree, its components and hooks, the pools' fast paths, counters and host-tier
    fields of one cache (see the module docstring)."""

    # Slots: every operation reads these fields, and the lock and match paths several per
    # call.  CPython 3.11 keeps at most 30 attributes in a shared-key instance dict; past
    # that, each load goes through a dict lookup with a hint (the fields grew to 33 and
    # the bench's lock phase lost 10-13%).  A slot load is one offset, however many fields.
    # ``__dict__`` stays for attributes others set on a cache (a subclass, a test's patch),
    # ``__weakref__`` for the registries keyed weakly by cache (hicache's storage workers).
    __slots__ = (
        "__dict__",
        "__weakref__",
        "acquire_locks",
        "backup_threshold",
        "backups_in_flight",
        "by_type",
        "claim_value",
        "components",
        "components_rev",
        "config",
        "counters",
        "device",
        "evictor",
        "free_checked",
        "free_owned",
        "free_span",
        "full",
        "hooks",
        "host_tier",
        "is_eagle",
        "kv_events",
        "no_indices",
        "on_cpu",
        "page_size",
        "pending_backups",
        "pools",
        "release_checks",
        "release_locks",
        "req_to_token_pool",
        "tier_events",
        "token_to_kv_pool_allocator",
        "tree",
        "write_back",
        "write_policy",
    )

    def __init__(
        self,
        config: CacheConfig,
        pools: CachePools,
        eviction_steps: Callable[[CacheState], EvictionSteps],
    ) -> None:
        """Build the tree and the components on ``pools``; ``eviction_steps(state)`` gives
        the components the cache-wide eviction steps (:class:`urc.eviction.Evictor`: passed
        in, so that this module stays below the operations)."""
        self.config = config
        self.pools = pools
        self.page_size = config.page_size
        #: The device of index tensors: the token allocator's (urc's own pools keep indices
        #: on the host whatever ``config.device`` is: :mod:`urc.pools.indices`).
        self.device = torch.device(getattr(pools.token_allocator, "device", config.device))
        #: A miss's pending indices concatenate this (a fresh empty tensor each read).
        self.no_indices = torch.empty(0, dtype=torch.int64, device=self.device)
        #: Index tensors live in host memory (numpy views of them are free).
        self.on_cpu = self.device.type == "cpu"
        self.is_eagle = config.is_eagle
        self.req_to_token_pool = pools.req_to_token_pool
        self.token_to_kv_pool_allocator = alloc = pools.token_allocator
        #: Free slots a caller holds (checked: a slot that is not allocated raises).
        self.free_checked: Callable[[torch.Tensor], None] = alloc.free
        # Tree-owned slots were checked when the tree adopted them (insert): free them
        # without re-validating.  Allocators of callers' own pools may lack the fast path.
        self.free_owned: Callable[[torch.Tensor], None] = getattr(alloc, "free_owned", alloc.free)
        # The allocator's optional fast paths, probed once (an SGLang allocator has neither):
        # ``claim_value`` checks an insert's value and adopts its pages in one pass,
        # ``free_span`` frees a span of a value without slicing the tensor.
        self.claim_value: Callable[..., Any] | None = getattr(alloc, "claim_value", None)
        self.free_span: Callable[..., None] | None = getattr(alloc, "free_span", None)
        use_page_ops = getattr(alloc, "use_page_ops", None)
        if use_page_ops is not None:  # the page bookkeeping follows the walk (urc.pools.pageops)
            use_page_ops(config.walk_impl)
        self.counters = CacheCounters()
        # HiCache (``attach_host_tier``): nodes may then live on device, host, or both.
        self.host_tier: HostTier | None = None
        self.write_policy: WritePolicy | None = None
        self.backup_threshold: int | None = None
        #: Back a node (and its ancestors without a copy) up to host now; returns the tokens
        #: backed up, 0 when impossible.  Set with the host tier (eviction under write-back).
        self.write_back: Callable[[TreeNode], int] | None = None
        # Nodes whose hit count reached the write-through threshold, waiting for a backup,
        # oldest first (``urc.host.transfers``: served in that order, evicted ones pruned).
        self.pending_backups: OrderedDict[int, TreeNode] = OrderedDict()
        self.backups_in_flight: set[int] = set()
        # The tiers below device that listen (``subscribe``): see ``urc.host_protocol.TierEvents``.
        self.tier_events: tuple[TierEvents, ...] = ()
        #: KV events for routers (``enable_kv_events``); None: off, and the operations'
        #: emission sites cost one attribute test.
        self.kv_events: KVEventRecorder | None = None
        # The tree's structure and the eviction steps first: components are built with them.
        self.tree = tree = Tree(
            config.page_size,
            config.is_eagle,
            self.device,
            select_walk(config.walk_impl, packed=not config.is_eagle),
            select_match_tail(config.walk_impl),
        )
        self.evictor = eviction_steps(self)
        self.components: list[TreeComponent] = [
            component_class(ct)(tree, pools, config, self.evictor) for ct in config.types
        ]
        full = self.components[0]
        assert isinstance(full, FullComponent), f"the first component is {full!r}, not FULL"
        self.full: FullComponent = full
        self.components_rev = self.components[::-1]
        self.by_type: dict[ComponentType, TreeComponent] = {
            c.component_type: c for c in self.components
        }
        comps = self.components
        self.hooks = hooks = ComponentHooks.of(comps)
        # Lock hooks as bound methods: a lock or an unlock is a handful of attribute loads,
        # so the per-component method lookup is worth saving.
        self.acquire_locks = [c.acquire_component_lock for c in comps]
        self.release_locks = [c.release_component_lock for c in self.components_rev]
        # The component released first validates inside its own release (the hook contract:
        # raise before changing anything), so only the later ones need a separate check --
        # not Full's (released last) when every release before it that changes anything
        # proves the Full lock: then a failing Full release follows only releases that
        # changed nothing.
        first = self.components_rev[0]
        full_implied = all(
            c.release_implies_full_lock for c in self.components_rev if c is not full
        )
        self.release_checks = [
            c.check_release
            for c in hooks.release_checks
            if c is not first and not (c is full and full_implied)
        ]
        tree.bind(self._new_data, [c.redistribute_on_node_split for c in comps])

    def _new_data(self) -> tuple[ComponentData | None, ...]:
        data: list[ComponentData | None] = [None] * NUM_COMPONENT_TYPES
        for c in self.components:
            data[c.component_type] = c.new_data()
        return tuple(data)

    def component(self, ct: ComponentType) -> TreeComponent:
        """The component of type ``ct`` (``KeyError`` if the cache was built without it)."""
        return self.by_type[ct]

    def has_component(self, ct: ComponentType) -> bool:
        return ct in self.by_type
