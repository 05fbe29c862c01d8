"""Test helper: two caches driven through the same operations and compared after every step.

The two differ in one setting that must not change behaviour (the walk implementation,
whether matches build their device indices, or whether matches find their hit by the
components' window rules or by their validators); after each step their results, every size
counter and the whole tree (keys, values, locks, stamps, hit counts) must be equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from cache_harness import components_of, start_request
from hypothesis import HealthCheck, settings

from urc import (
    CacheConfig,
    ComponentType,
    EvictParams,
    IncLockRefResult,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
    TreeNode,
    UnifiedRadixCache,
    build_cache,
)
from urc.fastpath import WalkImpl
from urc.specs import MambaSpec, SlidingWindowSpec

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
SETS = [(FULL,), (FULL, SWA), (FULL, MAMBA), (FULL, SWA, MAMBA)]

#: Hypothesis settings of a lockstep test (each example drives two caches, checked per step).
LOCKSTEP_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@dataclass(frozen=True)
class Side:
    """How one of the two caches runs."""

    walk_impl: WalkImpl = WalkImpl.PYTHON
    with_indices: bool = True  # its matches build device_indices
    window_rules: bool = True  # device-only matches use hooks.match_rules (else validators)


def build(components: tuple[ComponentType, ...], ps: int, impl: WalkImpl) -> UnifiedRadixCache:
    return build_cache(
        CacheConfig(
            components=components_of(
                components, SlidingWindowSpec(window=3 * ps), MambaSpec(size=12, chunk_size=2 * ps)
            ),
            page_size=ps,
            kv_size=48 * ps,
            max_num_reqs=4,
            max_context_len=32 * ps,
            walk_impl=impl,
        )
    )


def tree_state(cache: UnifiedRadixCache) -> list[tuple[Any, ...]]:
    """Everything an operation could influence, with node ids replaced by creation rank."""
    nodes = sorted(cache.iter_nodes(), key=lambda n: n.id)
    rank = {n.id: i for i, n in enumerate(nodes)}
    rank[cache.root.id] = -1
    out = []
    for n in nodes:
        assert n.parent is not None
        data = []
        for cd in n.data:
            if cd is None:
                data.append(None)
                continue
            v = None if cd.value is None else cd.value.tolist()
            data.append((v, cd.lock_ref))
        out.append(
            (rank[n.id], rank[n.parent.id], list(n.key), data, n.last_access_time, n.hit_count)
        )
    return out


def sizes(cache: UnifiedRadixCache) -> tuple[int, ...]:
    out = [
        f(ct)
        for ct in ComponentType
        for f in (cache.component_evictable_size, cache.component_protected_size)
    ]
    counters = cache.counters
    return (
        *out,
        cache.num_nodes,
        cache.token_to_kv_pool_allocator.available_size(),
        counters.match_requests,
        counters.query_tokens,
        *counters.hit_tokens.values(),
    )


class Lockstep:
    """Two caches (``sides``), driven identically and compared after each step."""

    def __init__(
        self, components: tuple[ComponentType, ...], ps: int, sides: Sequence[Side]
    ) -> None:
        assert len(sides) == 2, sides
        self.ps = ps
        self.mamba = MAMBA in components
        self.sides = tuple(sides)
        self.caches = [build(components, ps, s.walk_impl) for s in sides]
        for s, c in zip(sides, self.caches, strict=True):
            if not s.window_rules:
                c.hooks = replace(c.hooks, match_rules=None)
        self.locks: list[list[tuple[TreeNode, IncLockRefResult]]] = [[], []]

    def key(self, blocks: list[int], tail: int) -> list[int]:
        return [b * 1000 + i for b in blocks for i in range(self.ps)] + [7] * tail

    def each(self, op: Any) -> list[Any]:
        out = [op(i, c) for i, c in enumerate(self.caches)]
        a, b = self.caches
        assert sizes(a) == sizes(b)
        assert tree_state(a) == tree_state(b)
        return out

    def run(self, op: tuple[Any, ...]) -> None:
        """One operation of ``test_cache_properties.ops``."""
        name = op[0]
        if name in ("insert", "match", "lock", "request"):
            getattr(self, name)(self.key(*op[1]), *op[2:])
        else:
            getattr(self, name)(op[1])

    def _match(self, i: int, c: UnifiedRadixCache, tokens: list[int]) -> MatchResult:
        with_indices = self.sides[i].with_indices
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens)), with_indices=with_indices))
        if with_indices:
            assert m.device_indices is not None
            assert m.device_prefix_len == m.device_indices.shape[0]
        else:
            assert m.device_indices is None
            # The indices a match without them stands for: the path to its last device node.
            indices = c.path_device_indices(m.last_device_node)
            assert indices.shape[0] == m.device_prefix_len
            m = m._replace(device_indices=indices)
        return m

    def match(self, tokens: list[int]) -> None:
        def run(i: int, c: UnifiedRadixCache) -> tuple[Any, ...]:
            m = self._match(i, c, tokens)
            return (m.indices.tolist(), len(c.path_to(m.last_device_node)), m.device_prefix_len)

        a, b = self.each(run)
        assert a == b

    def insert(self, tokens: list[int], with_prefix: bool) -> None:
        if self.mamba:  # a Mamba state sits on a page-aligned key
            tokens = tokens[: len(tokens) // self.ps * self.ps]

        def run(i: int, c: UnifiedRadixCache) -> tuple[Any, ...]:
            m = self._match(i, c, tokens)
            prefix = m.indices if with_prefix else m.indices[:0]
            own = c.token_to_kv_pool_allocator.alloc(len(tokens) - prefix.shape[0])
            if own is None:
                return (None,)
            p = InsertParams(
                key=RadixKey(list(tokens)),
                value=torch.cat([prefix, own]),
                prev_prefix_len=prefix.shape[0],
            )
            slot = None
            if self.mamba:
                slot = c.pools.mamba.alloc(1)
                p.mamba_value = slot
            r = c.insert(p)
            if slot is not None and r.mamba_exist:
                c.pools.mamba.free(slot)
            node = r.last_device_node
            return (r.prefix_len, r.mamba_exist, None if node is None else len(c.path_to(node)))

        a, b = self.each(run)
        assert a == b

    def lock(self, tokens: list[int]) -> None:
        def run(i: int, c: UnifiedRadixCache) -> int:
            m = self._match(i, c, tokens)
            r = c.inc_lock_ref(m.last_device_node)
            self.locks[i].append((m.last_device_node, r))
            return r.delta

        a, b = self.each(run)
        assert a == b

    def unlock(self, k: int) -> None:
        if not self.locks[0]:
            return

        def run(i: int, c: UnifiedRadixCache) -> int:
            node, r = self.locks[i].pop(k % len(self.locks[i]))
            return c.dec_lock_ref(node, r.to_dec_params()).delta

        a, b = self.each(run)
        assert a == b

    def evict(self, n: int) -> None:
        ps = self.ps
        a, b = self.each(
            lambda i, c: tuple(
                c.evict(EvictParams(num_tokens=n * ps, swa_num_tokens=n * ps, mamba_num=n % 3))
            )
        )
        assert a == b

    def request(self, tokens: list[int], out_len: int, unfinished_first: bool) -> None:
        def run(i: int, c: UnifiedRadixCache) -> bool:
            req = start_request(c, list(tokens), out_len)
            if req is None:
                return False
            if unfinished_first:
                req.kv_committed_len = req.kv_allocated_len = len(tokens)
                c.cache_unfinished_req(req)
            req.kv_committed_len = req.kv_allocated_len = len(tokens) + out_len
            c.cache_finished_req(req)
            return True

        a, b = self.each(run)
        assert a == b
