"""MAMBA: recurrent (SSM) state slots, one per checkpointed position.

A Mamba layer's state after tokens ``[0, p)`` is one fixed-size slot of the Mamba pool
(``urc.pools.mamba``), not per-token KV.  The tree keeps such a state only on the node whose
key ends at ``p`` -- a leaf, or a *checkpoint* node -- so a node's ``value`` is a 1-element
int64 tensor (the slot) or ``None``.  A match is valid only on a node with state: a request
resumes from exactly that state, and copy-on-write (``cow_mamba``) gives it its own copy.

Rules (docs/architecture.md §5):

- A split gives the new upper node no state (the state belongs to the end of the key).
- Insert: the target node adopts ``InsertParams.mamba_value``'s slot; if it already has state
  it keeps it and ``InsertResult.mamba_exist`` tells the caller to free its own slot.
- Eviction walks the Mamba LRU from the oldest end, skipping locked states: an internal node
  loses only its state (lowest priority, no cascade); a leaf is deleted with every component.
  A state is refreshed when it is used: the node a match ends on, the target of an insert.
  Checkpoints a walk merely passes through keep their age.
- A lock pins only the node's own state, and only where every higher lock on the node pins
  it too (``full >= swa >= mamba`` per node).  The receipt records the nodes it skipped.

A request's own slots and who frees them: :mod:`urc.components.mamba_requests`.

Units: states (``unit = SizeUnit.STATES``): sizes count slots, ``EvictParams.mamba_num`` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from urc.components.base import (
    EvictionSteps,
    EvictTracker,
    MatchValidator,
    PathValidator,
    TreeComponent,
)
from urc.components.mamba_data import MambaData
from urc.components.mamba_requests import MambaRequestSlots
from urc.errors import (
    ConfigError,
    InvalidInputError,
    InvalidLockError,
)
from urc.host_protocol import TransferItem
from urc.lru import LRUList
from urc.node import (
    FULL_INDEX,
    ComponentData,
    ComponentType,
    SizeUnit,
    Tier,
    TreeNode,
)
from urc.params import EvictParams, MatchResult
from urc.pools.indices import index_tensor
from urc.specs import MambaSpec

if TYPE_CHECKING:
    from urc.config import CacheConfig
    from urc.host_protocol import HostPart
    from urc.params import (
        DecLockRefParams,
        IncLockRefResult,
        InsertParams,
        InsertResult,
        MatchPrefixParams,
    )
    from urc.pools.cache_pools import CachePools
    from urc.pools.mamba import MambaPool
    from urc.request_protocol import CachingRequest
    from urc.tree import Tree

__all__ = ["MambaComponent", "MambaData"]

_M = 2  # ComponentType.MAMBA
_MAMBA = ComponentType.MAMBA
_EVICT_ONE = EvictParams(mamba_num=1)
_NO_PENDING: tuple[None, int] = (None, -1)


# Module-level predicates: no closure is built per match or per eviction.
def _has_state(node: TreeNode) -> bool:
    return node.mamba.on_device  # type: ignore[union-attr]


def _has_state_any_tier(node: TreeNode) -> bool:
    # Host pass: a host-only node's host state counts (a load-back restores it); a node on
    # device counts only with state on device (a load-back leaves it as it is).
    cd = node.mamba
    assert cd is not None
    if cd.on_device:
        return True
    return cd.host_value is not None and node.full.value is None


def _unlocked(node: TreeNode) -> bool:
    return node.mamba.lock_ref == 0  # type: ignore[union-attr]


class MambaComponent(TreeComponent):
    """Mamba/SSM state: one pool slot on each leaf or checkpoint node (see module doc)."""

    component_type = ComponentType.MAMBA
    unit = SizeUnit.STATES
    # A release changes only the state lock of the node itself, which the acquire took there
    # together with Full's own lock on that (device) node.
    release_implies_full_lock = True

    def __init__(
        self, tree: Tree, pools: CachePools, config: CacheConfig, evictor: EvictionSteps
    ) -> None:
        super().__init__(tree, pools, config, evictor)
        pool = pools.mamba
        if pool is None:
            raise ConfigError("the MAMBA component needs a Mamba pool (CachePools.mamba)")
        self.pool: MambaPool = pool
        self.device = pool.index_device  # of index tensors (the states: pool.device)
        self.page_size = config.page_size
        self.chunk_size = config.spec(MambaSpec).chunk_size
        self.is_eagle = config.is_eagle
        self.requests = MambaRequestSlots(pool, self.page_size, self.is_eagle, self._alloc_slot)
        self.lru = LRUList()
        # One 1-element index tensor per slot, stored as node values: views of one arange,
        # made in one ``unbind`` (a slice per insert would cost a torch call each).  Never
        # handed to callers, who might modify them in place.
        ids = torch.arange(pool.size, dtype=torch.int64, device=self.device)
        self._values: tuple[torch.Tensor, ...] = ids.view(-1, 1).unbind(0)
        # Auxiliary components above Mamba in the lock order (SWA); see _may_lock.
        self._above = tuple(
            ct for ct in config.types if ComponentType.FULL < ct < ComponentType.MAMBA
        )
        # (params, slot) of the insert validated last, so commit need not read the tensor.
        self._pending: tuple[InsertParams | None, int] = (None, -1)

    # ------------------------------------------------------------------ node data
    def new_data(self) -> MambaData:
        return MambaData()

    def value_len(self, data: ComponentData) -> int:
        return 0 if data.value is None else 1

    def node_has_component_data(self, node: TreeNode, tier: Tier = Tier.DEVICE) -> bool:
        cd = node.mamba
        assert cd is not None
        return (cd.value if tier is Tier.DEVICE else cd.host_value) is not None

    def state_slot(self, node: TreeNode) -> int | None:
        """The pool slot of ``node``'s state, or ``None`` (no state on device)."""
        slot = node.mamba.slot  # type: ignore[union-attr]
        return None if slot < 0 else slot

    # ------------------------------------------------------------------ match
    def validate_match(self, params: MatchPrefixParams) -> None:
        if not params.cow_mamba:
            return
        req = params.req
        if req is None:
            raise InvalidInputError("match_prefix with cow_mamba=True needs a request (req)")
        if req.mamba_pool_idx is not None:
            self.requests.caller_slot(req.mamba_pool_idx, "req.mamba_pool_idx")

    def create_match_validator(self, match_device_only: bool) -> MatchValidator | None:
        # A boundary is valid only where a state exists: the request resumes from it.
        return _has_state if match_device_only else _has_state_any_tier

    def create_path_validator(
        self, path: Sequence[TreeNode], match_device_only: bool
    ) -> PathValidator:
        has = _has_state if match_device_only else _has_state_any_tier
        return lambda i: has(path[i - 1])

    def deepest_boundary(self, path: Sequence[TreeNode], match_device_only: bool) -> int:
        # The deepest node with a state (the path validator's answer, without building it).
        has = _has_state if match_device_only else _has_state_any_tier
        for i in range(len(path), 0, -1):
            if has(path[i - 1]):
                return i
        return 0

    def device_match_window(self) -> int:
        return 0  # a state on the node itself: deepest_boundary's device rule

    def on_match_end(self, path: Sequence[TreeNode], best_len: int) -> None:
        # Only the state the match ends on is used; ancestors' checkpoints keep their age.
        if best_len:
            self.lru.promote(path[best_len - 1])

    def _host_state_hit(self, result: MatchResult) -> int:
        """Tokens from the device hit down to the deepest node past it whose Mamba state is
        on host (a state restores the whole prefix up to its node)."""
        segment: list[TreeNode] = []
        node = result.best_match_node
        while node is not result.last_device_node and node.parent is not None:
            segment.append(node)
            node = node.parent
        for i, n in enumerate(segment):  # deepest first
            cd = n.data[ComponentType.MAMBA]
            if cd is not None and cd.host_value is not None:
                return sum(m.key_len for m in segment[i:])
        return 0

    def finalize_match_result(
        self,
        result: MatchResult,
        params: MatchPrefixParams,
        path: Sequence[TreeNode],
        best_len: int,
        visited_tokens: int,
    ) -> MatchResult:
        """Sets ``mamba_branching_seqlen`` and performs copy-on-write.

        Branching: when the walk went past the best (stateful) node, cached KV continues
        beyond the hit, so the request should snapshot its state at ``floor(visited /
        chunk) * chunk`` (page-aligned too); the next request sharing that prefix then hits
        there.  The value is also stored on ``params.req``.

        Copy-on-write (``cow_mamba``): the request gets the matched state in its own slot
        (``req.mamba_pool_idx``, allocated if missing -- evicting one state if the pool is
        full, with the matched node locked meanwhile).  The node keeps its state.  If no
        slot can be had (every state locked or held), the match degrades to a miss: a hit
        without its state is useless to the request.
        """
        if result.host_hit_length:
            result = result._replace(mamba_host_hit_length=self._host_state_hit(result))
        req = params.req
        branching = None
        if best_len < len(path):
            branching = visited_tokens // self.chunk_size * self.chunk_size
            branching -= branching % self.page_size
            result = result._replace(mamba_branching_seqlen=branching)
        if req is not None:
            req.mamba_branching_seqlen = branching
        if params.cow_mamba and best_len:
            assert req is not None  # validate_match
            node = result.last_device_node
            src = node.mamba.slot  # type: ignore[union-attr]
            if src >= 0:
                idx = req.mamba_pool_idx
                if idx is None:
                    dst = self._alloc_slot(node)
                    if dst is None:
                        root = self.tree.root
                        empty = (
                            torch.empty(0, dtype=torch.int64, device=self.tree.device)
                            if params.with_indices
                            else None
                        )
                        return MatchResult(
                            empty,
                            root,
                            root,
                            root,
                            mamba_branching_seqlen=branching,
                            device_len=0,
                        )
                    req.mamba_pool_idx = index_tensor(dst, self.device)
                else:
                    dst = int(idx.item())
                req.start_from_mamba_state(self.pool, src, dst)
        return result

    def _alloc_slot(self, protect: TreeNode | None) -> int | None:
        """A caller-held slot, evicting one unlocked state if the pool is full; ``None`` if
        nothing can be evicted.  ``protect`` (the copy source) is locked during the eviction;
        the lock is released with its receipt (SWA window locks need it)."""
        pool = self.pool
        slot = pool.alloc_slot()
        if slot is not None or self.evictable_size == 0:
            return slot
        self.evictor.evict(_EVICT_ONE, protect)
        return pool.alloc_slot()

    # ------------------------------------------------------------------ insert
    def validate_insert(self, params: InsertParams, key_len: int) -> None:
        mv = params.mamba_value
        if mv is None:
            return
        slot = self.requests.caller_slot(mv, "mamba_value")
        if key_len % self.page_size:
            # The insert would drop the unaligned tail and put the state at the wrong position.
            raise InvalidInputError(
                f"a Mamba state needs a page-aligned key: {key_len} tokens, page {self.page_size}"
            )
        self._pending = (params, slot)

    def commit_insert_component_data(
        self,
        node: TreeNode,
        is_new_leaf: bool,
        params: InsertParams,
        result: InsertResult,
    ) -> TreeNode:
        cd: MambaData = node.mamba  # type: ignore[assignment]  # (new_data)
        if cd.on_device:
            # The node keeps its state; the caller still owns (and frees) its slot.
            result.mamba_exist = True
            self.lru.promote(node)
            self.tree.touch(node)  # an insert onto an existing node re-stamps it (SGLang)
            return node
        mv = params.mamba_value
        if mv is None:
            return node
        p, slot = self._pending
        if p is not params:
            slot = int(mv.item())
        self._pending = _NO_PENDING
        assert cd.lock_ref == 0, f"node {node.id}: Mamba tombstone with lock {cd.lock_ref}"
        cd.value = self._values[slot]
        cd.on_device = True
        cd.slot = slot
        self.pool.adopt(slot)
        self.lru.insert_mru(node)
        self.evictable_size += 1
        if not is_new_leaf:
            self.tree.touch(node)
        return node

    # ------------------------------------------------------------------ split
    def redistribute_on_node_split(self, new_parent: TreeNode, child: TreeNode) -> None:
        # The state belongs to the end of the key, which stays with ``child``; the new upper
        # node starts with no state and no lock (``new_data``).  A split is no use of the
        # state: ``child`` keeps its place in the LRU (SGLang 0.5.23; 0.5.16 promoted it).
        return

    # ------------------------------------------------------------------ eviction
    def evict_request(self, params: EvictParams) -> int:
        return params.mamba_num

    def drive_eviction(self, params: EvictParams, tracker: EvictTracker) -> None:
        target = params.mamba_num
        lru = self.lru
        evictor = self.evictor
        while tracker[_M] < target:
            node = lru.first_where(_unlocked)
            if node is None:
                return
            if node.children:
                # Internal: tombstone the state only (lowest priority: no cascade).
                tracker[_M] += self.evict_component(node, Tier.DEVICE)
            else:
                # Leaf: the node goes with every component (or, if its Full data is
                # locked, every unlocked lower-priority component's data).
                evictor.cascade(node, self, tracker)

    def evict_component(self, node: TreeNode, tier: Tier = Tier.DEVICE) -> int:
        assert tier is Tier.DEVICE, "host tiers are evicted by the HiCache layer"
        cd: MambaData = node.mamba  # type: ignore[assignment]  # (new_data)
        assert cd.value is not None and cd.lock_ref == 0, (
            f"evicting Mamba state of node {node.id}: {cd}"
        )
        slot = cd.slot
        cd.value = None
        cd.on_device = False
        cd.slot = -1
        self.lru.remove(node)
        self.pool.release_tree_slot(slot)
        self.evictable_size -= 1
        return 1

    # ------------------------------------------------------------------ host tier (HiCache)
    # A state is one host slot (host pool page 1).  It lives on the node whose key ends at
    # its position: after a split, the lowest piece (the original node object).
    def host_mirror_buffers(self) -> list[tuple[torch.Tensor, int]] | None:
        return [(self.pool.conv, 0), (self.pool.temporal, 0)]

    def commit_backup(
        self, pieces: Sequence[TreeNode], host: torch.Tensor, source: torch.Tensor
    ) -> None:
        """Attach the host copy to the bottom piece, unless its state changed meanwhile
        (evicted or replaced despite the backup's locks: a lock skips a state where SWA is a
        tombstone) or it already has a host copy; then the host slot is freed."""
        node = pieces[-1]
        cd: MambaData = node.mamba  # type: ignore[assignment]  # (new_data)
        if cd.value is None or cd.host_value is not None or cd.slot != int(source.item()):
            tier = self.host_tier
            assert tier is not None
            tier.host_free(ComponentType.MAMBA, host)
            return
        cd.host_value = host
        self.add_host(cd, 1)

    def commit_host_insert(self, node: TreeNode, start: int, parts: Sequence[HostPart]) -> None:
        """A state read from a lower tier belongs to the node ending exactly at its position
        (a point part, ``start == end``); other nodes get none."""
        cd = node.mamba
        assert cd is not None
        if cd.host_value is not None:
            return
        end = start + node.key_len
        for part in parts:
            if part.start == part.end == end and part.host.shape[0] == 1 and not part.taken:
                cd.host_value = part.host
                self.add_host(cd, 1)
                part.taken.append((0, 1))
                return

    def load_target(self, node: TreeNode, full_device: torch.Tensor) -> TransferItem | None:
        """A held slot for the node's host state (evicting one unlocked state if the pool is
        full).  Without one the node comes back without state (a Mamba tombstone)."""
        cd = node.mamba
        assert cd is not None
        if cd.host_value is None or cd.value is not None:
            return None
        slot = self._alloc_slot(None)
        if slot is None:
            return None
        return TransferItem(ComponentType.MAMBA, self._values[slot], cd.host_value)

    def commit_load(self, pieces: Sequence[TreeNode], device: torch.Tensor) -> None:
        """The loaded slot becomes the tree's, on the bottom piece; if that piece got a
        state meanwhile (an insert adopted one) it keeps it and the slot is freed."""
        node = pieces[-1]
        cd: MambaData = node.mamba  # type: ignore[assignment]  # (new_data)
        slot = int(device.item())
        if cd.value is not None or node.full.value is None:
            self.pool.free_slots((slot,))
            return
        assert cd.lock_ref == 0, f"node {node.id}: Mamba tombstone with lock {cd.lock_ref}"
        self.pool.adopt(slot)
        cd.value = self._values[slot]
        cd.on_device = True
        cd.slot = slot
        self.lru.insert_mru(node)
        self.evictable_size += 1

    def release_load_slots(self, device: torch.Tensor) -> None:
        self.pool.free_slots(device.tolist())

    # ------------------------------------------------------------------ locks
    def _may_lock(self, node: TreeNode, cd: ComponentData) -> bool:
        # Lock ordering swa >= mamba: where SWA did not lock the node (an SWA tombstone), a
        # Mamba lock would exceed it.  Skipping is safe: a request runs on its own copy of
        # the state (copy-on-write), the tree's state is only a cache entry.
        for ct in self._above:
            hi = node.data[ct]
            if hi is None or hi.lock_ref <= cd.lock_ref:
                return False
        return True

    def acquire_component_lock(self, node: TreeNode, result: IncLockRefResult) -> None:
        cd = node.mamba
        assert cd is not None
        if not cd.on_device or (self._above and not self._may_lock(node, cd)):
            # Record the skip: state adopted later must not be "released" by this receipt.
            result.skip_lock_node_ids.setdefault(_MAMBA, set()).add(node.id)
            return
        if cd.lock_ref == 0:
            self.evictable_size -= 1
            self.protected_size += 1
        cd.lock_ref += 1

    def release_component_lock(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        cd = node.mamba
        assert cd is not None
        if params is None:
            # No receipt: release only what is there (a receipt is needed for exactness).
            if cd.lock_ref == 0:
                return
        else:
            # ``skip_swa``: an early release already dropped this receipt's Mamba lock.
            if params.skip_swa and self._above:
                return
            skip = params.skip_lock_node_ids.get(_MAMBA)
            if skip is not None and node.id in skip:
                return
            if cd.lock_ref <= 0:
                # Mamba releases first (components are released in reverse order), so
                # raising here still leaves every lock count unchanged.
                raise InvalidLockError(f"dec_lock_ref: Mamba state of node {node.id} is not locked")
        cd.lock_ref -= 1
        if cd.lock_ref == 0:
            self.evictable_size += 1
            self.protected_size -= 1

    def release_lock_early(self, node: TreeNode, params: DecLockRefParams | None) -> None:
        cd = node.mamba
        assert cd is not None
        if params is not None:
            skip = params.skip_lock_node_ids.setdefault(_MAMBA, set())
            if params.skip_swa or node.id in skip:
                return
            # Shared with the receipt: the final release (and a repeated early one) skips it.
            skip.add(node.id)
        if cd.lock_ref == 0:
            return
        cd.lock_ref -= 1
        if cd.lock_ref == 0:
            self.evictable_size += 1
            self.protected_size -= 1

    # ------------------------------------------------------------------ request caching
    # A request's own slots (live state, ping-pong buffer): see urc.components.mamba_requests.
    def validate_caching_req(self, req: CachingRequest, is_finished: bool) -> None:
        self.requests.validate(req)

    def prepare_for_caching_req(
        self, req: CachingRequest, params: InsertParams, token_len: int, is_finished: bool
    ) -> int | None:
        return self.requests.prepare(req, params, token_len, is_finished)

    def cleanup_after_caching_req(
        self,
        req: CachingRequest,
        is_finished: bool,
        insert_result: InsertResult | None,
        params: InsertParams | None,
    ) -> None:
        self.requests.cleanup(req, is_finished, insert_result, params)

    def alloc_req_slot(self, req: CachingRequest) -> torch.Tensor:
        """See :meth:`MambaRequestSlots.alloc_req_slot`."""
        return self.requests.alloc_req_slot(req)

    def alloc_track_buffer(self, req: CachingRequest, size: int = 2) -> torch.Tensor:
        """See :meth:`MambaRequestSlots.alloc_track_buffer`."""
        return self.requests.alloc_track_buffer(req, size)

    def free_req_slots(self, req: CachingRequest) -> None:
        """See :meth:`MambaRequestSlots.free_req_slots`."""
        self.requests.free_req_slots(req)

    num_req_slots = staticmethod(MambaRequestSlots.num_req_slots)

    # ------------------------------------------------------------------ pools and checks
    def pool_capacity(self) -> int:
        return self.pool.size

    def pool_available(self) -> int:
        return self.pool.available_size()

    def check_node(self, node: TreeNode) -> None:
        cd: MambaData = node.mamba  # type: ignore[assignment]  # (new_data)
        full = node.data[FULL_INDEX]
        assert cd is not None and full is not None
        assert full.lock_ref >= cd.lock_ref, (
            f"node {node.id}: Mamba lock {cd.lock_ref} exceeds Full lock {full.lock_ref}"
        )
        slot = cd.slot
        if cd.value is None:
            assert cd.lock_ref == 0, f"node {node.id}: Mamba tombstone with lock {cd.lock_ref}"
            assert node not in self.lru, f"node {node.id} without state is in the Mamba LRU"
            assert slot == -1, f"node {node.id} without state still names slot {slot}"
            self._check_host(node, cd, full)
            return
        self._check_host(node, cd, full)
        v = cd.value
        assert v.dtype == torch.int64 and tuple(v.shape) == (1,), f"node {node.id}: {v!r}"
        assert int(v.item()) == slot, f"node {node.id}: state value {v.tolist()} != slot {slot}"
        assert self.pool.is_tree_owned(slot), f"node {node.id}: slot {slot} not tree-owned"
        assert node in self.lru, f"node {node.id} with state is not in the Mamba LRU"

    @staticmethod
    def _check_host(node: TreeNode, cd: ComponentData, full: ComponentData) -> None:
        hv = cd.host_value
        if hv is not None:
            assert tuple(hv.shape) == (1,), f"node {node.id}: Mamba host value {hv!r}"
            assert full.host_value is not None, f"node {node.id}: Mamba on host without Full"

    def check_structures(self, nodes: Sequence[TreeNode]) -> None:
        states = [n for n in nodes if _has_state(n)]
        with_state = len(states)
        assert len(self.lru) == with_state, f"Mamba LRU {len(self.lru)} != {with_state} states"
        # Each state slot is on exactly one node (a split never duplicates state).
        slots = {n.mamba.slot for n in states}  # type: ignore[union-attr]
        assert len(slots) == with_state, "a Mamba slot is on two nodes"
        owned = self.pool.num_tree_owned()
        assert owned == with_state, f"pool has {owned} tree-owned slots, tree {with_state}"
        self.pool.check_consistency()

    def reset(self) -> None:
        super().reset()
        self.lru.clear()
        self._pending = _NO_PENDING
