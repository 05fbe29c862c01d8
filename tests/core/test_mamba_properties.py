"""Random request sequences on (FULL, MAMBA) and (FULL, SWA, MAMBA): invariants and pool
conservation after every step, and every Mamba state the tree hands out is the state of
exactly the prefix it was matched for.

A small scheduler model admits requests (match with copy-on-write, lock, take KV and state
slots, optionally a ping-pong tracking buffer), computes chunks (writing a fingerprint of the
covered tokens into the live state and into snapshots), caches them unfinished or finished,
evicts, inserts directly and matches.  Pools are small so eviction and slot exhaustion happen.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cache_harness import POLICY_CONFIGS, assert_path_validators_agree, components_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from urc import (
    CacheConfig,
    ComponentType,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    Req,
    UnifiedRadixCache,
    build_cache,
)
from urc.components.mamba import MambaComponent
from urc.errors import OutOfMemoryError
from urc.pools.mamba import MambaPool
from urc.specs import MambaSpec, SlidingWindowSpec

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
MAX_LIVE = 3
NUM_SEQS = 5


def _fp(tokens: list[int]) -> float:
    return float(hash(tuple(tokens)) & 0xFFFFF)


class Model:
    """The scheduler side: live requests and what they hold."""

    def __init__(self, cache: UnifiedRadixCache) -> None:
        self.cache = cache
        m = cache.component(MAMBA)
        assert isinstance(m, MambaComponent)
        self.m = m
        pool = cache.pools.mamba
        assert isinstance(pool, MambaPool)
        self.pool = pool
        self.live: list[Req] = []
        self.n = 0
        self.has_swa = cache.has_component(SWA)

    # -------------------------------------------------------------- state fingerprints
    def write(self, slot: Any, tokens: list[int]) -> None:
        self.pool.conv[slot] = _fp(tokens)
        self.pool.temporal[slot] = -_fp(tokens)

    def holds(self, slot: Any, tokens: list[int]) -> bool:
        return bool(
            (self.pool.conv[slot] == _fp(tokens)).all()
            and (self.pool.temporal[slot] == -_fp(tokens)).all()
        )

    # -------------------------------------------------------------- operations
    def start(self, tokens: list[int], buffer: int, cow: bool) -> None:
        if len(self.live) >= MAX_LIVE:
            return
        cache = self.cache
        self.n += 1
        req = Req(f"r{self.n}", list(tokens))
        row = cache.req_to_token_pool.alloc()
        assert row is not None
        req.req_pool_idx = row
        p = 0
        if cow:
            r = cache.match_prefix(MatchPrefixParams(RadixKey(tokens), cow_mamba=True, req=req))
            p = r.device_indices.shape[0]
            if p:
                req.lock = cache.lock(r.last_device_node)
                req.last_node = r.last_device_node
                cache.req_to_token_pool.write(row, 0, r.device_indices)
                assert req.mamba_pool_idx is not None, "a hit without its state"
                assert self.holds(req.mamba_pool_idx, tokens[:p]), "COW copied a wrong state"
            req.prefix_indices = r.device_indices
        req.cache_protected_len = req.kv_committed_len = req.kv_allocated_len = p
        self.live.append(req)
        alloc = cache.token_to_kv_pool_allocator
        need = len(tokens) - p
        own = alloc.alloc(need)
        if own is None:
            cache.evict(EvictParams(num_tokens=need))
            own = alloc.alloc(need)
        try:
            if own is None:
                raise OutOfMemoryError("KV")
            cache.req_to_token_pool.write(row, p, own)
            req.kv_allocated_len = len(tokens)
            if req.mamba_pool_idx is None:
                self.m.alloc_req_slot(req)
                self.write(req.mamba_pool_idx, tokens[:p])
            if buffer:
                self.m.alloc_track_buffer(req, buffer)
        except OutOfMemoryError:
            self.finish(req, False)  # abort: frees everything it took

    def compute(self, req: Req, a: int, b: int) -> None:
        """Compute ``a`` quarters of what is left; snapshot at page ``b`` (if buffered)."""
        tokens = req.fill_ids
        room = req.kv_allocated_len - req.kv_committed_len
        upto = req.kv_committed_len + room * a // 4
        req.kv_committed_len = upto
        self.write(req.mamba_pool_idx, tokens[:upto])
        buf = req.mamba_ping_pong_track_buffer
        if buf is not None and b >= 0:
            ps = self.cache.page_size
            t = b % (upto // ps + 1) * ps
            self.write(buf[req.mamba_next_track_idx], tokens[:t])
            req.mamba_next_track_idx = (req.mamba_next_track_idx + 1) % buf.shape[0]
            req.mamba_last_track_seqlen = t

    def unfinished(self, req: Req) -> None:
        self.cache.cache_unfinished_req(req)
        assert req.cache_protected_len == req.prefix_indices.shape[0]

    def finish(self, req: Req, is_insert: bool) -> None:
        self.cache.cache_finished_req(req, is_insert)
        assert MambaComponent.num_req_slots(req) == 0 and req.req_pool_idx is None
        self.live.remove(req)

    def early_release(self, req: Req) -> None:
        if self.has_swa and req.lock is not None:
            self.cache.release_swa(req.lock)

    def insert(self, tokens: list[int], with_state: bool) -> None:
        cache = self.cache
        value = cache.token_to_kv_pool_allocator.alloc(len(tokens))
        if value is None:
            return
        params = InsertParams(RadixKey(tokens), value)
        slot = None
        aligned = len(tokens) % cache.page_size == 0
        if with_state and aligned:
            slot = self.pool.alloc(1)
            if slot is not None:
                self.write(slot, tokens)
                params.mamba_value = slot
        result = cache.insert(params)
        if result.mamba_exist and slot is not None:
            self.pool.free(slot)
        # The unaligned tail was not taken by the tree: the caller frees it.
        n = len(tokens) - len(tokens) % cache.page_size
        if n < len(tokens):
            cache.token_to_kv_pool_allocator.free(value[n:])

    def match(self, tokens: list[int], cow: bool) -> None:
        cache = self.cache
        probe = Req("probe", list(tokens)) if cow else None
        r = cache.match_prefix(MatchPrefixParams(RadixKey(tokens), cow_mamba=cow, req=probe))
        hit = r.device_indices.shape[0]
        if hit:
            slot = self.m.state_slot(r.last_device_node)
            assert slot is not None and self.holds(slot, tokens[:hit]), "state at a wrong node"
            if probe is not None:
                assert probe.mamba_pool_idx is not None
                assert self.holds(probe.mamba_pool_idx, tokens[:hit])
        if probe is not None:
            self.m.free_req_slots(probe)

    def check(self) -> None:
        cache = self.cache
        cache.sanity_check()
        assert_path_validators_agree(cache)
        ps = cache.page_size
        full = sum(-(-(r.kv_allocated_len - r.cache_protected_len) // ps) * ps for r in self.live)
        held = {FULL: full, MAMBA: sum(MambaComponent.num_req_slots(r) for r in self.live)}
        if self.has_swa:
            held[SWA] = full  # paired allocation; nothing slid out of the window here
        cache.check_pools(held)


def _build(components: tuple[ComponentType, ...], ps: int, **config: Any) -> UnifiedRadixCache:
    return build_cache(
        CacheConfig(
            **config,
            components=components_of(
                components, SlidingWindowSpec(3 * ps), MambaSpec(size=9, chunk_size=2 * ps)
            ),
            page_size=ps,
            kv_size=40 * ps,
            max_num_reqs=MAX_LIVE + 1,
            max_context_len=16 * ps,
        )
    )


# Sequences share prefixes by construction: a common base cut at some page, plus a few pages
# of their own, plus (for ps > 1) an unaligned tail.
_base = st.lists(st.integers(0, 3), min_size=6, max_size=6)
_seq = st.tuples(
    st.integers(1, 6), st.lists(st.integers(4, 6), max_size=1), st.sampled_from([0, 0, 0, 1, 3])
)
_start = st.tuples(
    st.just("start"), st.integers(0, NUM_SEQS - 1), st.sampled_from([0, 0, 1, 2]), st.booleans()
)
_op = st.one_of(
    _start,
    _start,
    st.tuples(
        st.just("serve"),
        st.integers(0, NUM_SEQS - 1),
        st.sampled_from([0, 1, 2]),
        st.integers(-1, 64),
    ),
    st.tuples(
        st.just("serve"),
        st.integers(0, NUM_SEQS - 1),
        st.sampled_from([0, 1, 2]),
        st.integers(-1, 64),
    ),
    st.tuples(st.just("run"), st.integers(0, 9), st.integers(-1, 64)),
    st.tuples(st.just("compute"), st.integers(0, 9), st.integers(0, 4), st.integers(-1, 64)),
    st.tuples(st.just("compute"), st.integers(0, 9), st.integers(0, 4), st.integers(-1, 64)),
    st.tuples(st.just("unfinished"), st.integers(0, 9)),
    st.tuples(st.just("chunk"), st.integers(0, 9), st.integers(1, 3), st.integers(-1, 64)),
    st.tuples(st.just("finish"), st.integers(0, 9), st.booleans()),
    st.tuples(st.just("early"), st.integers(0, 9)),
    st.tuples(st.just("evict"), st.integers(0, 12), st.integers(0, 12), st.integers(0, 3)),
    st.tuples(st.just("insert"), st.integers(0, NUM_SEQS - 1), st.booleans()),
    st.tuples(st.just("match"), st.integers(0, NUM_SEQS - 1), st.booleans()),
)


def _run(
    components: tuple[ComponentType, ...],
    ps: int,
    base: list[int],
    raw_seqs: list[tuple[int, list[int], int]],
    ops: list[tuple[Any, ...]],
    **config: Any,
) -> None:
    """Run ``ops`` on a cache of ``components`` (``config``: more ``CacheConfig`` fields),
    checking every invariant after every step, then drain it."""
    cache = _build(components, ps, **config)
    model = Model(cache)
    # Page x of a sequence is ps tokens derived from x (and its position, so a page id may
    # repeat); plus an unaligned tail for ps > 1.
    seqs = []
    for cut, own, tail in raw_seqs:
        ids = base[:cut] + own
        toks = [x * 1000 + i * 10 + j for i, x in enumerate(ids) for j in range(ps)]
        seqs.append(toks + [90000 + j for j in range(tail % ps)])
    for op in ops:
        kind = op[0]
        live = model.live
        if kind == "start":
            model.start(seqs[op[1]], op[2], op[3])
        elif kind == "serve":  # admit, compute everything, finish
            before = len(live)
            model.start(seqs[op[1]], op[2], True)
            if len(live) > before:
                model.compute(live[-1], 4, op[3])
                model.finish(live[-1], True)
        elif kind in ("run", "chunk", "compute", "unfinished", "finish", "early"):
            if not live:
                continue
            req = live[op[1] % len(live)]
            if kind == "run":  # to the end, then finish
                model.compute(req, 4, op[2])
                model.finish(req, True)
            elif kind == "chunk":  # one chunked-prefill step
                model.compute(req, op[2], op[3])
                model.unfinished(req)
            elif kind == "compute":
                model.compute(req, op[2], op[3])
            elif kind == "unfinished":
                model.unfinished(req)
            elif kind == "finish":
                model.finish(req, op[2])
            else:
                model.early_release(req)
        elif kind == "evict":
            cache.evict(
                EvictParams(num_tokens=op[1] * ps, swa_num_tokens=op[2] * ps, mamba_num=op[3])
            )
        elif kind == "insert":
            model.insert(seqs[op[1]], op[2])
        else:
            model.match(seqs[op[1]], op[2])
        model.check()
    for req in list(model.live):
        model.finish(req, True)
        model.check()
    # Everything cached is evictable once no request is left; evicting it empties the pools.
    assert cache.full_protected_size() == 0 and cache.mamba_protected_size() == 0
    cache.evict(EvictParams(num_tokens=1 << 20, swa_num_tokens=1 << 20, mamba_num=1 << 20))
    model.check()
    assert cache.total_size() == 0 and model.pool.available_size() == model.pool.size


_seqs = st.lists(_seq, min_size=NUM_SEQS, max_size=NUM_SEQS)
_ops = st.lists(_op, min_size=15, max_size=60)
_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("ps", [1, 4])
@_SETTINGS
@given(base=_base, raw_seqs=_seqs, ops=_ops)
def test_full_mamba_sequences(
    ps: int, base: list[int], raw_seqs: list[tuple[int, list[int], int]], ops: list[Any]
) -> None:
    _run((FULL, MAMBA), ps, base, raw_seqs, ops)


def _has_swa() -> bool:
    try:
        from urc.components import component_class

        component_class(SWA)
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_swa(), reason="the SWA component is not in this tree yet")
@pytest.mark.parametrize("ps", [1, 4])
@_SETTINGS
@given(base=_base, raw_seqs=_seqs, ops=_ops)
def test_full_swa_mamba_sequences(
    ps: int, base: list[int], raw_seqs: list[tuple[int, list[int], int]], ops: list[Any]
) -> None:
    _run((FULL, SWA, MAMBA), ps, base, raw_seqs, ops)


def test_state_tensors_are_untouched_by_tree_operations() -> None:
    """Tree operations move slot indices only; the bytes of a cached state never change."""
    cache = _build((FULL, MAMBA), 1)
    model = Model(cache)
    model.insert([1, 2, 3], True)
    slot = model.m.state_slot(
        cache.match_prefix(MatchPrefixParams(RadixKey([1, 2, 3]))).last_device_node
    )
    assert slot is not None
    before = (model.pool.conv[slot].clone(), model.pool.temporal[slot].clone())
    model.insert([1, 2], True)  # split above it
    model.match([1, 2, 3], True)  # copy-on-write out of it
    model.check()
    assert torch.equal(model.pool.conv[slot], before[0])
    assert torch.equal(model.pool.temporal[slot], before[1])


@pytest.mark.parametrize("config", POLICY_CONFIGS)
@pytest.mark.parametrize("components", [(FULL, MAMBA), (FULL, SWA, MAMBA)], ids=["mamba", "swa"])
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(base=_base, raw_seqs=_seqs, ops=_ops)
def test_every_eviction_policy_keeps_invariants(
    config: dict[str, Any],
    components: tuple[ComponentType, ...],
    base: list[int],
    raw_seqs: list[tuple[int, list[int], int]],
    ops: list[Any],
) -> None:
    _run(components, 4, base, raw_seqs, ops, **config)
