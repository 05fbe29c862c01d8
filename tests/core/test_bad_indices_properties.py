"""Random bad index sets at every public entry point that takes slot indices (issue 33).

Each example builds a small cache with tree-owned slots (inserted prompts), slots the caller
holds and free slots, then hands one entry point -- ``free``, an insert's value, ``free_swa``,
``write_req_slots``, the Mamba pool's ``free`` / ``copy``, an insert's ``mamba_value``, a
request row -- an index set that mixes the caller's own slots with one bad part: a repeat,
a tree-owned slot, a free slot, an index out of range, the wrong dtype, the wrong device or
shape.  The call must raise a typed error and change nothing: the pools' states are compared
byte for byte, then ``sanity_check()`` and pool conservation run.  Both twins of the page
bookkeeping (compiled and numpy) are driven.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cache_harness import components_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from urc import (
    CacheConfig,
    ComponentType,
    InsertParams,
    RadixKey,
    Req,
    UnifiedRadixCache,
    build_cache,
)
from urc.errors import URCError
from urc.fastpath import WalkImpl
from urc.pools.pageops import native_pages_available
from urc.service import _request_ops as request_ops
from urc.specs import MambaSpec, SlidingWindowSpec

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
IMPLS = [WalkImpl.PYTHON] + ([WalkImpl.NATIVE] if native_pages_available() else [])
BAD_KINDS = ["repeat", "tree", "free", "above", "negative", "int32", "meta", "2d"]
SLOT_ENTRIES = ["free", "insert", "insert_prev", "insert_dup", "free_swa", "write_req_slots"]
MAMBA_ENTRIES = ["mamba_free", "mamba_copy", "mamba_value"]


class World:
    """A cache with two inserted prompts (tree-owned), 4 pages held by the caller, a request
    with a row, a held Mamba slot (with MAMBA) and free everything else."""

    def __init__(self, comps: tuple[ComponentType, ...], ps: int, impl: WalkImpl) -> None:
        self.ps = ps
        self.cache: UnifiedRadixCache = build_cache(
            CacheConfig(
                components=components_of(
                    comps, SlidingWindowSpec(2 * ps, 32 * ps), MambaSpec(size=8)
                ),
                page_size=ps,
                kv_size=32 * ps,
                max_num_reqs=4,
                max_context_len=16 * ps,
                walk_impl=impl,
            )
        )
        self.alloc: Any = self.cache.token_to_kv_pool_allocator
        self.tree_slots = []
        for base in (0, 1000):
            v = self.alloc.alloc(4 * ps)
            self.cache.insert(InsertParams(key=RadixKey(list(range(base, base + 4 * ps))), value=v))
            self.tree_slots.append(v)
        self.mine = self.alloc.alloc(4 * ps)
        self.req = Req(rid="r", origin_input_ids=list(range(500, 500 + 4 * ps)))
        request_ops.alloc_req_row(self.cache, self.req)
        self.mamba = self.cache.pools.mamba
        self.mamba_mine = self.mamba.alloc(1) if self.mamba is not None else None
        self.mamba_tree = (
            [s for s in range(self.mamba.size) if self.mamba.is_tree_owned(s)]
            if self.mamba is not None
            else []
        )

    def free_page(self) -> torch.Tensor:
        """The first slot of a page nobody holds."""
        self.alloc.flush()
        page = int((self.alloc._state == 0).nonzero()[0][0])
        return torch.arange(page * self.ps, (page + 1) * self.ps)

    def bad_slots(self, kind: str, keep: int, at: int) -> torch.Tensor:
        """``keep`` of the caller's pages with one bad part inserted at page ``at``."""
        ps = self.ps
        good = self.mine[: keep * ps]
        bad = {
            "repeat": lambda: self.mine[:ps] if keep else torch.cat([self.mine[:ps]] * 2),
            "tree": lambda: self.tree_slots[1][ps : 2 * ps],
            "free": self.free_page,
            "above": lambda: torch.arange(self.alloc.size, self.alloc.size + ps),
            "negative": lambda: torch.arange(-ps, 0),
        }.get(kind)
        if bad is None:  # dtype, device, shape: the whole tensor is bad
            return {
                "int32": lambda: self.mine.to(torch.int32),
                "meta": lambda: self.mine.to("meta"),
                "2d": lambda: self.mine.reshape(2, -1),
            }[kind]()
        at = min(at, keep)
        return torch.cat([good[: at * ps], bad(), good[at * ps :]])

    def snapshot(self) -> tuple[Any, ...]:
        a = self.alloc
        a.flush()
        out: tuple[Any, ...] = (
            a._state.tobytes(),
            a._ext_lo[: a._next].tobytes(),
            a._ext_len[: a._next].tobytes(),
            self.cache.evictable_size(),
            self.cache.num_nodes,
            sorted(self.cache.req_to_token_pool._used),
            self.cache.req_to_token_pool.req_to_token.numpy().tobytes(),
            (self.req.kv_allocated_len, self.req.kv_committed_len),
        )
        if hasattr(a, "swa_pages"):
            out += (a._map.tobytes(), a.swa_pages.state.tobytes(), a.swa_available_size())
        if self.mamba is not None:
            out += (bytes(self.mamba._state), list(self.mamba._free))
        return out

    def check(self) -> None:
        self.cache.sanity_check()
        held = {c.component_type: 0 for c in self.cache.components}
        held[FULL] = 4 * self.ps
        if SWA in held:
            held[SWA] = 4 * self.ps
        if MAMBA in held:
            held[MAMBA] = 1
        self.cache.check_pools(held)


def call_slot_entry(w: World, entry: str, slots: torch.Tensor) -> None:
    n = slots.shape[0] if slots.dim() == 1 else slots.numel()
    if entry == "free":
        w.alloc.free(slots)
    elif entry in ("insert", "insert_prev"):
        # insert_prev: the tree's own slots first, then the bad set (checked as the caller's).
        if entry == "insert_prev" and slots.dim() == 1 and slots.dtype == torch.int64:
            slots = torch.cat([w.tree_slots[0].to(slots.device), slots])
            key = list(range(4 * w.ps)) + list(range(7000, 7000 + n))
            w.cache.insert(InsertParams(key=RadixKey(key), value=slots, prev_prefix_len=4 * w.ps))
        else:
            w.cache.insert(InsertParams(key=RadixKey(list(range(9000, 9000 + n))), value=slots))
    elif entry == "insert_dup":
        # The key starts with a cached prompt: the value's first slots are the caller's
        # duplicates of cached tokens, which the insert frees (page 1: after its last check).
        m = min(n, 4 * w.ps)
        key = list(range(m)) + list(range(7000, 7000 + n - m))
        w.cache.insert(InsertParams(key=RadixKey(key), value=slots))
    elif entry == "free_swa":
        if not hasattr(w.alloc, "free_swa"):
            pytest.skip("no SWA")
        w.alloc.free_swa(slots)
    elif entry == "write_req_slots":
        request_ops.write_req_slots(w.cache, w.req, slots, 0)
    else:
        raise AssertionError(entry)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    comps=st.sampled_from([(FULL,), (FULL, SWA)]),
    ps=st.sampled_from([1, 4]),
    impl=st.sampled_from(IMPLS),
    entry=st.sampled_from(SLOT_ENTRIES),
    kind=st.sampled_from(BAD_KINDS),
    keep=st.integers(0, 3),
    at=st.integers(0, 3),
)
def test_a_bad_slot_set_is_refused_with_a_typed_error_and_changes_nothing(
    comps: tuple[ComponentType, ...],
    ps: int,
    impl: WalkImpl,
    entry: str,
    kind: str,
    keep: int,
    at: int,
) -> None:
    if entry == "free_swa" and SWA not in comps:
        comps = (FULL, SWA)
    w = World(comps, ps, impl)
    slots = w.bad_slots(kind, keep, at)
    before = w.snapshot()
    with pytest.raises(URCError):
        call_slot_entry(w, entry, slots)
    assert w.snapshot() == before, (entry, kind)
    w.check()
    # The caller's own slots are still usable: the same entry point takes them.
    if entry in ("free", "free_swa"):
        call_slot_entry(w, entry, w.mine)


def bad_mamba(w: World, kind: str) -> Any:
    assert w.mamba is not None and w.mamba_mine is not None
    mine = w.mamba_mine
    return {
        "repeat": lambda: torch.cat([mine, mine]),
        "tree": lambda: torch.tensor([w.mamba_tree[0]]) if w.mamba_tree else None,
        "free": lambda: torch.tensor([w.mamba._free[-1]]),
        "above": lambda: torch.tensor([w.mamba.size]),
        "negative": lambda: torch.tensor([-1]),
        "int32": lambda: mine.to(torch.int32),
        "meta": lambda: mine.to("meta"),
        "2d": lambda: torch.cat([mine, mine]).reshape(1, 2),
    }[kind]()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ps=st.sampled_from([1, 4]),
    impl=st.sampled_from(IMPLS),
    entry=st.sampled_from(MAMBA_ENTRIES),
    kind=st.sampled_from(BAD_KINDS),
)
def test_a_bad_mamba_slot_set_is_refused_with_a_typed_error_and_changes_nothing(
    ps: int, impl: WalkImpl, entry: str, kind: str
) -> None:
    w = World((FULL, MAMBA), ps, impl)
    assert w.mamba is not None
    # A Mamba state on a node: insert a prompt with a state.
    slot = w.mamba.alloc(1)
    v = w.alloc.alloc(4 * ps)
    w.cache.insert(
        InsertParams(key=RadixKey(list(range(3000, 3000 + 4 * ps))), value=v, mamba_value=slot)
    )
    w.mamba_tree = [s for s in range(w.mamba.size) if w.mamba.is_tree_owned(s)]
    bad = bad_mamba(w, kind)
    if bad is None:
        return
    if entry == "mamba_free" and kind == "2d":
        bad = bad.reshape(-1)[:1].reshape(1, 1).to(torch.int32)  # a 2-D tensor frees fine
    value = w.alloc.alloc(4 * ps)  # the insert's own Full slots, valid
    before = w.snapshot()
    with pytest.raises(URCError):
        if entry == "mamba_free":
            w.mamba.free(bad)
        elif entry == "mamba_copy":
            w.mamba.copy(w.mamba_mine, bad)
        else:
            # Half the key is cached: its slots are duplicates the insert would free, so a
            # refused state must be refused before they are.
            key = RadixKey(list(range(3000, 3000 + 2 * ps)) + list(range(8000, 8000 + 2 * ps)))
            w.cache.insert(InsertParams(key=key, value=value, mamba_value=bad))
    assert w.snapshot() == before, (entry, kind)
    w.alloc.free(value)
    w.check()


@pytest.mark.parametrize("row", [None, -1, 3, 99, True, 1.0])
def test_a_bad_request_row_is_refused_and_changes_nothing(row: Any) -> None:
    w = World((FULL,), 4, IMPLS[-1])
    req = Req(rid="bad", origin_input_ids=list(range(8)))
    req.req_pool_idx = row
    before = w.snapshot()
    with pytest.raises(URCError):
        w.cache.cache_finished_req(req)
    with pytest.raises(URCError):
        request_ops.write_req_slots(w.cache, req, w.mine[:4], 4)
    if row is not None:
        with pytest.raises(URCError):
            w.cache.req_to_token_pool.free(row)
    assert w.snapshot() == before
    w.check()
