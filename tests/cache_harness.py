"""Test helpers: a cache plus bookkeeping of what live requests hold, checked after every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from urc import (
    CacheConfig,
    ComponentType,
    EvictionPolicy,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
    Req,
    UnifiedRadixCache,
    build_cache,
)
from urc.specs import ComponentSpec


def components_of(
    types: Sequence[ComponentType], *specs: ComponentSpec
) -> tuple[ComponentType | ComponentSpec, ...]:
    """``CacheConfig.components`` for the component set ``types`` (a test table's row):
    FULL, then each of ``specs`` whose kind is in ``types``."""
    return (ComponentType.FULL, *(s for s in specs if s.component_type in types))


class Harness:
    """A cache whose every mutation is followed by ``check()``.

    ``held`` counts Full slots owned by the test (allocated and not handed to the tree), so
    ``free + evictable + protected + held == capacity`` can be asserted at any time.
    """

    def __init__(self, page_size: int = 1, kv_size: int = 4096, **kw: object) -> None:
        self.cache: UnifiedRadixCache = build_cache(
            CacheConfig(page_size=page_size, kv_size=kv_size, **kw)  # type: ignore[arg-type]
        )
        self.page_size = page_size
        self.alloc = self.cache.token_to_kv_pool_allocator
        self.held = 0

    def check(self) -> None:
        self.cache.sanity_check()
        self.cache.check_pools({ComponentType.FULL: self.held})

    def new_value(self, n: int) -> torch.Tensor:
        v = self.alloc.alloc(n)
        assert v is not None, f"test pool exhausted allocating {n}"
        self.held += -(-n // self.page_size) * self.page_size
        return v

    def insert(
        self, tokens: Sequence[int], prev_prefix_len: int = 0, extra_key: object = None
    ) -> InsertResult:
        """Insert ``tokens`` with fresh slots; ownership passes to the tree."""
        value = self.new_value(len(tokens))
        result = self.cache.insert(
            InsertParams(
                key=RadixKey(list(tokens), extra_key),  # type: ignore[arg-type]
                value=value,
                prev_prefix_len=prev_prefix_len,
            )
        )
        aligned = len(tokens) - len(tokens) % self.page_size
        self.held -= aligned
        # The unaligned tail stays with the caller: give it back.
        if aligned < len(tokens):
            self.alloc.free(value[aligned:])
            self.held -= self.page_size
        self.check()
        return result

    def match(self, tokens: Sequence[int], extra_key: object = None) -> MatchResult:
        result = self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(list(tokens), extra_key))  # type: ignore[arg-type]
        )
        self.check()
        return result

    def match_len(self, tokens: Sequence[int], extra_key: object = None) -> int:
        return int(self.match(tokens, extra_key).device_indices.shape[0])


def seq(start: int, num_pages: int, page_size: int) -> list[int]:
    """``num_pages`` pages of consecutive token ids starting at ``start``."""
    return list(range(start, start + num_pages * page_size))


def start_request(cache: UnifiedRadixCache, tokens: list[int], out_len: int) -> Req | None:
    """A running request like a scheduler makes one: match and lock the cached prefix, take a
    ``req_to_token`` row and fresh slots for the rest (input + ``out_len`` outputs).

    Returns ``None`` (nothing held) when the pool has no room for the rest.  The request's
    ``kv_*_len`` fields are left for the caller to set.
    """
    row = cache.req_to_token_pool.alloc()
    assert row is not None
    req = Req(rid="p", origin_input_ids=tokens, output_ids=[5] * out_len)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    req.req_pool_idx = row
    req.last_node = m.last_device_node
    req.lock = cache.lock(m.last_device_node)
    req.prefix_indices = m.device_indices
    req.cache_protected_len = m.device_indices.shape[0]
    own = cache.token_to_kv_pool_allocator.alloc(len(tokens) + out_len - req.cache_protected_len)
    if own is None:
        cache.unlock(req.lock)
        cache.req_to_token_pool.free(row)
        return None
    cache.req_to_token_pool.write(row, 0, torch.cat([m.device_indices, own]))
    return req


def running_request(h: Harness, input_ids: list[int], output_ids: list[int], over: int = 0) -> Req:
    """A request that prefilled and decoded into fresh slots (after matching its prefix),
    with ``over`` more slots allocated past what it computed (speculative decoding)."""
    cache = h.cache
    req = Req(rid="r", origin_input_ids=input_ids, output_ids=output_ids)
    row = cache.req_to_token_pool.alloc()
    assert row is not None
    req.req_pool_idx = row
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(input_ids)))
    req.prefix_indices = m.device_indices
    req.last_node = m.last_device_node
    req.lock = cache.lock(m.last_device_node)
    req.cache_protected_len = m.device_indices.shape[0]
    total = len(input_ids) + len(output_ids)
    own = h.new_value(total + over - req.cache_protected_len)
    cache.req_to_token_pool.write(row, 0, torch.cat([m.device_indices, own]))
    req.kv_committed_len = total
    req.kv_allocated_len = total + over
    h.check()
    return req


def pins(cache: UnifiedRadixCache) -> int:
    """Device and host locks held on every node (0 once nothing is in flight)."""
    return sum(
        cd.host_lock_ref + cd.lock_ref
        for n in cache.iter_nodes()
        for cd in n.data
        if cd is not None
    )


def assert_path_validators_agree(cache: UnifiedRadixCache) -> None:
    """Every component's ``create_path_validator`` answers, at every node of every path in
    the tree, what its walk validator answers there (``match_path`` relies on it)."""
    tiers = (True, False) if cache.host_tier is not None else (True,)
    for node in cache.iter_nodes():
        path = cache.path_to(node)
        if not path:
            continue
        for ct in cache.config.types:
            component = cache.component(ct)
            for device_only in tiers:
                walk = component.create_match_validator(device_only)
                check = component.create_path_validator(path, device_only)
                if walk is None:
                    assert check is None, f"{ct.name}: a path validator without a walk one"
                    continue
                assert check is not None
                expected = [walk(n) for n in path]
                got = [check(i) for i in range(len(path), 0, -1)][::-1]
                assert got == expected, f"{ct.name} device_only={device_only}: {got} != {expected}"
                # A component's own deepest_boundary answers what the validator does.
                deepest = max([i + 1 for i, ok in enumerate(expected) if ok], default=0)
                got_deepest = component.deepest_boundary(path, device_only)
                assert got_deepest == deepest, f"{ct.name}: {got_deepest} != {deepest}"


class _FirstTokenOracle:
    """A made-up future for the Belady strategy's invariant tests: a fixed pseudo-random
    next use per node, from its first token and length."""

    def next_use(self, node: Any) -> int:
        return (node.key[0] * 7919 + node.key_len) % 101 if node.key_len else 0


# Every strategy, with and without partial-leaf eviction (cheaper sequences than the LRU
# tests above: these check invariants, the LRU ones are also checked against SGLang).
POLICY_CONFIGS = (
    [
        pytest.param(
            {"eviction_policy": p, "partial_leaf_eviction": partial}, id=f"{p.value}-{tag}"
        )
        for p in EvictionPolicy
        if p is not EvictionPolicy.BELADY
        for partial, tag in ((False, "whole"), (True, "partial"))
    ]
    + [
        pytest.param(
            {
                "eviction_policy": EvictionPolicy.TLRU,
                "eviction_params": {"threshold": 12, "next_prompt_estimate": 4},
                "partial_leaf_eviction": partial,
            },
            id=f"tlru-12-4-{tag}",
        )
        for partial, tag in ((False, "whole"), (True, "partial"))
    ]
    + [
        pytest.param(
            {
                "eviction_policy": EvictionPolicy.BELADY,
                "next_use": _FirstTokenOracle(),
                "partial_leaf_eviction": partial,
            },
            id=f"belady-{tag}",
        )
        for partial, tag in ((False, "whole"), (True, "partial"))
    ]
)
