"""``SWAHarness``: a ``(FULL, SWA)`` cache plus the slots a test owns, with ``sanity_check()`` and
the conservation of both pools after every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from urc import (
    CacheConfig,
    ComponentType,
    EvictParams,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    RadixKey,
    TreeNode,
    UnifiedRadixCache,
    build_cache,
)
from urc.components.swa import SWAComponent
from urc.pools.swa import SWATokenSlotAllocator
from urc.specs import SlidingWindowSpec

FULL, SWA = ComponentType.FULL, ComponentType.SWA


class SWAHarness:
    """A ``(FULL, SWA)`` cache plus the slots the test owns, checked after every step."""

    def __init__(
        self, ps: int, window: int, pages: int | None = None, swa_pages: int | None = None
    ) -> None:
        self.ps = ps
        self.window = window
        self.cap = -(-window // ps) * ps
        cap_pages = self.cap // ps
        pages = max(96, 24 * cap_pages) if pages is None else pages
        self.cache: UnifiedRadixCache = build_cache(
            CacheConfig(
                components=(
                    FULL,
                    SlidingWindowSpec(window, None if swa_pages is None else swa_pages * ps),
                ),
                page_size=ps,
                kv_size=pages * ps,
                max_context_len=8 * (cap_pages + 4) * ps,
                max_num_reqs=8,
            )
        )
        alloc = self.cache.token_to_kv_pool_allocator
        assert isinstance(alloc, SWATokenSlotAllocator)
        self.alloc = alloc
        swa = self.cache.component(SWA)
        assert isinstance(swa, SWAComponent)
        self.swa = swa
        self.owned: list[torch.Tensor] = []  # spans the test holds (page-prefix runs)
        self.check()

    # ------------------------------------------------------------------ checks
    def held(self) -> dict[ComponentType, int]:
        ps = self.ps
        full = sum(-(-t.shape[0] // ps) * ps for t in self.owned)
        swa = sum(self.alloc.num_swa_mapped(t) for t in self.owned)
        return {FULL: full, SWA: swa}

    def check(self) -> None:
        self.cache.sanity_check()
        self.cache.check_pools(self.held())

    # ------------------------------------------------------------------ operations
    def seq(self, start: int, pages: int) -> list[int]:
        return list(range(start, start + pages * self.ps))

    def new_value(self, n: int) -> torch.Tensor:
        v = self.alloc.alloc(n)
        assert v is not None, f"test pool exhausted allocating {n}"
        self.owned.append(v)
        return v

    def give(self, v: torch.Tensor) -> None:
        """Ownership of ``v`` passed to the tree (or was freed)."""
        self.owned = [t for t in self.owned if t is not v]

    def insert(
        self,
        tokens: Sequence[int],
        swa_evicted_seqlen: int = 0,
        prev: torch.Tensor | None = None,
        free_out_of_window: bool = True,
    ) -> tuple[InsertResult, torch.Tensor]:
        """Insert ``tokens`` with fresh slots (after ``prev``, tree-owned indices of a prefix).

        With ``free_out_of_window`` the fresh slots below ``swa_evicted_seqlen`` have their
        SWA side freed first, as a running request would have done.
        """
        n_prev = 0 if prev is None else prev.shape[0]
        fresh = self.new_value(len(tokens) - n_prev)
        value = fresh if prev is None else torch.cat([prev, fresh])
        if free_out_of_window and swa_evicted_seqlen > n_prev:
            b = -(-swa_evicted_seqlen // self.ps) * self.ps
            self.alloc.free_swa(value[n_prev:b])
        r = self.cache.insert(
            InsertParams(
                key=RadixKey(list(tokens)),
                value=value,
                prev_prefix_len=n_prev,
                swa_evicted_seqlen=swa_evicted_seqlen,
            )
        )
        self.give(fresh)
        aligned = len(tokens) - len(tokens) % self.ps
        if aligned < len(tokens):
            self.alloc.free(value[aligned:])
        self.check()
        return r, value

    def match(self, tokens: Sequence[int]) -> tuple[int, TreeNode]:
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens))))
        self.check()
        return int(m.device_indices.shape[0]), m.last_device_node

    def evict(self, full: int = 0, swa: int = 0) -> tuple[int, int]:
        r = self.cache.evict(EvictParams(num_tokens=full, swa_num_tokens=swa))
        self.check()
        return r.num_tokens_evicted, r.swa_num_tokens_evicted

    def lock(self, node: TreeNode) -> IncLockRefResult:
        r = self.cache.inc_lock_ref(node)
        self.check()
        return r

    def unlock(self, node: TreeNode, receipt: IncLockRefResult) -> None:
        self.cache.dec_lock_ref(node, receipt.to_dec_params())
        self.check()

    def node(self, tokens: Sequence[int]) -> TreeNode:
        """The node whose path ends exactly after ``tokens`` (no mutation, no refresh)."""
        node = self.cache.root
        pos = 0
        tokens = list(tokens)
        while pos < len(tokens):
            for child in node.children.values():
                if tokens[pos : pos + child.key_len] == list(child.key):
                    node = child
                    pos += child.key_len
                    break
            else:
                raise AssertionError(f"no node path for {tokens[:8]}... at {pos}")
        return node

    def swa_of(self, node: TreeNode) -> torch.Tensor | None:
        cd = node.data[SWA]
        assert cd is not None
        return cd.value

    def full_of(self, node: TreeNode) -> torch.Tensor:
        cd = node.data[FULL]
        assert cd is not None and cd.value is not None
        return cd.value

    def locks(self) -> list[tuple[int, int, int]]:
        return sorted(
            (n.id, n.data[FULL].lock_ref, n.data[SWA].lock_ref)  # type: ignore[union-attr]
            for n in self.cache.iter_nodes()
        )

    def snapshot(self) -> tuple[Any, ...]:
        nodes = sorted(
            (
                n.id,
                n.key_len,
                n.data[FULL].lock_ref,  # type: ignore[union-attr]
                n.data[SWA].lock_ref,  # type: ignore[union-attr]
                n.data[SWA].value is not None,  # type: ignore[union-attr]
            )
            for n in self.cache.iter_nodes()
        )
        return (
            nodes,
            self.alloc.available_size(),
            self.alloc.swa_available_size(),
            self.swa.evictable_size,
            self.swa.protected_size,
            self.cache.full_evictable_size(),
            self.cache.full_protected_size(),
            self.swa.lru.ids(),
        )
