"""Shared helpers of the HiCache component tests: caches with a host tier, known bytes,
in-flight transfer bookkeeping, snapshots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from cache_harness import assert_path_validators_agree, components_of

from hicache.config import HiCacheConfig
from hicache.host_layout import HostLayout
from hicache.host_tier import attach_hicache
from hicache.transfer_engine import TransferEngine
from urc import (
    CacheConfig,
    ComponentType,
    EvictParams,
    InsertParams,
    KVShape,
    MatchPrefixParams,
    RadixKey,
    UnifiedRadixCache,
    build_cache,
)
from urc.host_protocol import BackupTicket, LoadTicket, WritePolicy
from urc.node import TreeNode
from urc.params import MatchResult
from urc.specs import MambaSpec, SlidingWindowSpec

FULL = ComponentType.FULL
SWA = ComponentType.SWA
MAMBA = ComponentType.MAMBA
SETS = [(FULL, SWA), (FULL, MAMBA), (FULL, SWA, MAMBA)]
SET_IDS = ["swa", "mamba", "swa+mamba"]
WINDOW_PAGES = 4


# ---------------------------------------------------------------------- helpers
def make(
    comps: tuple[ComponentType, ...],
    ps: int,
    policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    kv_pages: int = 64,
    swa_pages: int | None = None,
    host_pages: int = 128,
    mamba_size: int = 16,
    window_pages: int = WINDOW_PAGES,
    engine: TransferEngine | None = None,
    layout: HostLayout | None = None,
    **config: Any,
) -> UnifiedRadixCache:
    """A cache of ``comps`` with a host tier (``config``: more ``CacheConfig`` fields;
    ``engine``: where the host tier's copies run, default the one for ``config.device``;
    ``layout``: the host pools' layout, default the device's)."""
    cache = build_cache(
        CacheConfig(
            **config,
            components=components_of(
                comps,
                SlidingWindowSpec(window_pages * ps, None if swa_pages is None else swa_pages * ps),
                MambaSpec(size=mamba_size),
            ),
            page_size=ps,
            kv_size=kv_pages * ps,
            kv_shape=KVShape(2, 2, 4, torch.float32),
        )
    )
    hc = HiCacheConfig(write_policy=policy, host_tokens=host_pages * ps, host_layout=layout)
    if engine is None:
        attach_hicache(cache, hc)
    else:
        attach_hicache(cache, hc, engine)
    return cache


@dataclass
class InFlight:
    """Tickets not finished yet: their reserved slots are held outside the tree."""

    loads: list[LoadTicket] = field(default_factory=list)
    backups: list[BackupTicket] = field(default_factory=list)

    def held(self) -> tuple[dict[ComponentType, int], dict[ComponentType, int]]:
        held = dict.fromkeys(ComponentType, 0)
        host = dict.fromkeys(ComponentType, 0)
        for t in self.loads:
            held[FULL] += int(t.device.shape[0])
            for _, item in t.items:
                if item.component is not FULL:  # Full items are slices of t.device
                    held[item.component] += int(item.device.shape[0])
        for b in self.backups:
            for _, item in b.items:
                host[item.component] += int(item.host.shape[0])
        return held, host


def check(cache: UnifiedRadixCache, flight: InFlight | None = None) -> None:
    cache.sanity_check()
    assert_path_validators_agree(cache)
    held, host = (flight or InFlight()).held()
    cache.check_pools(held, host)


def swa_kv(cache: UnifiedRadixCache) -> torch.Tensor:
    return cache.pools.swa.kv_pool.kv  # type: ignore[no-any-return]


def mamba_slot(cache: UnifiedRadixCache, node: TreeNode) -> int | None:
    return cache.component(MAMBA).state_slot(node)  # type: ignore[attr-defined,no-any-return]


def insert(
    cache: UnifiedRadixCache,
    tokens: list[int],
    swa_b: int = 0,
    state: bool = True,
    fill: Sequence[float] | None = None,
    flight: InFlight | None = None,
) -> bool:
    """Insert ``tokens`` with fresh slots holding known bytes (``fill[p]`` for position ``p``
    in every buffer; random when ``None``) and, with Mamba, a state for the key's end.
    Returns False when no device memory could be found."""
    n = len(tokens)
    alloc = cache.token_to_kv_pool_allocator
    value = alloc.alloc(n)
    if value is None:
        swa_n = n if cache.supports_swa() else 0
        cache.evict(EvictParams(num_tokens=n, swa_num_tokens=swa_n))
        value = alloc.alloc(n)
        if value is None:
            return False
    kv = cache.pools.kv_pool.kv  # type: ignore[union-attr]
    dev = kv.device  # the pools' data may live on a device; indices stay on the host
    if fill is None:
        kv[:, :, value] = torch.randn(kv[:, :, value].shape).to(dev)
    else:
        kv[:, :, value] = torch.tensor(fill[:n]).view(1, 1, n, 1, 1).to(dev)
    if cache.supports_swa():
        sv = alloc.translate(value)  # type: ignore[attr-defined]
        skv = swa_kv(cache)
        if fill is None:
            skv[:, :, sv] = torch.randn(skv[:, :, sv].shape).to(dev)
        else:
            skv[:, :, sv] = (torch.tensor(fill[:n]) + 0.5).view(1, 1, n, 1, 1).to(dev)
    mv = None
    slot = None
    if cache.supports_mamba() and state:
        pool = cache.pools.mamba
        slot = pool.alloc_slot()
        if slot is None:
            cache.evict(EvictParams(mamba_num=1))
            slot = pool.alloc_slot()
        if slot is not None:
            if fill is None:
                pool.conv[slot] = torch.randn(pool.conv[slot].shape).to(dev)
                pool.temporal[slot] = torch.randn(pool.temporal[slot].shape).to(dev)
            else:
                pool.conv[slot] = fill[n - 1] + 0.25
                pool.temporal[slot] = fill[n - 1] + 0.75
            mv = torch.tensor([slot], dtype=torch.int64)
    r = cache.insert(
        InsertParams(key=RadixKey(tokens), value=value, mamba_value=mv, swa_evicted_seqlen=swa_b)
    )
    if slot is not None and r.mamba_exist:
        cache.pools.mamba.free_slots([slot])
    check(cache, flight)
    return True


def match(
    cache: UnifiedRadixCache, tokens: list[int], flight: InFlight | None = None
) -> MatchResult:
    r = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    check(cache, flight)
    return r


def path_to(node: TreeNode) -> list[TreeNode]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    out.reverse()
    return out


@dataclass
class Snapshot:
    """Device bytes of a path by key position: Full KV per token, SWA KV per token where a
    node holds SWA, Mamba state per node end."""

    full: torch.Tensor
    swa_mask: list[bool]
    swa: torch.Tensor | None
    mamba: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def assert_equal(self, other: Snapshot) -> None:
        assert torch.equal(self.full, other.full)
        assert self.swa_mask == other.swa_mask
        assert (self.swa is None) == (other.swa is None)
        if self.swa is not None and other.swa is not None:
            assert torch.equal(self.swa, other.swa)
        assert self.mamba.keys() == other.mamba.keys()
        for k, (c, t) in self.mamba.items():
            assert torch.equal(c, other.mamba[k][0]) and torch.equal(t, other.mamba[k][1])


def snapshot(cache: UnifiedRadixCache, node: TreeNode) -> Snapshot:
    kv = cache.pools.kv_pool.kv  # type: ignore[union-attr]
    nodes = path_to(node)
    values = [n.data[FULL].value for n in nodes]  # type: ignore[union-attr]
    assert all(v is not None for v in values)
    full = kv[:, :, torch.cat(values)].clone()  # type: ignore[arg-type]
    mask: list[bool] = []
    swa: list[torch.Tensor] = []
    mamba: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    pos = 0
    for n in nodes:
        pos += n.key_len
        if cache.supports_swa():
            sv = n.data[SWA].value  # type: ignore[union-attr]
            mask += [sv is not None] * n.key_len
            if sv is not None:
                swa.append(swa_kv(cache)[:, :, sv].clone())
        if cache.supports_mamba():
            slot = mamba_slot(cache, n)
            if slot is not None:
                pool = cache.pools.mamba
                mamba[pos] = (pool.conv[slot].clone(), pool.temporal[slot].clone())
    return Snapshot(full, mask, torch.cat(swa, dim=2) if swa else None, mamba)


def zero_device(cache: UnifiedRadixCache) -> None:
    """Forget every device byte: what a load-back restores must come from host."""
    cache.pools.kv_pool.kv.zero_()  # type: ignore[union-attr]
    if cache.supports_swa():
        swa_kv(cache).zero_()
    if cache.supports_mamba():
        cache.pools.mamba.conv.zero_()
        cache.pools.mamba.temporal.zero_()


def seq(start: int, pages: int, ps: int) -> list[int]:
    return list(range(start, start + pages * ps))


def leaves(cache: UnifiedRadixCache) -> list[TreeNode]:
    return [n for n in cache.iter_nodes() if not n.children]


def demote_all(cache: UnifiedRadixCache) -> None:
    """Back every leaf up (parents first) and evict every device node to host."""
    for leaf in leaves(cache):
        cache.write_backup(leaf)
        check(cache)
    cache.evict(EvictParams(num_tokens=10**6))
    check(cache)
    assert all(n.evicted and n.backuped for n in cache.iter_nodes())


def host_free_all(cache: UnifiedRadixCache) -> bool:
    return all(c.host_available() == c.host_capacity() for c in cache.components)
