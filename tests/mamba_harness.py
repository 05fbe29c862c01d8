"""Shared helpers of the Mamba tests: caches, fingerprinted states, a request driver."""

from __future__ import annotations

import torch

from urc import (
    CacheConfig,
    ComponentType,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
    Req,
    TreeNode,
    UnifiedRadixCache,
    build_cache,
)
from urc.components.mamba import MambaComponent
from urc.pools.mamba import MambaPool
from urc.specs import MambaSpec

FULL = ComponentType.FULL
MAMBA = ComponentType.MAMBA


# ---------------------------------------------------------------------------- helpers
def make(
    ps: int = 1, mamba_size: int = 20, kv_pages: int = 128, chunk: int | None = None
) -> UnifiedRadixCache:
    return build_cache(
        CacheConfig(
            components=(
                FULL,
                MambaSpec(size=mamba_size, chunk_size=chunk if chunk is not None else 4 * ps),
            ),
            page_size=ps,
            kv_size=kv_pages * ps,
            max_num_reqs=10,
            max_context_len=64 * ps,
        )
    )


def comp(cache: UnifiedRadixCache) -> MambaComponent:
    c = cache.component(MAMBA)
    assert isinstance(c, MambaComponent)
    return c


def pool_of(cache: UnifiedRadixCache) -> MambaPool:
    pool = cache.pools.mamba
    assert isinstance(pool, MambaPool)
    return pool


def fp(tokens: list[int]) -> float:
    """Fingerprint of the state after ``tokens`` (exact in float32)."""
    return float(hash(tuple(tokens)) & 0xFFFFF)


def write_state(cache: UnifiedRadixCache, slot: int | torch.Tensor, tokens: list[int]) -> None:
    pool = pool_of(cache)
    pool.conv[slot] = fp(tokens)
    pool.temporal[slot] = -fp(tokens)


def state_is(cache: UnifiedRadixCache, slot: int | torch.Tensor, tokens: list[int]) -> bool:
    pool = pool_of(cache)
    return bool(
        (pool.conv[slot] == fp(tokens)).all() and (pool.temporal[slot] == -fp(tokens)).all()
    )


def pages(ps: int, *xs: int) -> list[int]:
    """One page of ``ps`` distinct tokens per logical token ``x``."""
    return [x * 100 + j for x in xs for j in range(ps)]


def check(cache: UnifiedRadixCache, reqs: tuple[Req, ...] = (), extra_slots: int = 0) -> None:
    """``sanity_check`` and pool conservation with the units ``reqs`` hold."""
    cache.sanity_check()
    ps = cache.page_size
    full = sum(-(-(r.kv_allocated_len - r.cache_protected_len) // ps) * ps for r in reqs)
    mamba = sum(MambaComponent.num_req_slots(r) for r in reqs) + extra_slots
    cache.check_pools({FULL: full, MAMBA: mamba})


def insert_state(
    cache: UnifiedRadixCache, tokens: list[int], state: bool = True
) -> tuple[InsertResult, int | None]:
    """Insert ``tokens`` with fresh KV slots and (optionally) a state slot, like a caller that
    owns both; frees the state slot on ``mamba_exist`` as the contract says."""
    value = cache.token_to_kv_pool_allocator.alloc(len(tokens))
    assert value is not None
    slot = None
    params = InsertParams(key=RadixKey(tokens), value=value)
    if state:
        pool = pool_of(cache)
        t = pool.alloc(1)
        assert t is not None
        slot = int(t)
        write_state(cache, slot, tokens)
        params.mamba_value = t
    result = cache.insert(params)
    if result.mamba_exist and slot is not None:
        pool_of(cache).free(slot)
        slot = None
    check(cache)
    return result, slot


def match(cache: UnifiedRadixCache, tokens: list[int], req: Req | None = None) -> MatchResult:
    r = cache.match_prefix(MatchPrefixParams(RadixKey(tokens), cow_mamba=req is not None, req=req))
    return r


def snapshot(cache: UnifiedRadixCache) -> object:
    """Everything observable about the tree and its pools (to prove "nothing changed")."""
    m = comp(cache)
    pool = pool_of(cache)
    nodes = []
    for n in cache.iter_nodes():
        f = n.data[FULL]
        d = n.data[MAMBA]
        assert f is not None and d is not None
        nodes.append(
            (
                n.id,
                tuple(n.key),
                None if f.value is None else tuple(f.value.tolist()),
                m.state_slot(n),
                f.lock_ref,
                d.lock_ref,
                n.last_access_time,
            )
        )
    return (
        sorted(nodes),
        cache.full_evictable_size(),
        cache.full_protected_size(),
        cache.mamba_evictable_size(),
        cache.mamba_protected_size(),
        cache.token_to_kv_pool_allocator.available_size(),
        pool.available_size(),
        [pool.is_allocated(s) for s in range(pool.size)],
        m.lru.ids(),
    )


# ---------------------------------------------------------------------------- a small server
class Server:
    """Drives requests through the cache the way a scheduler does."""

    def __init__(self, cache: UnifiedRadixCache) -> None:
        self.cache = cache
        self.m = comp(cache)
        self.live: list[Req] = []
        self.n = 0

    def start(self, tokens: list[int], buffer: int = 0, reuse: bool = True) -> Req:
        """Admit a request: match (copy-on-write) and lock its prefix unless ``reuse`` is
        off, take KV slots for the rest, a live-state slot and an optional buffer."""
        cache = self.cache
        self.n += 1
        req = Req(f"r{self.n}", list(tokens))
        row = cache.req_to_token_pool.alloc()
        assert row is not None
        req.req_pool_idx = row
        r = match(cache, tokens, req) if reuse else match(cache, [])
        p = r.device_indices.shape[0]
        if p:
            req.lock = cache.lock(r.last_device_node)
            req.last_node = r.last_device_node
            cache.req_to_token_pool.write(row, 0, r.device_indices)
        req.prefix_indices = r.device_indices
        req.cache_protected_len = p
        own = cache.token_to_kv_pool_allocator.alloc(len(tokens) - p)
        assert own is not None
        cache.req_to_token_pool.write(row, p, own)
        req.kv_allocated_len = len(tokens)
        req.kv_committed_len = p
        if req.mamba_pool_idx is not None:
            assert state_is(cache, req.mamba_pool_idx, tokens[:p]), "COW copied a wrong state"
        else:
            self.m.alloc_req_slot(req)
            write_state(cache, req.mamba_pool_idx, tokens[:p])  # type: ignore[arg-type]
        if buffer:
            self.m.alloc_track_buffer(req, buffer)
        self.live.append(req)
        return req

    def compute(self, req: Req, upto: int, track: int | None = None) -> None:
        """Run the model on ``[committed, upto)``; snapshot the state at ``track``."""
        tokens = req.fill_ids
        assert req.kv_committed_len <= upto <= req.kv_allocated_len
        req.kv_committed_len = upto
        assert req.mamba_pool_idx is not None
        write_state(self.cache, req.mamba_pool_idx, tokens[:upto])
        if track is not None:
            buf = req.mamba_ping_pong_track_buffer
            assert buf is not None
            write_state(self.cache, buf[req.mamba_next_track_idx], tokens[:track])
            req.mamba_next_track_idx = (req.mamba_next_track_idx + 1) % buf.shape[0]
            req.mamba_last_track_seqlen = track

    def unfinished(self, req: Req) -> None:
        self.cache.cache_unfinished_req(req)

    def finish(self, req: Req, is_insert: bool = True) -> None:
        self.cache.cache_finished_req(req, is_insert)
        assert MambaComponent.num_req_slots(req) == 0
        self.live.remove(req)

    def check(self) -> None:
        check(self.cache, tuple(self.live))


def state_at(cache: UnifiedRadixCache, node: TreeNode) -> int | None:
    return comp(cache).state_slot(node)
