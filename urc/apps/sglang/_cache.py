"""``SGLangRadixCache``: urc's tree behind SGLang 0.5.23's ``BasePrefixCache`` surface.

SGLang's scheduler owns the pools: it allocates KV slots from its own
``token_to_kv_pool_allocator`` and request rows from its ``req_to_token_pool``, then hands
the slots to the tree (``checkpoint``) and frees what the tree did not take
(``mem_cache/common.py``: ``release_kv_cache``).  So the tree must keep and free exactly
those slots: urc's components run on SGLang's own allocators and pools, seen through thin
views with the surface they use (:mod:`urc.apps.sglang._pools`: no state of their own but
which Mamba slots the tree owns), and no urc pool sits in between -- a second pool would
hold slots SGLang's own accounting cannot see.

Node handles are urc's :class:`~urc.node.TreeNode` objects (SGLang's base-class default:
``resolve_node_handle`` is the identity; ``dfs_weight_order`` walks ``node.children``).
Requests run through the core's request layer (:mod:`urc.request_caching`: ``checkpoint``,
``release``, ``lock`` / ``unlock``) on a view of SGLang's ``Req``
(:class:`~urc.apps.sglang._req_view.SGLangRequest`); a request's ``req.lock`` is urc's
:class:`~urc.lock_receipts.TreeLock`, opaque to SGLang's scheduler.  This module translates
(SGLang objects in, SGLang objects out) and holds no tree logic.

This module imports SGLang: only :func:`urc.apps.sglang.create_cache` loads it, inside an
SGLang process.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefResult,
    EvictResult,
    IncLockRefResult,
    InsertResult,
    MatchResult,
)
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots

from urc import params as urc_params
from urc.apps.sglang._events import to_sglang_events
from urc.apps.sglang._hicache import HiCacheSurface
from urc.apps.sglang._keys import to_urc_key
from urc.apps.sglang._params import to_urc_evict, to_urc_insert, to_urc_match
from urc.apps.sglang._req_view import SGLangRequest
from urc.cache import UnifiedRadixCache
from urc.lock_receipts import TreeLock
from urc.node import ComponentType, TreeNode

__all__ = ["SGLangRadixCache"]


class SGLangRadixCache(HiCacheSurface, BasePrefixCache):  # type: ignore[misc]
    """urc's :class:`~urc.cache.UnifiedRadixCache` (``self.urc``) serving SGLang's
    scheduler.  Built by :func:`urc.apps.sglang.create_cache` from SGLang's
    ``TreeCacheBuildContext``; every method takes and returns SGLang's own objects."""

    def __init__(self, core: UnifiedRadixCache, sglang_params: Any, host: Any = None) -> None:
        self.urc = core
        self._kinds = tuple(core.by_type)  # the component kinds of this tree
        #: urc's host tier (HiCache L2, ``hicache.host_tier.HostMemoryTier``) or None.
        self.host = host
        self.init_hicache_surface()
        self.req_to_token_pool = sglang_params.req_to_token_pool
        self.token_to_kv_pool_allocator = sglang_params.token_to_kv_pool_allocator
        self.page_size = core.page_size
        self.disable = False
        self.is_eagle = core.is_eagle
        self.sliding_window_size = sglang_params.sliding_window_size
        self.draft_swa_window = sglang_params.draft_swa_window
        self.enable_session_radix_cache = False
        # Surfaces of SGLang's own UnifiedRadixCache that urc does not offer here
        # (external linker, host pool group): None tells the scheduler so.
        self.linker = None
        self.host_pool_group = None
        self.device = core.device
        if sglang_params.enable_metrics:
            self.init_metrics_collector()
        if sglang_params.enable_kv_cache_events:  # --kv-events-config, on a publisher rank
            # SGLang's cache resets itself at construction: a router hears AllBlocksCleared
            # and drops what it believed about a restarted worker.
            core.enable_kv_events().cleared()

    # ================================================================== structure
    @property
    def root_node(self) -> TreeNode:
        return self.urc.root

    def is_root(self, node: TreeNode | None) -> bool:
        return node is None or node.parent is None

    def reset(self) -> None:
        self.wait_for_backups()  # their pins would refuse the reset
        self.urc.reset()

    def take_events(self) -> list[Any]:
        """The KV events recorded since the last call, oldest first, as SGLang's own
        ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (what its scheduler
        publishes each batch); empty while events are off."""
        return to_sglang_events(self.urc.take_events())

    def supports_swa(self) -> bool:
        return self.urc.supports_swa()

    def supports_mamba(self) -> bool:
        return self.urc.supports_mamba()

    def supports_prefix_sharing(self) -> bool:
        return True

    def supports_fast_match_prefix(self) -> bool:
        return False

    # ================================================================== match, insert
    def match_prefix(self, params: Any) -> MatchResult:
        """The device hit of SGLang's ``params`` (every field served:
        :func:`~urc.apps.sglang._params.to_urc_match`) as SGLang's ``MatchResult``; the
        indices are read later through :meth:`prefix_device_indices` (as SGLang's own).
        ``cow_mamba`` with ``req``: the core's copy-on-write gives the request the hit's
        state (SGLang's forward copies it), or a miss when no slot can be had."""
        hit = self.urc.match_prefix(to_urc_match(params, self.is_eagle, self.device))
        return MatchResult(
            device_prefix_len=hit.device_prefix_len,
            last_device_node=hit.last_device_node,
            last_host_node=hit.last_host_node,
            best_match_node=hit.best_match_node,
            host_hit_length=hit.host_hit_length,
            mamba_branching_seqlen=hit.mamba_branching_seqlen,
            full_kv_hit_length=hit.device_prefix_len + hit.host_hit_length,
        )

    def touch_prefix(self, key: Any) -> None:
        """Refresh recency along ``key``'s cached path (a match whose result is dropped)."""
        k = to_urc_key(key)
        self.urc.match_prefix(
            urc_params.MatchPrefixParams(key=k.bigram() if self.is_eagle else k, with_indices=False)
        )

    def insert(self, params: Any) -> InsertResult:
        """SGLang's ``InsertParams``, every field served or refused
        (:func:`~urc.apps.sglang._params.to_urc_insert`: an unserved field set away from its
        default raises :class:`~urc.errors.UnsupportedParamError` naming it, nothing
        changed): the tree takes the slots past the cached prefix and frees the duplicates
        in ``[prev_prefix_len, prefix_len)``; a Mamba node adopts ``mamba_value`` unless it
        has a state (``mamba_exist``: the slot stays the caller's)."""
        request = to_urc_insert(params, self._kinds, self.is_eagle)
        result = self.urc.insert(request)
        branching = params.swa_branching_seqlen
        return InsertResult(
            prefix_len=result.prefix_len,
            total_len=result.total_len,
            last_device_node=result.last_device_node,
            mamba_exist=result.mamba_exist,
            swa_branch_inserted=(
                branching is not None
                and self.urc.supports_swa()
                and request.key is not None
                and len(request.key) >= branching
            ),
            inserted_host_node=result.inserted_host_node,
        )

    def path_device_indices(self, node: TreeNode) -> torch.Tensor:
        return self.urc.path_device_indices(node)

    # ================================================================== requests
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """SGLang 0.5.23's ``checkpoint``: the core's
        :func:`~urc.request_caching.checkpoint` on the request's view (insert ``[0,
        up_to)`` page-aligned, point the row at the tree's copy, move ``req.lock`` and
        ``req.last_node``, advance ``req.kv.cache_protected_len``; a finished request's
        Mamba state goes to the tree).  A running SWA request first frees its own slots
        that slid out of the window, with SGLang's own function (its retain floor)."""
        finished = req.finished()
        if self.urc.supports_swa() and not finished:
            free_swa_out_of_window_slots(
                req,
                min(up_to, len(req.full_untruncated_fill_ids)) - 1,
                sliding_window_size=self.swa_retain_window,
                page_size=self.page_size,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                retain_floor=self.swa_retain_floor(req),
            )
        result = self.urc.checkpoint(SGLangRequest(req, self.device), up_to, finished=finished)
        if result is not None:
            kv = req.kv
            kv.cache_inserted_len = max(kv.cache_inserted_len, kv.cache_protected_len)

    def release_swa_prefix_lock(self, req: Any) -> None:
        """The request's window moved past its prefix: release the SWA part of its lock
        (the Full part stays until ``unlock``), once."""
        if self.urc.supports_swa():
            self.urc.release_swa(req.lock)

    def release_swa(self, lock: TreeLock | None) -> None:
        """Release the SWA part of ``lock`` early, once."""
        if self.urc.supports_swa():
            self.urc.release_swa(lock)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        """The row and lock are gone (SGLang's ``release_kv_cache``): the core's
        :func:`~urc.request_caching.release` gives back what the request still holds (a
        Mamba state slot, unless its checkpoint handed it to the tree)."""
        self.urc.release(SGLangRequest(req, self.device), checkpointed=checkpointed)

    def claim_kv_row(self, req: Any) -> bool:
        return False

    # ================================================================== locks
    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        """SGLang's receipt wrapping urc's (``node_id``, and urc's receipt as the only
        component entry: ``to_dec_params`` hands it back to :meth:`dec_lock_ref`)."""
        receipt = self.urc.inc_lock_ref(node)
        result = IncLockRefResult(delta=receipt.delta, node_id=node.id)
        result.component_lock_uuids[ComponentType.FULL] = receipt
        return result

    def dec_lock_ref(self, node: TreeNode, params: Any = None) -> DecLockRefResult:
        receipt = None
        if params is not None:
            held = params.component_lock_uuids.get(ComponentType.FULL)
            receipt = held.to_dec_params() if held is not None else None
        return DecLockRefResult(delta=self.urc.dec_lock_ref(node, receipt).delta)

    def lock(self, node: TreeNode, skip_lock_components: Any = ()) -> TreeLock:
        """Lock ``node``'s path for one holder (``unlock`` releases it)."""
        return self.urc.lock(node)

    def unlock(self, lock: TreeLock | None) -> None:
        self.urc.unlock(lock)

    # ================================================================== evict
    def evict(self, params: Any) -> EvictResult:
        """Free at least the requested amounts where possible (SGLang's ``EvictParams``:
        ``num_tokens``, ``swa_num_tokens``, ``mamba_num``)."""
        start = time.perf_counter()
        result = self.urc.evict(to_urc_evict(params))
        short = params.num_tokens - result.num_tokens_evicted
        if short > 0 and self.host is not None and self._free_host(short):
            # Write-back demotes a leaf only into free host slots: make room, go on.
            more = self.urc.evict(urc_params.EvictParams(num_tokens=short))
            result = result._replace(
                num_tokens_evicted=result.num_tokens_evicted + more.num_tokens_evicted
            )
        self.update_eviction_metrics(result.num_tokens_evicted, start)
        return EvictResult(
            num_tokens_evicted=result.num_tokens_evicted,
            swa_num_tokens_evicted=result.swa_num_tokens_evicted,
            mamba_num_evicted=result.mamba_num_evicted,
        )

    # ================================================================== sizes
    def evictable_size(self) -> int:
        return self.urc.evictable_size()

    def protected_size(self) -> int:
        return self.urc.protected_size()

    def full_evictable_size(self) -> int:
        return self.urc.full_evictable_size()

    def full_protected_size(self) -> int:
        return self.urc.full_protected_size()

    def swa_evictable_size(self) -> int:
        return self.urc.swa_evictable_size()

    def swa_protected_size(self) -> int:
        return self.urc.swa_protected_size()

    def mamba_evictable_size(self) -> int:
        return self.urc.mamba_evictable_size()

    def mamba_protected_size(self) -> int:
        return self.urc.mamba_protected_size()

    def total_size(self) -> int:
        return self.urc.total_size()

    def all_values_flatten(self) -> torch.Tensor:
        return self.urc.all_values_flatten()

    def available_and_evictable_str(self) -> str:
        return self.urc.available_and_evictable_str()

    def sanity_check(self) -> None:
        self.urc.sanity_check()

    def pretty_print(self) -> None:
        self.urc.pretty_print()

    # ================================================================== sessions
    # Session radix caching (``--enable-session-radix-cache``) is refused at start-up;
    # a session's id is accepted and changes nothing.
    def open_radix_session(self, session_id: str) -> int | None:
        return None

    def ensure_session_generation(self, session_id: str) -> int:
        return 0

    def release_radix_session(self, session_id: str) -> int:
        return 0
