"""A scheduler loop built from SGLang 0.5.23's own scheduler-side functions, driving a tree
cache the way its ``Scheduler`` does (admission, chunked prefill, decode, finish, abort,
retraction), minus the model forward.

Every step that touches the cache or the pools is SGLang's code: ``Req``'s
``init_next_round_input`` (``match_kv_cache``), ``PrefillAdder`` (``add_one_req``, which locks
the match, and ``add_chunked_req``), ``alloc_req_slots``, ``alloc_token_slots`` /
``alloc_paged_token_slots_extend`` / ``alloc_paged_token_slots_decode`` (which evict from
the tree through ``evict_from_tree_cache``), ``write_cache_indices``,
``checkpoint_kv_cache``, ``release_kv_cache`` and ``release_req`` (retraction).  What is
written here is only the batch bookkeeping ``ScheduleBatch`` would do around them.
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

__all__ = ["Pools", "SchedulerLoop", "make_context"]


class Pools:
    """SGLang's own pools on CPU: a FULL-attention model's (``kind="full"``) or a hybrid
    sliding-window model's (``"swa"``: ``SWAKVPool`` and the paired
    ``SWATokenToKVPoolAllocator``, ``window`` tokens)."""

    def __init__(
        self,
        page_size: int,
        kv_size: int,
        rows: int,
        context_len: int,
        kind: str = "full",
        window: int = 16,
        mamba_size: int = 24,
    ) -> None:
        from sglang.srt.mem_cache.allocator import (
            PagedTokenToKVPoolAllocator,
            TokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.kind = kind
        self.k0: torch.Tensor | None = None
        self.window = window
        self.mamba_size = mamba_size
        self.page_size = page_size
        self.kv_size = kv_size
        self.req_to_token_pool = ReqToTokenPool(
            size=rows, max_context_len=context_len, device="cpu", enable_memory_saver=False
        )
        if kind == "mamba":
            self._mamba_pools(rows, context_len)
            return
        if kind == "swa":
            from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
            from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

            swa_pool = SWAKVPool(
                size=kv_size, size_swa=kv_size, page_size=page_size, dtype=torch.bfloat16,
                head_num=1, head_dim=4, swa_attention_layer_ids=[0],
                full_attention_layer_ids=[1], device="cpu",
            )  # fmt: skip
            self.allocator = SWATokenToKVPoolAllocator(
                size=kv_size, size_swa=kv_size, page_size=page_size, dtype=torch.bfloat16,
                device="cpu", kvcache=swa_pool, need_sort=False,
            )  # fmt: skip
            self.k0 = swa_pool.full_kv_pool.k_buffer[0]  # the full-attention layer's K
            return
        kv_pool = MHATokenToKVPool(
            size=kv_size, page_size=page_size, dtype=torch.bfloat16, head_num=1, head_dim=4,
            layer_num=1, device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        kind = TokenToKVPoolAllocator if page_size == 1 else PagedTokenToKVPoolAllocator
        extra = {} if page_size == 1 else {"page_size": page_size}
        self.allocator = kind(
            size=kv_size, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool,
            need_sort=False, **extra,
        )  # fmt: skip
        # The "forward" writes each token's id into its K (layer 0); a matched prefix must
        # read its own tokens back (through HiCache's host copies too).
        self.k0 = kv_pool.k_buffer[0]

    def _mamba_pools(self, rows: int, context_len: int) -> None:
        """``HybridReqToTokenPool`` (Mamba state slots: ``mamba_size``) and the KV pool of
        the full-attention layers (``HybridLinearKVPool``), no extra buffer."""
        from sglang.srt.mem_cache.allocator import (
            PagedTokenToKVPoolAllocator,
            TokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

        ps = self.page_size
        self.req_to_token_pool = HybridReqToTokenPool(
            size=rows, mamba_size=self.mamba_size, mamba_spec_state_size=rows,
            max_context_len=context_len, device="cpu", enable_memory_saver=False,
            cache_params=_mamba_cache_params(), mamba_layer_ids=[0],
            enable_mamba_extra_buffer=False, speculative_num_draft_tokens=None,
        )  # fmt: skip
        kv_pool = HybridLinearKVPool(
            size=self.kv_size, dtype=torch.bfloat16, page_size=ps, head_num=1, head_dim=4,
            full_attention_layer_ids=[1], device="cpu", enable_memory_saver=False,
            mamba_pool=self.req_to_token_pool.mamba_pool,
        )  # fmt: skip
        kind = TokenToKVPoolAllocator if ps == 1 else PagedTokenToKVPoolAllocator
        extra = {} if ps == 1 else {"page_size": ps}
        self.allocator = kind(
            size=self.kv_size, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool,
            need_sort=False, **extra,
        )  # fmt: skip


def _mamba_cache_params() -> Any:
    """SGLang's state shape of a tiny Mamba2 layer (bf16 SSM state)."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs

    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=1, head_dim=8,
            state_size=2, conv_kernel=2,
        )  # fmt: skip
        return Mamba2CacheParams(shape=shape, layers=[0])


def make_context(pools: Pools, hicache: bool = False, **params: Any) -> Any:
    """SGLang's ``TreeCacheBuildContext`` of the model ``pools`` are for (``hicache``: as
    ``--enable-hierarchical-cache`` builds it)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    swa = pools.kind == "swa"
    ssm = pools.kind == "mamba"
    if swa:
        params.setdefault("sliding_window_size", pools.window)
    init = CacheInitParams(
        disable=False,
        req_to_token_pool=pools.req_to_token_pool,
        token_to_kv_pool_allocator=pools.allocator,
        page_size=pools.page_size,
        **params,
    )
    return TreeCacheBuildContext(
        server_args=None, params=init, is_hybrid_swa=swa, is_hybrid_ssm=ssm,
        enable_hierarchical_cache=hicache, disable_radix_cache=False, tp_worker=None,
        model_config=None, tp_size=1, tp_rank=0, tp_group=None,
        full_tokens_per_layer=pools.kv_size,
    )  # fmt: skip


class SchedulerLoop:
    """Requests through a tree cache with SGLang's functions (see the module docstring).

    ``running``: requests holding a row (prefilling or decoding).  After every step
    :meth:`check` asserts pool conservation and the cache's ``sanity_check()``."""

    def __init__(self, cache: Any, pools: Pools, chunk: int) -> None:
        self.cache = cache
        self.pools = pools
        self.chunk = chunk
        self.running: list[Any] = []
        # Running requests whose prompt (with the outputs of an earlier, retracted run)
        # is not fully prefilled yet.
        self.prefilling: list[Any] = []
        self.next_token = 10_000
        # Whether a check saw the tree keep fewer SWA than Full tokens (SWA tombstones).
        self.saw_swa_tombstones = False
        # The fewest free Full slots a check saw (near 0: allocations had to evict).
        self.min_free = pools.kv_size

    def decoding(self) -> list[Any]:
        return [r for r in self.running if r not in self.prefilling]

    # ------------------------------------------------------------------ requests
    def new_req(self, rid: str, tokens: list[int], max_new: int) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=max_new))

    def prefill(self, req: Any) -> bool:
        """Admit ``req`` through SGLang's ``PrefillAdder`` (a new request: its
        ``init_next_round_input`` match first, then ``add_one_req``, which locks the match;
        a running one: ``add_chunked_req``) and run the chunk it grants (at most ``chunk``
        tokens); a chunk that does not finish the prompt is checkpointed into the tree.
        False when the adder refused it (no room): nothing changed but the match."""
        from sglang.srt.managers.schedule_policy import PrefillAdder
        from sglang.srt.mem_cache import allocation
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        cache, ps = self.cache, self.pools.page_size
        adder = PrefillAdder(ps, cache, self.pools.allocator, None, 0.5, 1 << 16, self.chunk)
        fresh = not req.kv.holds_kv
        if fresh:
            req.init_next_round_input(cache)  # refreshes the fill ids, match_kv_cache
            adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        else:
            adder.add_chunked_req(req)
        if req not in adder.can_run_list:
            if fresh and req.kv.holds_mamba:  # the copy-on-write slot of the match
                release_kv_cache(req, cache, checkpoint=False)
            return False
        fill = len(req.full_untruncated_fill_ids)
        end = req.extend_end
        prefix_len = req.prefix_len
        if req.kv.holds_kv:
            row = self.pools.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            prefix = row[:prefix_len].to(torch.int64)
        elif prefix_len == 0:
            prefix = torch.empty(0, dtype=torch.int64)
        else:
            prefix = cache.prefix_device_indices(req)
        rows = allocation.alloc_req_slots(self.pools.req_to_token_pool, [req], cache)
        extend = end - prefix_len
        prefix_lens = torch.tensor([prefix_len], dtype=torch.int64)
        seq_lens = torch.tensor([end], dtype=torch.int64)
        extend_lens = torch.tensor([extend], dtype=torch.int64)
        row_idx = torch.tensor(rows, dtype=torch.int64)
        if ps == 1:
            loc = allocation.alloc_token_slots(cache, extend)
        else:
            last = prefix[-1:] if len(prefix) else torch.full((1,), -1, dtype=torch.int64)
            loc = allocation.alloc_paged_token_slots_extend(
                cache, prefix_lens, prefix_lens, seq_lens, seq_lens, last, extend
            )
        allocation.write_cache_indices(
            loc, row_idx, row_idx, prefix_lens, prefix_lens, seq_lens, seq_lens,
            extend_lens, extend_lens, [prefix], self.pools.req_to_token_pool,
        )  # fmt: skip
        k0 = self.pools.k0
        if k0 is not None:  # the prefix's KV is its own tokens'; the forward writes the rest
            tokens = torch.tensor(list(req.full_untruncated_fill_ids[:end]), dtype=k0.dtype)
            assert torch.equal(k0[prefix, 0, 0], tokens[:prefix_len]), (
                f"request {req.rid}: its cached prefix holds other tokens' KV"
            )
            k0[loc, 0, 0] = tokens[prefix_len:end]
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        if fresh:
            self.running.append(req)
            self.prefilling.append(req)
        if end < fill:
            checkpoint_kv_cache(req, cache)
        else:
            req.prefix_len = end
            self.prefilling.remove(req)
            self._sample(req)
        return True

    def decode(self, reqs: list[Any]) -> None:
        """One decode step of ``reqs`` (whose prompts are done): a slot each for the last
        sampled token (``alloc_for_decode_default``'s steps), then a new token each."""
        from sglang.srt.mem_cache import allocation

        pool = self.pools.req_to_token_pool
        if self.cache.supports_swa():  # ScheduleBatch.maybe_evict_swa, every step
            for r in reqs:
                self.cache.evict_sliding_windows(r, r.seqlen - 1)
                # (with SGLANG_OPT_RELEASE_PREFILL_SWA) past the window the prefix's SWA
                # is released from the request's lock
                if r.decode_batch_idx >= self.cache.swa_retain_window:
                    self.cache.release_swa_prefix_lock(r)
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        seq = torch.tensor([r.kv.kv_committed_len for r in reqs], dtype=torch.int64)
        if self.pools.page_size == 1:
            loc = allocation.alloc_token_slots(self.cache, len(reqs))
        else:
            last = pool.req_to_token[rows, seq - 1].to(torch.int64)
            loc = allocation.alloc_paged_token_slots_decode(self.cache, seq + 1, seq + 1, last)
        pool.write((rows, seq), loc.to(torch.int32))
        k0 = self.pools.k0
        if k0 is not None:
            k0[loc, 0, 0] = torch.tensor([r.output_ids[-1] for r in reqs], dtype=k0.dtype)
        for r in reqs:
            r.kv.kv_allocated_len += 1
            r.kv.kv_committed_len += 1
            r.decode_batch_idx += 1
            self._sample(r)

    def _sample(self, req: Any) -> None:
        self.next_token += 1
        req.output_ids.append(self.next_token % 97 + 1)

    def finish(self, req: Any) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        req.finished_len = len(req.output_ids)
        release_kv_cache(req, self.cache, checkpoint=True)
        self.running.remove(req)

    def abort(self, req: Any) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.mem_cache.common import release_kv_cache

        req.finished_reason = FINISH_ABORT()
        release_kv_cache(req, self.cache, checkpoint=False)
        self.running.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)

    def retract(self, req: Any) -> None:
        """Preempt ``req`` (SGLang's ``release_req``): its row is freed, it starts over."""
        from sglang.srt.managers.schedule_batch import release_req

        release_req(
            req=req, remaing_req_count=len(self.running) - 1,
            req_to_token_pool=self.pools.req_to_token_pool,
            token_to_kv_pool_allocator=self.pools.allocator, tree_cache=self.cache,
            hisparse_coordinator=None, offload_kv=False,
        )  # fmt: skip
        self.running.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)

    # ------------------------------------------------------------------ invariants
    def held_by_requests(self) -> tuple[int, int]:
        """Full and SWA slots the running requests hold outside the tree (whole pages; a
        page holds SWA while its first slot maps an SWA slot)."""
        ps = self.pools.page_size
        full = swa = 0
        mapping = getattr(self.pools.allocator, "full_to_swa_index_mapping", None)
        for r in self.running:
            kv = r.kv
            end = -(-kv.kv_allocated_len // ps) * ps
            full += end - kv.cache_protected_len
            if mapping is not None and end > kv.cache_protected_len:
                row = self.pools.req_to_token_pool.req_to_token[kv.req_pool_idx]
                firsts = row[kv.cache_protected_len : end : ps].to(torch.int64)
                swa += int((mapping[firsts] > 0).sum()) * ps
        return full, swa

    def check(self) -> None:
        """Every KV slot (Full, and SWA for a hybrid model) and every Mamba state slot is
        free, in the tree, or held by a running request -- once; and the cache's own
        ``sanity_check()`` passes."""
        cache = self.cache
        cache.check_hicache_events()  # the scheduler's loop does, with HiCache on
        cache.sanity_check()
        alloc = self.pools.allocator
        held_full, held_swa = self.held_by_requests()
        swa = cache.supports_swa()
        free = alloc.full_available_size() if swa else alloc.available_size()
        full_tree = cache.full_evictable_size() + cache.full_protected_size()
        self.min_free = min(self.min_free, free)
        assert free + full_tree + held_full == self.pools.kv_size, (
            f"free {free} + tree {full_tree} + held {held_full} != {self.pools.kv_size}"
        )
        if swa:
            free = alloc.swa_available_size()
            tree = cache.swa_evictable_size() + cache.swa_protected_size()
            assert free + tree + held_swa == self.pools.kv_size, (
                f"SWA: free {free} + tree {tree} + held {held_swa} != {self.pools.kv_size}"
            )
            self.saw_swa_tombstones |= tree < full_tree
        if cache.supports_mamba():
            mamba = self.pools.req_to_token_pool.mamba_allocator
            free = mamba.available_size()
            tree = cache.mamba_evictable_size() + cache.mamba_protected_size()
            held = sum(r.kv.holds_mamba for r in self.running)
            assert free + tree + held == mamba.size, (
                f"Mamba: free {free} + tree {tree} + held {held} != {mamba.size}"
            )
        rows_used = len(self.running)
        assert self.pools.req_to_token_pool.available_size() + rows_used == (
            self.pools.req_to_token_pool.size
        )
