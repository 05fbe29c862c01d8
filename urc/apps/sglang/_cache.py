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
A tree lock is SGLang's ``TreeLock`` carrying urc's receipt.

This module imports SGLang: only :func:`urc.apps.sglang.create_cache` loads it, inside an
SGLang process.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertResult,
    MatchResult,
    TreeLock,
)
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType as SGLangComponent

from urc import params as urc_params
from urc.apps.sglang._events import to_sglang_events
from urc.apps.sglang._hicache import HiCacheSurface
from urc.apps.sglang._keys import namespace, to_urc_key
from urc.cache import UnifiedRadixCache
from urc.key import RadixKey
from urc.node import ComponentType, TreeNode

__all__ = ["SGLangRadixCache"]


class SGLangRadixCache(HiCacheSurface, BasePrefixCache):  # type: ignore[misc]
    """urc's :class:`~urc.cache.UnifiedRadixCache` (``self.urc``) serving SGLang's
    scheduler.  Built by :func:`urc.apps.sglang.create_cache` from SGLang's
    ``TreeCacheBuildContext``; every method takes and returns SGLang's own objects."""

    def __init__(self, core: UnifiedRadixCache, sglang_params: Any, host: Any = None) -> None:
        self.urc = core
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
            core.enable_kv_events()

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
        """The device hit of SGLang's ``params.key`` as SGLang's ``MatchResult``; the
        indices are read later through :meth:`prefix_device_indices` (as SGLang's own)."""
        key = to_urc_key(params.key)
        if self.is_eagle:
            key = key.bigram()
        hit = self.urc.match_prefix(urc_params.MatchPrefixParams(key=key, with_indices=False))
        last = hit.last_device_node
        if params.cow_mamba and hit.device_prefix_len and not self._copy_on_write(params.req, last):
            root = self.urc.root  # no slot for the request's copy: a hit without its state
            return MatchResult(0, root, root, root)
        return MatchResult(
            device_prefix_len=hit.device_prefix_len,
            last_device_node=last,
            last_host_node=hit.last_host_node,
            best_match_node=hit.best_match_node,
            host_hit_length=hit.host_hit_length,
            mamba_branching_seqlen=hit.mamba_branching_seqlen,
            full_kv_hit_length=hit.device_prefix_len + hit.host_hit_length,
        )

    def _copy_on_write(self, req: Any, node: TreeNode) -> bool:
        """SGLang's Mamba copy-on-write at a hit on ``node``: the request gets a state slot
        of its own (evicting one unlocked state if the pool is full) and is told to start
        from the node's state (``req.kv.mamba_cow_src_index``: the forward copies it).
        False when no slot could be had."""
        if not self.urc.supports_mamba():
            return True
        src = self.urc.component(ComponentType.MAMBA).state_slot(node)  # type: ignore[attr-defined]
        if src is None:
            return True
        kv = req.kv
        if not kv.holds_mamba:
            receipt = self.urc.inc_lock_ref(node)  # the source must survive the eviction
            try:
                dst = self._alloc_mamba_slot()
            finally:
                self.urc.dec_lock_ref(node, receipt.to_dec_params())
            if dst is None:
                return False
            kv.mamba_pool_idx = dst[0]
        kv.mamba_cow_src_index = torch.tensor([src], dtype=torch.int64, device=self.device)
        kv.mamba_needs_clear = False
        return True

    def _alloc_mamba_slot(self) -> torch.Tensor | None:
        """One Mamba slot for a request, evicting one unlocked tree state if none is free."""
        allocator = self.req_to_token_pool.mamba_allocator
        slot: torch.Tensor | None = allocator.alloc(1)
        if slot is None:
            self.evict(EvictParams(mamba_num=1))
            slot = allocator.alloc(1)
        return slot

    def touch_prefix(self, key: Any) -> None:
        """Refresh recency along ``key``'s cached path (a match whose result is dropped)."""
        k = to_urc_key(key)
        self.urc.match_prefix(
            urc_params.MatchPrefixParams(key=k.bigram() if self.is_eagle else k, with_indices=False)
        )

    def insert(self, params: Any) -> InsertResult:
        """SGLang's ``InsertParams`` (``key``, ``value``, ``prev_prefix_len``,
        ``priority``): the tree takes the slots past the cached prefix and frees the
        duplicates in ``[prev_prefix_len, prefix_len)``."""
        key = to_urc_key(params.key)
        if self.is_eagle:
            key = key.bigram()
        result = self.urc.insert(
            urc_params.InsertParams(
                key=key,
                value=params.value,
                prev_prefix_len=params.prev_prefix_len,
                priority=params.priority,
            )
        )
        return InsertResult(
            prefix_len=result.prefix_len,
            total_len=result.total_len,
            last_device_node=result.last_device_node,
        )

    def path_device_indices(self, node: TreeNode) -> torch.Tensor:
        return self.urc.path_device_indices(node)

    # ================================================================== requests
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Insert the request's row ``[0, up_to)`` (page-aligned) into the tree, point the
        row at the tree's copy, move ``req.lock`` and ``req.last_node`` onto the node the
        insert ended on and advance ``req.kv.cache_protected_len`` (SGLang 0.5.23's
        ``UnifiedRadixCache.checkpoint``).  Frees only the duplicates the insert found
        (already cached tokens in ``[cache_protected_len, prefix)``); the rest of the row
        stays the request's, for ``release_kv_cache`` to free."""
        kv = req.kv
        token_ids = req.full_untruncated_fill_ids[:up_to]
        ps = self.page_size
        key = RadixKey(token_ids, namespace(req.extra_key, req.cache_salt))
        if self.is_eagle:
            key = key.bigram()
        aligned = len(key) - len(key) % ps
        mamba = self.urc.supports_mamba()
        finished = req.finished()
        if aligned <= 0:
            if mamba and finished:
                self.on_release(req, checkpointed=False)
            return
        key = key[:aligned] if aligned < len(key) else key
        insert = urc_params.InsertParams(
            key=key,
            value=None,
            prev_prefix_len=kv.cache_protected_len,
            priority=req.priority or 0,
        )
        if self.urc.supports_swa():
            self._prepare_swa(req, len(token_ids), insert)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        values = row[:aligned].to(dtype=torch.int64, copy=True)
        insert.value = values
        if mamba:
            insert.mamba_value = self._mamba_value(req, finished)
        result = self.urc.insert(insert)
        if mamba:
            self._after_mamba_insert(req, finished, insert, result.mamba_exist)
        kv.cache_inserted_len = max(kv.cache_inserted_len, aligned)
        # Split at the prompt's end so eviction can drop the output without the prompt
        # (SGLang does this for FULL-only trees).
        prompt = len(req.origin_input_ids)
        prompt_aligned = prompt - prompt % ps
        if len(self.urc.components) == 1 and not self.is_eagle and 0 < prompt_aligned < aligned:
            self.urc.insert(
                replace(
                    insert,
                    key=key[:prompt_aligned],
                    value=values[:prompt_aligned],
                    prev_prefix_len=prompt_aligned,
                    priority=insert.priority + 1,
                )
            )
        last = result.last_device_node
        assert last is not None, f"insert of {aligned} tokens ended on no node"
        path = self.urc.path_device_indices(last)
        protected = kv.cache_protected_len
        assert len(path) == aligned and protected <= aligned + ps - 1, (
            f"request {req.rid}: path {len(path)}, inserted {aligned}, protected {protected}"
        )
        if aligned > protected:
            self.req_to_token_pool.write(
                (kv.req_pool_idx, slice(protected, aligned)), path[protected:]
            )
        # Lock the new node before the old is released: both paths share the prefix.
        new_lock = self.lock(last)
        self.unlock(req.lock)
        req.lock = new_lock
        kv.cache_protected_len = aligned
        req.last_node = last

    def _mamba_value(self, req: Any, finished: bool) -> torch.Tensor:
        """The state slot a checkpoint hands the tree (SGLang's no_buffer strategy): a
        finished request donates its own; a running one a fresh copy of it."""
        own: torch.Tensor = req.kv.mamba_pool_idx.view(1).to(torch.int64)
        if finished:
            return own.clone()
        copy = self._alloc_mamba_slot()
        if copy is None:
            raise RuntimeError(f"request {req.rid}: no Mamba slot for a checkpoint's state")
        pool = self.urc.component(ComponentType.MAMBA).pool  # type: ignore[attr-defined]
        pool.copy(int(own[0]), int(copy[0]))
        return copy.to(torch.int64)

    def _after_mamba_insert(
        self, req: Any, finished: bool, insert: urc_params.InsertParams, existed: bool
    ) -> None:
        """Free the slot the tree did not take (the node had a state already); a running
        request's tracking restarts (SGLang's ``cleanup_after_caching_req``)."""
        kv = req.kv
        if finished:
            if existed:
                self.req_to_token_pool.free_mamba_cache(req)
            return
        if existed:
            assert insert.mamba_value is not None
            self.req_to_token_pool.mamba_allocator.free(insert.mamba_value)
        kv.mamba_last_track_seqlen = None
        kv.mamba_prev_track_seqlen = None

    def _prepare_swa(self, req: Any, n_tokens: int, insert: urc_params.InsertParams) -> None:
        """SGLang's SWA steps before a checkpoint's insert: a running request first frees
        its own SWA slots that slid out of the window (as ``evict_sliding_windows``), then
        the insert learns where the request's SWA stops (below: a tombstone)."""
        kv = req.kv
        if not req.finished():
            free_swa_out_of_window_slots(
                req,
                n_tokens - 1,
                sliding_window_size=self.swa_retain_window,
                page_size=self.page_size,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                retain_floor=self.swa_retain_floor(req),
            )
        insert.set_evicted_seqlen(ComponentType.SWA, kv.get_evicted_seqlen(SGLangComponent.SWA))

    def release_swa_prefix_lock(self, req: Any) -> None:
        """The request's window moved past its prefix: release the SWA part of its lock
        (the Full part stays until ``unlock``), once."""
        lock = req.lock
        if lock is None or lock.swa_released or not self.urc.supports_swa():
            return
        if lock.node.parent is not None:
            self.urc.dec_swa_lock_only(lock.node, lock.receipt)
        lock.swa_released = True

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        """The row and lock are gone; a request released without a checkpoint gives its
        Mamba state slot back (a checkpoint already gave it to the tree or freed it)."""
        if not checkpointed and self.urc.supports_mamba() and req.kv.holds_mamba:
            self.req_to_token_pool.free_mamba_cache(req)

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
        return TreeLock(node, self.urc.inc_lock_ref(node).to_dec_params())

    def unlock(self, lock: TreeLock | None) -> None:
        if lock is not None:
            self.urc.dec_lock_ref(lock.node, lock.receipt)

    # ================================================================== evict
    def evict(self, params: Any) -> EvictResult:
        """Free at least the requested amounts where possible (SGLang's ``EvictParams``:
        ``num_tokens``, ``swa_num_tokens``, ``mamba_num``)."""
        start = time.perf_counter()
        request = urc_params.EvictParams(
            num_tokens=params.num_tokens,
            swa_num_tokens=params.swa_num_tokens,
            mamba_num=params.mamba_num,
        )
        result = self.urc.evict(request)
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
