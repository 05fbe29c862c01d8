"""Build urc from SGLang's ``TreeCacheBuildContext`` (the ``--radix-cache-backend urc``
factory), refusing at start-up every option it does not serve."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from urc.apps.sglang._hicache_options import (
    hicache_config,
    hicache_refusals,
    start_layerwise_load_back,
    start_storage,
    storage_refusals,
    transfer_engine,
)
from urc.cache import UnifiedRadixCache
from urc.config import CacheConfig
from urc.errors import ConfigError
from urc.eviction_policy import EvictionPolicy, policy_parameters
from urc.node import ComponentType
from urc.pools.cache_pools import CachePools
from urc.specs import ComponentSpec, MambaSpec, SlidingWindowSpec

__all__ = ["check_supported", "create_cache", "unsupported_options"]

# SGLang's ``--radix-eviction-policy`` values urc implements: an ``EvictionPolicy`` member of
# the same name (urc's own offline or experimental orders are not SGLang's to select).
_NOT_SGLANG = {EvictionPolicy.BELADY, EvictionPolicy.FORK_AWARE, EvictionPolicy.SESSION_AWARE}


def _policy(name: str) -> EvictionPolicy | None:
    try:
        policy = EvictionPolicy(name)
    except ValueError:
        return None
    return None if policy in _NOT_SGLANG else policy


def _memory() -> Any:
    from sglang.srt.runtime_context import get_memory

    return get_memory()


def unsupported_options(ctx: Any) -> list[str]:
    """The launch options in ``ctx`` (and the published server args) that urc does not
    serve, each as ``"--flag: why"``; empty when urc can run this configuration."""
    params = ctx.params
    memory = _memory()
    out: list[str] = []
    if ctx.disable_radix_cache or params.disable:
        out.append("--disable-radix-cache: nothing to plug in (SGLang's own cache serves it)")
    if ctx.enable_hierarchical_cache or memory.enable_hierarchical_cache:
        out.extend(_unsupported_hicache(ctx, memory))
    if ctx.is_hybrid_swa and ctx.full_tokens_per_layer == 0:
        out.append("a pure sliding-window model: SGLang serves it with its PureSWARadixCache")
    if ctx.is_hybrid_swa and getattr(params.token_to_kv_pool_allocator, "swa_req_ring", False):
        out.append("a per-request SWA ring (unified_kv): the tree holds no SWA slots there")
    if ctx.is_hybrid_swa and not params.swa_gates_prefix_match:
        out.append("an SWA pool only a draft reads: its matches are not gated by the window")
    if ctx.is_hybrid_ssm:
        pool = params.req_to_token_pool
        if ctx.is_hybrid_swa:
            out.append("a model with both sliding-window and Mamba layers: not wired yet")
        if params.enable_mamba_extra_buffer or params.enable_mamba_extra_buffer_lazy:
            out.append(
                "--mamba-radix-cache-strategy extra_buffer: urc serves no_buffer "
                "(the request's ping-pong track buffers are not wired yet)"
            )
        if getattr(pool, "mamba_ckpt_pool", None) is not None:
            out.append("--enable-int8-mamba-checkpoint: the int8 checkpoint pool is not wired")
        mamba_pool = getattr(pool, "mamba_pool", None)
        if getattr(mamba_pool, "replayssm_write_pos", None) is not None:
            out.append("a ReplaySSM (GDN) Mamba pool: its state lags the ring, not wired")
        if params.mtp_draft_mamba_pools:
            out.append("speculative draft Mamba pools: only SGLang's own cache copies them")
    if ctx.is_dsa or hasattr(params.req_to_token_pool, "req_to_c128_sidecar"):
        out.append("a DeepSeek sparse-attention model: its sidecar pools are SGLang's own")
    if _policy(params.eviction_policy) is None:
        served = ", ".join(p.value for p in EvictionPolicy if p not in _NOT_SGLANG)
        out.append(f"--radix-eviction-policy {params.eviction_policy}: urc serves {served}")
    policy = _policy(params.eviction_policy)
    if policy is not None and params.eviction_policy_config:
        # SGLang's names are the strategies' keyword arguments (urc.eviction_policy).
        takes = policy_parameters(policy)
        for key in params.eviction_policy_config:
            if key not in takes:
                out.append(
                    f"--radix-eviction-policy-config: {key!r} is not a parameter of urc's "
                    f"{policy.value} (it takes {', '.join(takes) or 'none'})"
                )
    if params.enable_session_radix_cache or memory.enable_session_radix_cache:
        out.append("--enable-session-radix-cache: SGLang's session refs are its own")
    if params.is_eagle:
        out.append("--speculative-algorithm EAGLE: bigram keys are not wired yet")
    if params.mtp_draft_device_pools or params.sidecar_draft_device_pools:
        out.append("speculative draft KV pools: only SGLang's own cache copies them")
    if params.pp_size > 1 or params.attn_cp_size > 1:
        out.append("--pp-size / --attn-cp-size > 1: the tree is not synchronised across ranks")
    if memory.enable_lmcache or memory.enable_flexkv:
        out.append("--enable-lmcache / --enable-flexkv: those are SGLang's own backends")
    if memory.enable_unified_cache_external_linker:
        out.append("--enable-unified-cache-external-linker: SGLang's own linker")
    return out


def _unsupported_hicache(ctx: Any, memory: Any) -> list[str]:
    """What urc's host tier (HiCache L2, synchronous copies) cannot serve of SGLang's
    HiCache options."""
    out = []
    if ctx.is_hybrid_ssm:
        out.append("--enable-hierarchical-cache with a Mamba model")
    kv = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    halves = [kv.full_kv_pool, kv.swa_kv_pool] if ctx.is_hybrid_swa else [kv]
    if not all(isinstance(getattr(h, "k_buffer", None), list) for h in halves):
        out.append(
            f"--enable-hierarchical-cache with a {type(kv).__name__}: urc mirrors "
            "per-layer K/V buffers (MHATokenToKVPool) only"
        )
    if memory.hicache_host_memory_mode != "cache":
        out.append(f"--hicache-host-memory-mode {memory.hicache_host_memory_mode}")
    out.extend(hicache_refusals(memory))
    out.extend(storage_refusals(ctx, memory))
    return out


def _hicache_config(allocator: Any, memory: Any) -> Any:
    """urc's ``HiCacheConfig`` for SGLang's ``--hicache-*`` options (see
    :func:`urc.apps.sglang._hicache_options.hicache_config`)."""
    from urc.apps.sglang._pools import SGLangKVBuffers

    kvcache = allocator.get_kvcache()
    per_slot = SGLangKVBuffers(getattr(kvcache, "full_kv_pool", kvcache)).bytes_per_slot()
    return hicache_config(memory, per_slot)


def check_supported(ctx: Any) -> None:
    """Raise :class:`~urc.errors.ConfigError` naming every unsupported option of ``ctx``."""
    problems = unsupported_options(ctx)
    if problems:
        raise ConfigError(
            "--radix-cache-backend urc cannot serve this launch: " + "; ".join(problems)
        )


def create_cache(ctx: Any) -> Any:
    """SGLang's ``RadixCacheFactory``: urc on SGLang's own pools for ``ctx``.

    Raises :class:`~urc.errors.ConfigError` (before anything is built) for a launch option
    urc does not serve (:func:`unsupported_options`)."""
    check_supported(ctx)
    from urc.apps.sglang._cache import SGLangRadixCache
    from urc.apps.sglang._pools import (
        SGLangKVBuffers,
        SGLangMambaSlots,
        SGLangReqRows,
        SGLangSlots,
        SGLangSWASlots,
    )

    params = ctx.params
    allocator = params.token_to_kv_pool_allocator
    policy = _policy(params.eviction_policy)
    assert policy is not None, params.eviction_policy  # check_supported
    specs: list[ComponentSpec] = []
    slots: Any
    if ctx.is_hybrid_swa:
        slots = SGLangSWASlots(allocator)
        kv_size = allocator.size_full
        # What the request's own frees keep behind it and what a lock pins: the window
        # every SWA reader needs (the model's, or a draft's if wider).
        specs.append(SlidingWindowSpec(window=params.swa_retain_window, kv_size=allocator.size_swa))
    else:
        slots = SGLangSlots(allocator)
        kv_size = allocator.size
    mamba = None
    if ctx.is_hybrid_ssm:
        from sglang.srt.runtime_context import mamba_checkpoint_grid

        mamba = SGLangMambaSlots(params.req_to_token_pool)
        # Where a request snapshots its state so the next request can branch there.
        specs.append(MambaSpec(size=mamba.size, chunk_size=mamba_checkpoint_grid(params.page_size)))
    config = CacheConfig(
        components=(ComponentType.FULL, *specs),
        page_size=params.page_size,
        # The pools are SGLang's: these sizes only describe them (nothing is allocated).
        kv_size=kv_size,
        max_num_reqs=params.req_to_token_pool.size,
        max_context_len=params.req_to_token_pool.max_context_len,
        device=str(allocator.device),
        eviction_policy=policy,
        # SGLang's ``--radix-eviction-policy-config``, as given (keys checked above).
        eviction_params=params.eviction_policy_config or {},
        is_eagle=params.is_eagle,
    )
    hicache = ctx.enable_hierarchical_cache or _memory().enable_hierarchical_cache
    kv_pool = swa = None
    if hicache:  # the device buffers urc's host tier mirrors
        kvcache = allocator.get_kvcache()
        if ctx.is_hybrid_swa:
            kv_pool = SGLangKVBuffers(kvcache.full_kv_pool)
            swa = SimpleNamespace(kv_pool=SGLangKVBuffers(kvcache.swa_kv_pool))
        else:
            kv_pool = SGLangKVBuffers(kvcache)
    pools = CachePools(
        token_allocator=slots,
        req_to_token_pool=SGLangReqRows(params.req_to_token_pool),  # type: ignore[arg-type]
        # Duck-typed stand-ins on SGLang's pools (see urc.apps.sglang._pools).
        kv_pool=kv_pool,  # type: ignore[arg-type]
        swa=swa,  # type: ignore[arg-type]
        mamba=mamba,  # type: ignore[arg-type]
    )
    core = UnifiedRadixCache(config, pools)
    host = None
    if hicache:
        from hicache.host_tier import attach_hicache

        host = attach_hicache(
            core, _hicache_config(allocator, _memory()), transfer_engine(allocator.device)
        )
    cache = SGLangRadixCache(core, params, host)
    start_layerwise_load_back(cache, ctx)
    start_storage(cache, _memory())
    return cache
