"""SWA: sliding-window-attention KV, with tombstones, window locks and tombstone recovery.

A hybrid SWA model keeps, per token, Full KV (every token) and SWA KV (only the last
``window`` tokens of a request are ever attended to; its ``SlidingWindowSpec``).  The tree
keeps Full indices on every node; the SWA value of a node is the translation of its Full
value through the paired allocator (``urc.pools.swa``).  A node whose SWA data was evicted
keeps its Full data: it is an SWA **tombstone** (``value is None``).

Token ranges of one insert (key positions; ``b`` = ``swa_evicted_seqlen`` rounded up to a
page, ``p`` = the insert's ``prefix_len``, ``n`` = the key length)::

    [0, p)          existing nodes.  A tombstone among them is recovered from the incoming
                    slots for its part at positions >= b (three cases, see
                    ``update_component_on_insert_overlap``); below b the incoming slots are
                    duplicates and the tree frees them (Full, and SWA if still mapped).
    [p, max(p, b))  new leaf part below b: an SWA tombstone (split off as its own node).
                    The request's SWA slots there were (or are now) freed via ``free_swa``.
    [max(p, b), n)  new leaf part with SWA; capped to one page-aligned window ``cap``: if
                    longer, split so that the leaf holds exactly ``cap`` tokens (both parts
                    keep SWA).  A window lock on the leaf then pins ``cap`` SWA tokens while
                    Full pins the whole path.

Request ranges (token positions of a running request; ``s`` = ``req.swa_evicted_seqlen``,
``c`` = ``cache_protected_len``)::

    [0, c)          tree-owned (locked through ``last_node``); never freed by the request
    [c, s)          request-owned; SWA freed by ``free_out_of_window_slots`` (Full kept)
    [max(c, s), ..) request-owned; Full and SWA allocated

Window lock (receipt = ``swa_uuid_for_lock`` + ``skip_lock_node_ids[SWA]`` +
``swa_lock_epoch``): acquire walks up from the node, skipping tombstones (recorded), locking
SWA until ``window`` tokens are locked, and stamps a uuid on the node that fills
the window.  Release walks the same way and stops at the node carrying that uuid (a split
moves the uuid to the upper part, which is the last node the lock covers).  A tombstone that
is recovered while some request holds a lock across it gets a restore stamp newer than that
lock's epoch, so the release skips it even if the node was split since (the skip set alone
cannot name the split-off part).

Eviction order: an LRU of nodes holding SWA.  Refresh policy: none on walk-down; on match end
and insert end the nodes covering one window above the end node are refreshed (ancestor
first), so old ancestors are tombstoned first and a recently used window stays intact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import count
from typing import TYPE_CHECKING

import torch

from urc.components.base import (
    EvictionSteps,
    EvictTracker,
    MatchValidator,
    PathValidator,
    TreeComponent,
)
from urc.components.full import check_full_lock
from urc.components.swa_data import SWAData
from urc.components.swa_window import (
    deepest_window_boundary,
    free_out_of_window,
    select_window_walks,
    window_match_validator,
    window_path_validator,
)
from urc.errors import ConfigError, InvalidInputError
from urc.host_protocol import TransferItem
from urc.lru import LinkedLRUList
from urc.node import FULL_INDEX, ComponentData, ComponentType, Tier, TreeNode
from urc.pools.swa import SWATokenSlotAllocator
from urc.specs import SlidingWindowSpec

if TYPE_CHECKING:
    from urc.config import CacheConfig
    from urc.params import (
        DecLockRefParams,
        EvictParams,
        IncLockRefResult,
        InsertParams,
        InsertResult,
        MatchPrefixParams,
        MatchResult,
    )
    from urc.pools.cache_pools import CachePools
    from urc.request_protocol import CachingRequest
    from urc.tree import Tree

__all__ = ["SWAComponent", "SWAData"]

_SWA = 1
_SWA_TYPE = ComponentType.SWA  # a module constant: an Enum attribute load costs ~0.1 µs
# Candidates taken from the LRU end per scan while evicting (rescanned only if all locked).
_EVICT_BATCH = 64


class SWAComponent(TreeComponent):
    """Sliding-window KV (see the module docstring)."""

    component_type = ComponentType.SWA
    # Its release checks the node's Full lock before it changes anything.
    release_implies_full_lock = True

    def __init__(
        self, tree: Tree, pools: CachePools, config: CacheConfig, evictor: EvictionSteps
    ) -> None:
        super().__init__(tree, pools, config, evictor)
        allocator = pools.token_allocator
        if not isinstance(allocator, SWATokenSlotAllocator):
            raise ConfigError("SWA needs an SWATokenSlotAllocator as the token allocator")
        window = config.spec(SlidingWindowSpec).window  # checked by the spec
        self.allocator = allocator
        self.window = window
        ps = config.page_size
        self.page_size = ps
        # Longest SWA span a new leaf keeps: one window, rounded up to whole pages.
        self.leaf_cap = -(-window // ps) * ps
        self.lru = LinkedLRUList()
        self._uuids = count(1)
        # Bumped on every recovery of a Full-locked tombstone (see the module docstring).
        self._epoch = 0
        # (receipt, node, cache clock, nodes to unlock) from the last ``check_release``.
        self._plan: tuple[DecLockRefParams | None, TreeNode, int, list[TreeNode]] | None = None
        # The window-lock walks, compiled or their Python twins (``CacheConfig.walk_impl``).
        self._window_locked, self._window_release = select_window_walks(config.walk_impl)

    def new_data(self) -> SWAData:
        return SWAData()

    def value_len(self, data: ComponentData) -> int:
        v = data.value
        return 0 if v is None else v.shape[0]

    def _boundary(self, params: InsertParams) -> int:
        """``swa_evicted_seqlen`` rounded up to a page: below it there is no SWA data (a
        partly freed page has no usable SWA page)."""
        ps = self.page_size
        return -(-params.get_evicted_seqlen(ComponentType.SWA) // ps) * ps

    # ------------------------------------------------------------------ match
    def uses_hook(self, name: str) -> bool:
        # The result's SWA field is about host hits: without a host tier there is none.
        return name != "finalize_match_result" or self.host_tier is not None

    def finalize_match_result(
        self,
        result: MatchResult,
        params: MatchPrefixParams,
        path: Sequence[TreeNode],
        best_len: int,
        visited_tokens: int,
    ) -> MatchResult:
        """Reports ``swa_host_hit_length``: tokens past the device hit with SWA on host."""
        if result.host_hit_length:
            result = result._replace(swa_host_hit_length=self.host_hit_tokens(result))
        return result

    def create_match_validator(self, match_device_only: bool) -> MatchValidator:
        return window_match_validator(self.window, match_device_only)

    def create_path_validator(
        self, path: Sequence[TreeNode], match_device_only: bool
    ) -> PathValidator:
        return window_path_validator(path, self.window, match_device_only)

    def deepest_boundary(self, path: Sequence[TreeNode], match_device_only: bool) -> int:
        return deepest_window_boundary(path, self.window, match_device_only)

    def device_match_window(self) -> int:
        return self.window  # deepest_window_boundary's device rule

    def _refresh(self, node: TreeNode) -> None:
        """Move the nodes covering one window plus one page above ``node`` (inclusive) to the
        MRU end, ancestors first; tombstones count toward the span but are not in the list.
        (SGLang's span: the extra page covers a window that starts mid-page.)"""
        window = self.window + self.page_size
        move = self.lru.move_to_mru
        if node.key_len >= window:
            cd = node.swa
            if cd.value is not None:  # type: ignore[union-attr]
                move(cd)  # type: ignore[arg-type]
            return
        chain: list[SWAData] = []
        acc = 0
        while node.parent is not None and acc < window:
            cd = node.swa
            if cd.value is not None:  # type: ignore[union-attr]
                chain.append(cd)  # type: ignore[arg-type]
            acc += node.key_len
            node = node.parent
        for cd in reversed(chain):
            move(cd)

    def on_match_end(self, path: Sequence[TreeNode], best_len: int) -> None:
        if best_len:
            self._refresh(path[best_len - 1])

    def on_insert_end(self, path: Sequence[TreeNode]) -> None:
        if path:
            self._refresh(path[-1])

    # ------------------------------------------------------------------ insert
    def validate_insert(self, params: InsertParams, key_len: int) -> None:
        s = params.get_evicted_seqlen(ComponentType.SWA)
        # An EAGLE key is one shorter than the request's token ids.
        limit = key_len + 1 if self.tree.is_eagle else key_len
        if not 0 <= s <= limit:
            raise InvalidInputError(f"swa_evicted_seqlen must be in [0, {limit}], got {s}")

    def _add_swa(self, node: TreeNode) -> None:
        """Give ``node`` the SWA translation of its Full value (its Full slots map SWA)."""
        full = node.full.value
        cd = node.swa
        assert full is not None and isinstance(cd, SWAData) and cd.value is None
        cd.value = self.allocator.translate(full)
        cd.on_device = True
        self.evictable_size += node.key_len
        self.lru.push_mru(cd, node)

    def commit_insert_component_data(
        self,
        node: TreeNode,
        is_new_leaf: bool,
        params: InsertParams,
        result: InsertResult,
    ) -> TreeNode:
        if not is_new_leaf:
            return node
        cut = self._boundary(params) - result.prefix_len
        if cut > 0:
            if cut >= node.key_len:
                # Entirely below the boundary: a tombstone leaf that lives on its Full value.
                self.allocator.release_swa(node.full.value)  # type: ignore[arg-type]
                return node
            upper = self.tree.split(node, cut)
            self.allocator.release_swa(upper.full.value)  # type: ignore[arg-type]
        self._add_swa(node)
        excess = node.key_len - self.leaf_cap
        if excess > 0:
            # The upper part keeps SWA too; only the leaf is what a window lock pins.
            self.tree.split(node, excess)
        return node

    def update_component_on_insert_overlap(
        self,
        node: TreeNode,
        prefix_len: int,
        total_prefix_len: int,
        value: torch.Tensor,
        params: InsertParams,
    ) -> int:
        """Recover an SWA tombstone from the incoming slots where they are in the window.

        With ``start = b - total_prefix_len`` (``b``: the insert's SWA boundary):
        (1) ``start <= 0``: the whole node is in the window: recover it all;
        (2) ``0 < start < prefix_len``: split at ``start``; the upper part stays a
        tombstone, the lower part is recovered;
        (3) ``start >= prefix_len``: the node is outside the window: nothing to do.
        Only when every incoming slot is request-owned (``prev_prefix_len <=
        total_prefix_len``) and still maps SWA.  Recovery of a node whose Full value is
        unlocked adopts the incoming slots as its Full value (freeing the old ones); when
        Full is locked its indices stay and only the SWA pages move onto them.
        """
        cd = node.swa
        assert isinstance(cd, SWAData)
        if cd.value is not None or params.prev_prefix_len > total_prefix_len:
            return prefix_len
        start = self._boundary(params) - total_prefix_len
        if start >= prefix_len:
            return prefix_len
        start = max(start, 0)
        fresh = value[total_prefix_len + start : total_prefix_len + prefix_len]
        if not self.allocator.swa_mapped(fresh):
            return prefix_len
        if start:
            self.tree.split(node, start)
        full = node.data[FULL_INDEX]
        assert full is not None and full.value is not None
        if full.lock_ref == 0:
            old = full.value
            full.value = fresh.clone()
            # ``old`` maps no SWA (cleared when it was tombstoned): this frees Full only.
            self.allocator.free_owned(old)
            self._add_swa(node)
            return start
        # Full is locked: its indices are in use and must not change.  Move the SWA pages
        # onto them; the tree then frees the incoming Full slots as duplicates.
        self.allocator.move_swa(full.value, fresh)
        self._epoch += 1
        cd.restored = self._epoch
        self._add_swa(node)
        return prefix_len

    def recover_after_unevict(
        self, node: TreeNode, total_prefix_len: int, params: InsertParams
    ) -> None:
        """A host-only node (an SWA tombstone on device) just adopted the insert's slots as
        its Full value.  Same three cases as ``update_component_on_insert_overlap`` with
        ``start = b - total_prefix_len``: the part at ``start`` and below gets SWA when those
        slots still map SWA pages (split off first when ``0 < start``); the rest stays a
        tombstone and the SWA pages of its slots are released, so nothing leaks."""
        full = node.full.value
        assert full is not None
        alloc = self.allocator
        start = max(self._boundary(params) - total_prefix_len, 0)
        if start >= node.key_len or not alloc.swa_mapped(full[start:]):
            alloc.release_swa(full)
            return
        if start:
            upper = self.tree.split(node, start)
            alloc.release_swa(upper.full.value)  # type: ignore[arg-type]
        self._restored(node)

    def _restored(self, node: TreeNode) -> None:
        """Give the tombstone ``node`` SWA (its Full slots map SWA pages) and stamp it, so a
        window lock taken while it was a tombstone never releases it (module docstring)."""
        self._epoch += 1
        cd = node.swa
        assert isinstance(cd, SWAData)
        cd.restored = self._epoch
        self._add_swa(node)

    # ------------------------------------------------------------------ split
    def redistribute_on_node_split(self, new_parent: TreeNode, child: TreeNode) -> None:
        c = child.swa
        p = new_parent.swa
        assert isinstance(c, SWAData) and isinstance(p, SWAData)
        k = new_parent.key_len
        v = c.value
        if v is not None:
            p.value = v[:k]
            p.on_device = True
            c.value = v[k:]
            # A split is no use of either part (SGLang 0.5.23): the lower part keeps its
            # place and the upper part goes just before it (ancestors are tombstoned first).
            self.lru.insert_before(c, p, new_parent)
        hv = c.host_value
        if hv is not None:
            p.host_value = hv[:k]
            c.host_value = hv[k:]
        p.lock_ref = c.lock_ref
        p.host_lock_ref = c.host_lock_ref
        # The window-lock boundary is the top of the locked span: the upper part.
        p.uuid = c.uuid
        c.uuid = None
        p.restored = c.restored

    # ------------------------------------------------------------------ eviction
    def eviction_priority(self, is_leaf: bool) -> int:
        return 0 if is_leaf else 1

    def evict_request(self, params: EvictParams) -> int:
        return params.swa_num_tokens

    def drive_eviction(self, params: EvictParams, tracker: EvictTracker) -> None:
        """Tombstone (internal node) or delete (leaf) nodes from the LRU end, skipping locked
        ones, until ``swa_num_tokens`` are freed."""
        target = params.swa_num_tokens
        evictor = self.evictor
        batch = _EVICT_BATCH
        while tracker[_SWA] < target:
            candidates = self.lru.oldest(batch)
            progressed = False
            for node in candidates:
                if tracker[_SWA] >= target:
                    return
                cd = node.swa
                # Gone or tombstoned by an earlier cascade in this batch, or locked.
                if cd.lru_next is None or cd.lock_ref:  # type: ignore[union-attr]
                    continue
                evictor.cascade(node, self, tracker)
                progressed = True
            if not progressed:
                if len(candidates) < batch:
                    return
                batch *= 2

    def evict_component(self, node: TreeNode, tier: Tier = Tier.DEVICE) -> int:
        assert tier is Tier.DEVICE, "host tiers are evicted by the HiCache layer"
        cd = node.swa
        assert cd is not None
        value = cd.value
        assert value is not None and cd.lock_ref == 0, (
            f"evicting SWA of node {node.id}: value={value is not None} lock={cd.lock_ref}"
        )
        full = node.full.value
        assert full is not None, f"node {node.id} has SWA without Full"
        # Frees the SWA pages and clears the map (queued until the allocator next needs
        # them), so no later free can hit a reused page.
        self.allocator.free_swa_owned(full)
        cd.value = None
        cd.on_device = False
        self.lru.remove(cd)  # type: ignore[arg-type]
        n = node.key_len  # == len(value) (check_node)
        self.evictable_size -= n
        return n

    # ------------------------------------------------------------------ locks
    def acquire_component_lock(self, node: TreeNode, result: IncLockRefResult) -> None:
        window = self.window
        acc = 0
        delta = 0
        skipped: set[int] | None = None
        while node.parent is not None:
            cd: SWAData = node.swa  # type: ignore[assignment]  # (new_data)
            if not cd.on_device:
                if skipped is None:
                    skipped = result.skip_lock_node_ids.setdefault(_SWA_TYPE, set())
                skipped.add(node.id)
            else:
                if cd.lock_ref == 0:
                    delta += node.key_len
                cd.lock_ref += 1
                acc += node.key_len
                if acc >= window:
                    uuid = cd.uuid
                    if uuid is None:
                        uuid = cd.uuid = next(self._uuids)
                    result.swa_uuid_for_lock = uuid
                    break
            node = node.parent
        result.swa_lock_epoch = self._epoch
        self.evictable_size -= delta
        self.protected_size += delta

    def check_release(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        """Validate the release (see ``py_window_locked``) and keep the walk as the plan of the
        ``release_component_lock`` that follows, so an unlock walks the window once."""
        self._plan = None
        if params is not None and params.skip_swa:
            return
        locked = self._window_locked(node, _SWA_TYPE, params, self.window)
        # Valid until the tree changes: every walk that can split or recover a node ticks
        # the cache clock.
        self._plan = (params, node, self.tree.clock, locked)

    def release_component_lock(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        """Undo the window lock of receipt ``params``.  Uses the walk of the ``check_release``
        just before it when there was one; otherwise walks checked itself, releasing as it
        goes (raising, nothing released, for a receipt that does not fit)."""
        if params is not None and params.skip_swa:
            return
        plan = self._plan
        self._plan = None
        # Full's lock first (``release_implies_full_lock``): the walk can pass an unlocked
        # SWA tombstone and take counts that other locks hold on the window above it.  The
        # common case inline, Full's own check for the rest.
        full_locks = node.full.lock_ref
        if full_locks <= 0 or (params is not None and params.full_start_id is not None):
            check_full_lock(node, params)
        if (
            plan is not None
            and plan[0] is params
            and plan[1] is node
            and plan[2] == self.tree.clock
        ):
            delta = 0
            for n in plan[3]:
                cd = n.swa
                assert cd is not None and cd.lock_ref > 0, f"SWA release on unlocked node {n.id}"
                cd.lock_ref -= 1
                if cd.lock_ref == 0:
                    delta += n.key_len
        else:
            delta = self._window_release(node, _SWA_TYPE, params, self.window)
        self.evictable_size += delta
        self.protected_size -= delta

    # ------------------------------------------------------------------ host tier (HiCache)
    # Backup uses the defaults: the source is the SWA value (SWA slots), per token; a
    # tombstone has nothing to back up.  Load-back: the Full slots the load reserved come
    # from the paired allocator, so they already map fresh SWA pages.  ``commit_host_insert``
    # (SWA host data read from L3 storage) uses the per-token default too: a node gets SWA
    # host data only where a stored part covers it whole, else it stays an SWA tombstone.
    def host_mirror_buffers(self) -> list[tuple[torch.Tensor, int]] | None:
        swa = self.pools.swa
        return None if swa is None else swa.kv_pool.slot_buffers()

    def load_target(self, node: TreeNode, full_device: torch.Tensor) -> TransferItem | None:
        """Restore the SWA host copy into the SWA pages of ``full_device``; without one the
        node comes back as an SWA tombstone and those pages are released now."""
        cd = node.swa
        assert cd is not None and cd.value is None
        alloc = self.allocator
        if cd.host_value is None or not alloc.swa_mapped(full_device):
            alloc.release_swa(full_device)
            return None
        return TransferItem(ComponentType.SWA, alloc.translate(full_device), cd.host_value)

    def commit_load(self, pieces: Sequence[TreeNode], device: torch.Tensor) -> None:
        """Pieces whose Full value is the load's slots (their translation is ``device``) get
        SWA.  A piece that got device data meanwhile (an insert adopted it) keeps its own:
        Full already freed the load's slots with their SWA pages."""
        alloc = self.allocator
        pos = 0
        for piece in pieces:
            n = piece.key_len
            part = device[pos : pos + n]
            pos += n
            cd = piece.swa
            full = piece.full.value
            assert cd is not None
            if cd.value is not None or full is None or not torch.equal(alloc.translate(full), part):
                continue
            self._restored(piece)

    # ``release_load_slots`` stays a no-op: Full frees the load's slots and with them every
    # SWA page they still map.

    def add_alloc_shortfall(self, params: EvictParams, num_tokens: int) -> EvictParams:
        ps = self.page_size
        need = -(-num_tokens // ps) * ps - self.allocator.swa_available_size()
        if need <= params.swa_num_tokens:
            return params
        return replace(params, swa_num_tokens=need)

    # ------------------------------------------------------------------ request caching
    def prepare_for_caching_req(
        self, req: CachingRequest, params: InsertParams, token_len: int, is_finished: bool
    ) -> int | None:
        params.set_evicted_seqlen(ComponentType.SWA, min(req.swa_evicted_seqlen, token_len))
        return None

    def free_out_of_window_slots(self, req: CachingRequest, pre_len: int) -> int:
        """Free the SWA slots of ``req``'s own tokens that slid out of the window (see
        :func:`urc.components.swa_window.free_out_of_window`); returns the tokens freed."""
        pool = self.pools.req_to_token_pool
        return free_out_of_window(req, pre_len, self.window, self.page_size, pool, self.allocator)

    # ------------------------------------------------------------------ pools and checks
    def pool_capacity(self) -> int:
        return self.allocator.swa_size

    def pool_available(self) -> int:
        return self.allocator.swa_available_size()

    def check_node(self, node: TreeNode) -> None:
        cd = node.swa
        full = node.data[FULL_INDEX]
        assert cd is not None and full is not None
        if cd.value is not None:
            assert cd.value.shape[0] == node.key_len, (
                f"node {node.id}: SWA value len {cd.value.shape[0]} != key len {node.key_len}"
            )
            assert isinstance(cd, SWAData) and cd.lru_node is node, (
                f"node {node.id} holds SWA but is not in the SWA LRU"
            )
            assert full.value is not None
            assert torch.equal(cd.value, self.allocator.translate(full.value)), (
                f"node {node.id}: SWA value is not the translation of its Full value"
            )
            assert int(cd.value.min()) >= 0, f"node {node.id}: SWA value has unmapped slots"
        else:
            assert cd.lock_ref == 0, f"node {node.id}: SWA tombstone with lock {cd.lock_ref}"
            assert isinstance(cd, SWAData) and cd.lru_next is None, (
                f"SWA tombstone {node.id} is in the SWA LRU"
            )
            if full.value is not None:
                assert self.allocator.num_swa_mapped(full.value) == 0, (
                    f"SWA tombstone {node.id} still maps SWA pages (leak)"
                )
        if cd.host_value is not None:
            assert cd.host_value.shape[0] == node.key_len, (
                f"node {node.id}: SWA host value len {cd.host_value.shape[0]} != {node.key_len}"
            )
            assert full.host_value is not None, f"node {node.id}: SWA on host without Full"

    def check_structures(self, nodes: Sequence[TreeNode]) -> None:
        with_swa = 0
        for n in nodes:
            cd = n.swa
            assert cd is not None
            if cd.value is not None:
                with_swa += 1
        assert len(self.lru) == with_swa, (
            f"SWA LRU holds {len(self.lru)} nodes, {with_swa} nodes hold SWA"
        )

    def reset(self) -> None:
        super().reset()
        self.lru.clear()
