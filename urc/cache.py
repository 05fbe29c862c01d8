"""``UnifiedRadixCache``: one radix tree over token ids for every kind of cached model state.

The synchronous core, with SGLang's ``UnifiedRadixCache`` surface (method names, parameter and
result dataclasses, semantics).  The tree is logical: it matches keys, splits nodes, keeps the
clock and the node structure, and calls component hooks (``urc.components``) for everything
physical.  FULL is the anchor component: a node lives while its Full data lives on some tier.

Costs (K = key length, D = nodes on the path): match and insert are O(K) token comparisons
(one C-level slice comparison per node) plus O(D) interpreter work and O(1) torch calls;
lock/unlock are O(D); evict is O(k log n) for k evicted leaves.

Not thread-safe: one owner mutates it (the async service's actor task, or a scheduler loop).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from urc import checks, eviction, request_caching
from urc.components import component_class
from urc.components.base import MatchValidator, TreeComponent
from urc.components.full import FullComponent
from urc.config import CacheConfig, CachePools
from urc.errors import (
    InvalidIndicesError,
    InvalidInputError,
    InvalidLockError,
    KeyValueMismatchError,
)
from urc.key import RadixKey
from urc.params import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from urc.req import Req
from urc.stats import CacheCounters, CacheStats, ComponentStats, snapshot
from urc.tiers import HostTier, TierEvents, WritePolicy
from urc.tree import NUM_COMPONENT_TYPES, ComponentData, ComponentType, Tier, TreeNode

__all__ = ["UnifiedRadixCache"]

_FULL = 0
_new_tuple = tuple.__new__
_new_object = object.__new__
# Child keys of the root's namespaced children are (_NS, namespace, first page): the sentinel
# keeps them from ever colliding with a plain (or bigram) token key.
_NS = object()
# Compare this many tokens per C-level slice comparison when locating a mismatch.
_SCAN_STEP = 64


def _overrides(component: TreeComponent, hook: str) -> bool:
    return getattr(type(component), hook) is not getattr(TreeComponent, hook)


class UnifiedRadixCache:
    """The radix tree and its components (see the module docstring)."""

    def __init__(self, config: CacheConfig, pools: CachePools) -> None:
        self.config = config
        self.pools = pools
        self.page_size = config.page_size
        self.device = torch.device(config.device)
        self.is_eagle = config.is_eagle
        self.req_to_token_pool = pools.req_to_token_pool
        self.token_to_kv_pool_allocator = pools.token_allocator
        alloc = pools.token_allocator
        self._free_full = alloc.free
        # Tree-owned slots were checked when the tree adopted them (insert): free them
        # without re-validating.  Allocators of callers' own pools may lack the fast path.
        self._free_owned = getattr(alloc, "free_owned", alloc.free)
        self._check_owned = getattr(alloc, "check_owned", None)
        self.num_nodes = 0
        self._clock = 0
        self.counters = CacheCounters()
        self._stats_figs: list[int] = []
        self._stats_comps: tuple[ComponentStats, ...] = ()
        # HiCache (``attach_host_tier``): nodes may then live on device, host, or both.
        self.host_tier: HostTier | None = None
        self.write_policy: WritePolicy | None = None
        self._backup_threshold: int | None = None
        # Nodes whose hit count reached the write-through threshold, waiting for a backup.
        self.pending_backups: dict[int, TreeNode] = {}
        self.backups_in_flight: set[int] = set()
        # The tiers below device that listen (``subscribe``): see ``urc.tiers.TierEvents``.
        self.tier_events: tuple[TierEvents, ...] = ()
        self.components: list[TreeComponent] = [
            component_class(ct)(self) for ct in config.components
        ]
        full = self.components[0]
        assert isinstance(full, FullComponent)
        self.full: FullComponent = full
        self._components_rev = self.components[::-1]
        # (component, type) pairs in eviction order, for the per-leaf loop of eviction.
        self._evict_order = [(c, c.component_type) for c in self._components_rev]
        self._device_evict_keys = [(c.component_type, Tier.DEVICE) for c in self.components]
        self._by_type: dict[ComponentType, TreeComponent] = {
            c.component_type: c for c in self.components
        }
        comps = self.components

        def hooked(name: str) -> list[TreeComponent]:
            return [c for c in comps if _overrides(c, name)]

        self._validating = hooked("create_match_validator")
        self._match_end_hooks = hooked("on_match_end")
        self._finalize_hooks = hooked("finalize_match_result")
        self._overlap_hooks = hooked("update_component_on_insert_overlap")
        self._commit_hooks = hooked("commit_insert_component_data")
        self._insert_end_hooks = hooked("on_insert_end")
        self._evict_drivers = hooked("drive_eviction")
        self._release_checks = hooked("check_release")
        self._prepare_hooks = hooked("prepare_for_caching_req")
        self._cleanup_hooks = hooked("cleanup_after_caching_req")
        self._validate_hooks = hooked("validate_insert")
        self._recover_hooks = hooked("recover_after_unevict")
        self._match_checks = hooked("validate_match")
        self._req_checks = hooked("validate_caching_req")
        # Run by an early partial release (SWA's ``dec_swa_lock_only``) on the same receipt.
        self._early_release_hooks = hooked("release_lock_early")
        # Lock hooks as bound methods: a lock or an unlock is a handful of attribute loads,
        # so the per-component method lookup is worth saving.
        self._acquire = [c.acquire_component_lock for c in comps]
        self._release = [c.release_component_lock for c in self._components_rev]
        # The component released first validates inside its own release (the hook contract:
        # raise before changing anything), so only the later ones need a separate check.
        first = self._components_rev[0]
        self._check_release = [c.check_release for c in self._release_checks if c is not first]
        self.root = self._new_root()

    # ================================================================== structure helpers
    def touch(self, node: TreeNode) -> None:
        """Stamp ``node`` with a fresh clock tick (it was just used)."""
        self._clock += 1
        node.last_access_time = self._clock

    def _new_data(self) -> list[ComponentData | None]:
        data: list[ComponentData | None] = [None] * NUM_COMPONENT_TYPES
        for c in self.components:
            data[c.component_type] = c.new_data()
        return data

    def _new_root(self) -> TreeNode:
        root = TreeNode([], None, self._new_data(), None, 0)
        for cd in root.data:
            if cd is not None:
                cd.lock_ref = 1
        full = root.data[_FULL]
        assert full is not None
        full.value = torch.empty(0, dtype=torch.int64, device=self.device)
        return root

    @property
    def root_node(self) -> TreeNode:
        """SGLang's name for :attr:`root`."""
        return self.root

    def component(self, ct: ComponentType) -> TreeComponent:
        """The component of type ``ct`` (``KeyError`` if the cache was built without it)."""
        return self._by_type[ct]

    def has_component(self, ct: ComponentType) -> bool:
        return ct in self._by_type

    def _first_key(self, tokens: list[Any], pos: int) -> Any:
        ps = self.page_size
        return tokens[pos] if ps == 1 else tuple(tokens[pos : pos + ps])

    def _child_key_of(self, node: TreeNode) -> Any:
        k = self._first_key(node.key, 0)
        parent = node.parent
        if parent is not None and parent.parent is None and node.namespace is not None:
            return (_NS, node.namespace, k)
        return k

    def link_child(self, parent: TreeNode, node: TreeNode) -> None:
        """Hang the new node ``node`` (whose ``parent`` is already ``parent``) under
        ``parent``, remembering its child key so unlinking needs no key arithmetic."""
        ck = node.child_key = self._child_key_of(node)
        parent.children[ck] = node
        self.num_nodes += 1

    def _prepare_tokens(self, key: RadixKey) -> list[Any]:
        """The tree view of ``key``: bigrams in EAGLE mode, truncated to whole pages."""
        if self.is_eagle and not key.is_bigram:
            key = key.bigram()
        tokens = key.token_ids
        n = len(tokens)
        return tokens if n % self.page_size == 0 else tokens[: n - n % self.page_size]

    def _match_len(self, edge: list[Any], tokens: list[Any], pos: int) -> int:
        """Page-aligned length of the common prefix of ``edge`` and ``tokens[pos:]``."""
        n = min(len(edge), len(tokens) - pos)
        i = 0
        while (
            i + _SCAN_STEP <= n
            and edge[i : i + _SCAN_STEP] == tokens[pos + i : pos + i + _SCAN_STEP]
        ):
            i += _SCAN_STEP
        while i < n and edge[i] == tokens[pos + i]:
            i += 1
        return i - i % self.page_size

    def _root_child_key(self, tokens: list[Any], ns: Any) -> Any:
        """The key under which the root holds the child starting ``tokens`` in namespace
        ``ns``."""
        k = self._first_key(tokens, 0)
        return k if ns is None else (_NS, ns, k)

    def _descend(
        self, node: TreeNode, ck: Any, tokens: list[Any], pos: int
    ) -> tuple[TreeNode | None, int, bool]:
        """One step of a walk: the child of ``node`` under ``ck`` and how many of
        ``tokens[pos:]`` it matches (whole pages).  A partial match splits the child there
        and returns the upper part with ``split=True``; no match returns ``(None, 0, False)``.
        """
        child = node.children.get(ck)
        if child is None:
            return None, 0, False
        klen = child.key_len
        if tokens[pos : pos + klen] == child.key:  # one C-level comparison in the usual case
            return child, klen, False
        m = self._match_len(child.key, tokens, pos)
        if m == 0:
            return None, 0, False
        return self.split_node(child, m), m, True

    def split_node(self, child: TreeNode, k: int) -> TreeNode:
        """Split ``child`` after ``k`` tokens; returns the new upper node (``child`` keeps the
        rest).  Components move their data; no size changes.  Stamps the upper node, then
        ``child``, with fresh clock ticks."""
        assert 0 < k < child.key_len and k % self.page_size == 0, (
            f"split of node {child.id} (len {child.key_len}) at {k}"
        )
        parent = child.parent
        assert parent is not None
        # Both halves are stamped, upper first (SGLang's order): the untouched tail below a
        # split point counts as just used.
        self._clock += 1
        upper = TreeNode(child.key[:k], parent, self._new_data(), child.namespace, self._clock)
        upper.creation_time = child.creation_time
        upper.hit_count = child.hit_count
        upper.priority = child.priority
        upper.child_key = child.child_key
        parent.children[child.child_key] = upper
        child.key = child.key[k:]
        child.key_len -= k
        child.parent = upper
        ck = child.child_key = self._first_key(child.key, 0)
        upper.children[ck] = child
        if child.hash_value is not None:
            pages = k // self.page_size
            upper.hash_value = child.hash_value[:pages]
            child.hash_value = child.hash_value[pages:]
        for c in self.components:
            c.redistribute_on_node_split(upper, child)
        self._clock += 1
        child.last_access_time = self._clock
        self.num_nodes += 1
        return upper

    def _add_leaf(
        self, parent: TreeNode, key: list[Any], value: torch.Tensor, ns: Any, priority: int
    ) -> TreeNode:
        self._clock += 1
        leaf = TreeNode(key, parent, self._new_data(), ns, self._clock)
        leaf.priority = priority
        full = leaf.data[_FULL]
        assert full is not None
        full.value = value
        full_c = self.full
        full_c.evictable_size += leaf.key_len
        self.link_child(parent, leaf)
        full_c.note_child(parent)
        full_c.note_leaf(leaf)
        return leaf

    def delete_leaf(self, node: TreeNode) -> None:
        """Unlink a childless node that no component holds data for any more."""
        assert not node.children, f"deleting node {node.id} with {len(node.children)} children"
        parent = node.parent
        assert parent is not None
        del parent.children[node.child_key]
        node.deleted = True
        self.num_nodes -= 1

    def free_full(self, value: torch.Tensor) -> None:
        """Return tree-owned Full (token) slots to the allocator (which queues them: see
        :meth:`~urc.pools.allocator.TokenSlotAllocator.free_owned`)."""
        self._free_owned(value)

    def free_request_kv(self, value: torch.Tensor) -> None:
        """Free Full slots a request holds (checked: a slot that is not allocated raises
        :class:`~urc.errors.DoubleFreeError` and nothing is freed)."""
        self._free_full(value)

    # ================================================================== match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key``.

        Mutates: may split the node where the match ends; refreshes access times (parent <
        child along the path) and component LRUs; Mamba may copy state into ``params.req``.
        Returns the device hit (concatenated indices) and the nodes that end it.
        """
        for check in self._match_checks:
            check.validate_match(params)
        tokens = self._prepare_tokens(params.key)
        n = len(tokens)
        if n == 0:
            return self._result_at_root()
        validators, host_validators = self._match_validators()
        tiered = host_validators is not None
        path: list[TreeNode] = []
        node = self.root
        pos = 0
        best = 0
        best_any = 0
        on_device = True
        ck = self._root_child_key(tokens, params.key.extra_key)
        descend = self._descend
        while True:
            child, m, split = descend(node, ck, tokens, pos)
            if child is None:
                break
            fcd = child.full
            assert fcd is not None
            if fcd.value is None:
                if not tiered or fcd.host_value is None:
                    break
                on_device = False  # the device hit ends above the first host-only node
            path.append(child)
            pos += m
            if on_device:
                ok = True
                for validate in validators:
                    if not validate(child):
                        ok = False
                if ok:
                    best = len(path)
            if host_validators is not None:
                ok = True
                for validate in host_validators:
                    if not validate(child):
                        ok = False
                if ok:
                    best_any = len(path)
            if split or pos >= n:
                break
            node = child
            ck = tokens[pos] if self.page_size == 1 else tuple(tokens[pos : pos + self.page_size])
        return self._finish_match(params, path, best, best_any if tiered else best, pos, n)

    def match_path(
        self,
        params: MatchPrefixParams,
        path: list[TreeNode],
        known: tuple[int, torch.Tensor] | None = None,
    ) -> MatchResult:
        """:meth:`match_prefix` of a key the caller knows is exactly the device path ``path``
        (root first, as :meth:`path_to` gives): the same validation, stamps, hooks and
        result, without walking the key's tokens (request caching re-matches what it just
        inserted this way, so a chunk's commit does not cost the whole prompt again).
        ``known = (k, indices)``: the caller already holds the device indices of
        ``path[:k]``; where the hit ends within them the result's ``device_indices`` is a
        view of ``indices`` (no copy), else ``indices`` and the rest concatenated."""
        for check in self._match_checks:
            check.validate_match(params)
        if not path:
            return self._result_at_root()
        pos = sum([node.key_len for node in path])
        best = self._deepest_boundary(path, True)
        matched = best if self.host_tier is None else self._deepest_boundary(path, False)
        return self._finish_match(params, path, best, matched, pos, pos, known)

    def _deepest_boundary(self, path: list[TreeNode], device_only: bool) -> int:
        """The deepest ``i`` where a walk of ``path`` would accept ``path[:i]`` (0: none),
        asked from the deepest node up: usually the first answer is yes."""
        checks = []
        for c in self._validating:
            check = c.create_path_validator(path, device_only)
            if check is not None:
                checks.append(check)
        for i in range(len(path), 0, -1):
            if all([check(i) for check in checks]):
                return i
        return 0

    def _match_validators(self) -> tuple[list[MatchValidator], list[MatchValidator] | None]:
        """Fresh validators for one match: device-only, and (with a host tier) any-tier."""
        validators: list[MatchValidator] = []
        for c in self._validating:
            v = c.create_match_validator(True)
            if v is not None:
                validators.append(v)
        if self.host_tier is None:
            return validators, None
        host_validators: list[MatchValidator] = []
        for c in self._validating:
            v = c.create_match_validator(False)
            if v is not None:
                host_validators.append(v)
        return validators, host_validators

    def _finish_match(
        self,
        params: MatchPrefixParams,
        path: list[TreeNode],
        best: int,
        matched: int,
        pos: int,
        n: int,
        known: tuple[int, torch.Tensor] | None = None,
    ) -> MatchResult:
        """Stamps, counters, result and component hooks of a match whose walk visited
        ``path`` (``path[:best]`` is the device hit, ``path[:matched]`` the best match on any
        tier, ``pos`` the tokens walked, ``n`` the query's length; ``known``: see
        :meth:`match_path`)."""
        # Only the best match and its ancestors are stamped, after the walk, parent < child
        # (SGLang's order); nodes walked past the best keep their age.
        clock = self._clock
        for p in path[:matched]:
            clock += 1
            p.last_access_time = clock
        self._clock = clock
        counters = self.counters
        counters.match_requests += 1
        counters.query_tokens += n
        if best == 0:
            result = self._result_at_root()
        else:
            last = path[best - 1]
            result = MatchResult(self._device_indices(path, best, known), last, last, last)
        if matched > best:
            host_node = path[matched - 1]
            host_len = 0
            for p in path[best:matched]:
                host_len += p.key_len
            result = result._replace(
                last_host_node=host_node, best_match_node=host_node, host_hit_length=host_len
            )
        for c in self._match_end_hooks:
            c.on_match_end(path, matched)
        for c in self._finalize_hooks:
            result = c.finalize_match_result(result, params, path, best, pos)
        hits = counters.hit_tokens
        hits["device"] += result.device_indices.shape[0]
        hits["host"] += result.host_hit_length
        return result

    @staticmethod
    def _device_indices(
        path: list[TreeNode], best: int, known: tuple[int, torch.Tensor] | None
    ) -> torch.Tensor:
        """The Full device indices of ``path[:best]``: a fresh tensor, or (``known`` covers
        ``path[:k]`` with ``k >= best``) a view of the caller's ``known`` tensor."""
        if known is None:
            k, values = 0, []
        else:
            k, held = known
            if k >= best:
                if k == best:
                    return held
                return held[: sum([p.key_len for p in path[:best]])]
            values = [held]
        values += [p.full.value for p in path[k:best]]  # type: ignore[misc,union-attr]
        return torch.cat(values)

    def _result_at_root(self) -> MatchResult:
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return MatchResult(empty, self.root, self.root, self.root)

    # ================================================================== insert
    def path_to(self, node: TreeNode) -> list[TreeNode]:
        """The nodes from the root's child down to ``node`` (empty for the root)."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _check_value(
        self, n_key: int, value: torch.Tensor | None, owned_from: int = 0
    ) -> torch.Tensor:
        if value is None:
            raise InvalidInputError("insert needs a value tensor of device indices")
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
            raise InvalidIndicesError(f"value must be a 1-D int64 tensor, got {value!r:.80}")
        if value.device != self.device:
            raise InvalidIndicesError(f"value is on {value.device}, the cache on {self.device}")
        if value.shape[0] != n_key:
            raise KeyValueMismatchError(f"key has {n_key} tokens, value {value.shape[0]}")
        if n_key > owned_from:
            if self._check_owned is not None:
                self._check_owned(value[owned_from:])  # range and allocation, host side
            else:
                lo, hi = torch.aminmax(value)
                size = self.token_to_kv_pool_allocator.size
                if int(lo) < 0 or int(hi) >= size:
                    raise InvalidIndicesError(f"value indices outside [0, {size}): [{lo}, {hi}]")
        return value

    def insert(self, params: InsertParams, resume_from: TreeNode | None = None) -> InsertResult:
        """Insert ``params.key`` -> ``params.value`` (Full device indices).

        The tree takes ownership of the value's slots: slots of new nodes are kept, slots that
        duplicate cached tokens at positions ``>= prev_prefix_len`` are freed, slots below
        ``prev_prefix_len`` are assumed to be the tree's own (the caller got them from a
        match).  Unaligned tail tokens are ignored (not freed: the caller owns them).
        Raises a subclass of :class:`~urc.errors.InvalidInputError` on bad input, before any
        change.  Returns ``prefix_len`` (tokens that were already cached) and the target node.

        ``resume_from`` (request caching: the request's locked ``last_node``): a locked node
        whose path holds the key's first tokens, ending at or before ``prev_prefix_len``.
        The walk starts there, with the same effects as a walk from the root (its path is
        stamped and counted as that walk would), so a chunk's commit costs the chunk, not
        the whole prompt.  Only the slots from ``prev_prefix_len`` on are checked then.
        """
        key = params.key
        if key is None:
            raise InvalidInputError("insert needs a key")
        if self.is_eagle and not key.is_bigram:
            key = key.bigram()
        n_key = len(key)
        prev = params.prev_prefix_len
        if not prev >= 0:
            raise InvalidInputError(f"prev_prefix_len must be >= 0, got {prev}")
        resumed: list[TreeNode] = []
        if resume_from is not None:
            resumed = self.path_to(resume_from)
            start_len = sum([p.key_len for p in resumed])
            if resume_from.full is None or not resume_from.full.lock_ref or start_len > prev:
                raise InvalidInputError(
                    f"resume_from node {resume_from.id} must be locked and end at or before "
                    f"prev_prefix_len {prev} (it ends at {start_len})"
                )
        value = self._check_value(n_key, params.value, prev if resumed else 0)
        for c in self._validate_hooks:
            c.validate_insert(params, n_key)
        tokens = self._prepare_tokens(key)
        n = len(tokens)
        if n == 0:
            return InsertResult(prefix_len=0, mamba_exist=True)
        ps = self.page_size
        priority = params.priority
        overlap_hooks = self._overlap_hooks
        # SGLang counts hits on insert only: not for chunked prefills, never under write-back.
        count_hits = not params.chunked and self.write_policy is not WritePolicy.WRITE_BACK
        note_hits = count_hits and self._backup_threshold is not None
        path: list[TreeNode] = []
        free_ranges: list[tuple[int, int]] = []
        node = self.root
        pos = 0
        ns = key.extra_key
        ck = self._root_child_key(tokens, ns) if not resumed else None
        for below in resumed:
            # What the walk below does to a locked node wholly below ``prev``: stamp, raise
            # the priority, count the hit (the overlap hooks and frees have nothing to do).
            self._clock += 1
            below.last_access_time = self._clock
            if priority > below.priority:
                below.priority = priority
            if count_hits:
                below.hit_count += 1
                if note_hits:
                    self._note_hit(below)
            path.append(below)
            pos += below.key_len
            node = below
        if resumed and pos < n:
            ck = tokens[pos] if ps == 1 else tuple(tokens[pos : pos + ps])
        descend = self._descend
        while pos < n:
            child, m, split = descend(node, ck, tokens, pos)
            if child is None:
                break
            if not split:  # a split stamped both halves already
                self._clock += 1
                child.last_access_time = self._clock
            if priority > child.priority:
                child.priority = priority
            fcd = child.full
            assert fcd is not None
            if fcd.value is None:
                # Host-only node: it adopts the incoming slots as its device value.
                self._adopt_device_value(child, value[pos : pos + m].clone(), pos, params)
            else:
                consumed = m
                for c in overlap_hooks:
                    consumed = min(
                        consumed,
                        c.update_component_on_insert_overlap(child, m, pos, value, params),
                    )
                start = pos + max(0, prev - pos)
                end = pos + consumed
                if start < end:
                    if free_ranges and free_ranges[-1][1] == start:
                        free_ranges[-1] = (free_ranges[-1][0], end)
                    else:
                        free_ranges.append((start, end))
            if count_hits:  # after the hooks: a recovery split leaves ``child`` the lower part
                child.hit_count += 1
                if note_hits:
                    self._note_hit(child)
            path.append(child)
            pos += m
            node = child
            if pos < n:
                ck = tokens[pos] if ps == 1 else tuple(tokens[pos : pos + ps])
        for a, b in free_ranges:
            # A copy: the allocator keeps what it is given, and the caller may overwrite its
            # tensor (cache_unfinished_req rewrites the req_to_token row it passed).
            self._free_full(value[a:b])
        prefix_len = pos
        if pos < n:
            self.counters.inserted_tokens += n - pos
            target = self._add_leaf(node, tokens[pos:], value[pos:n].clone(), ns, priority)
            path.append(target)
            is_new_leaf = True
        else:
            target = node
            is_new_leaf = False
        result = InsertResult(prefix_len=prefix_len, total_len=n, last_device_node=target)
        for c in self._commit_hooks:
            target = c.commit_insert_component_data(target, is_new_leaf, params, result)
        result.last_device_node = target
        for c in self._insert_end_hooks:
            c.on_insert_end(path)
        if is_new_leaf and count_hits:  # counted after the commit hooks split it (SGLang)
            leaf = path[-1]
            leaf.hit_count += 1
            if note_hits:
                self._note_hit(leaf)
        return result

    def _adopt_device_value(
        self, node: TreeNode, value: torch.Tensor, pos: int, params: InsertParams
    ) -> None:
        """Give a host-only node fresh device slots (HiCache: re-insert over an evicted node)."""
        full = node.data[_FULL]
        assert full is not None and full.lock_ref == 0
        full.value = value
        self.full.evictable_size += node.key_len
        for c in self._recover_hooks:
            c.recover_after_unevict(node, pos, params)
        if not node.in_heap and self.full.is_device_leaf(node):
            self.full.note_leaf(node)

    # ================================================================== evict
    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least the requested amounts where possible (whole nodes, so maybe more).

        Never frees locked data.  Returns what was freed per component (see
        :mod:`urc.eviction`).
        """
        return eviction.evict(self, params)

    # ================================================================== host tier (HiCache)
    def attach_host_tier(self, tier: HostTier, policy: WritePolicy) -> None:
        """Give the cache a host tier: from now on device leaves with a host copy are demoted
        instead of deleted, matches report host hits, and ``policy`` decides backups."""
        self.host_tier = tier
        self.write_policy = policy
        self._backup_threshold = policy.hit_threshold

    def subscribe(self, events: TierEvents) -> None:
        """Deliver the tier events (:class:`~urc.tiers.TierEvents`) to ``events`` from now on
        (after the subscribers already there; subscribing twice delivers once)."""
        if events not in self.tier_events:
            self.tier_events = (*self.tier_events, events)

    def unsubscribe(self, events: TierEvents) -> None:
        """Stop delivering tier events to ``events`` (no-op if it is not subscribed)."""
        self.tier_events = tuple(e for e in self.tier_events if e is not events)

    def _note_hit(self, node: TreeNode) -> None:
        threshold = self._backup_threshold
        cd = node.data[_FULL]
        if (
            threshold is not None
            and node.hit_count >= threshold
            and cd is not None
            and cd.host_value is None
            and cd.value is not None
        ):
            self.pending_backups[node.id] = node
            for events in self.tier_events:
                events.backup_due()

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Back ``node`` up to host now (with its ancestors that lack a copy); returns the
        tokens backed up, 0 when impossible.  (``write_back`` is accepted for SGLang.)"""
        from urc.tiering import write_backup

        return write_backup(self, node)

    def load_back(self, node: TreeNode, threshold: int = 0) -> int:
        """Load the host-only part of the path to ``node`` to device now; returns tokens
        loaded (0 when below ``threshold`` or no device memory could be found)."""
        from urc.tiering import load_back

        return load_back(self, node, threshold)

    def evict_host(
        self, num_tokens: int, component_type: ComponentType = ComponentType.FULL
    ) -> int:
        """Free host-only leaves (no host lock), oldest first; returns Full tokens freed."""
        from urc.tiering import evict_host

        return evict_host(self, num_tokens)

    def evict_host_leaf(self, node: TreeNode, tracker: list[int]) -> None:
        """Free every host copy of the host-only leaf ``node`` and delete it."""
        from urc.tiering import evict_host_leaf

        evict_host_leaf(self, node, tracker)

    def insert_host(self, key: RadixKey, host_value: torch.Tensor, start: int) -> int:
        """Attach host data read from a lower tier (L3 storage) for ``key[start:start + n]``
        (``host_value``: ``n`` Full host slots, owned by the tree from now on); returns the
        tokens placed on new host-only nodes.  See :func:`urc.tiering.insert_host`."""
        from urc.tiering import insert_host

        return insert_host(self, key, host_value, start)

    def inc_host_lock_ref(self, node: TreeNode) -> None:
        """Pin ``node``'s host copy against host eviction."""
        from urc.tiering import host_lock

        if node.parent is not None:
            host_lock(self, node, 1)

    def dec_host_lock_ref(self, node: TreeNode) -> None:
        """Release :meth:`inc_host_lock_ref` (``InvalidLockError`` if not host-locked)."""
        from urc.tiering import host_lock

        if node.parent is not None:
            host_lock(self, node, -1)

    # ================================================================== locks
    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        """Protect ``node``'s data from eviction (Full: the whole path to the root).

        Returns the receipt; pass ``receipt.to_dec_params()`` to :meth:`dec_lock_ref`.
        """
        # The receipt is built field by field: its constructor's keyword parsing would cost
        # as much as a FULL lock itself.
        result = _new_object(IncLockRefResult)
        result.node_id = node.id
        result.skip_lock_node_ids = {}
        result.delta = 0  # Full sets it when the lock protects new tokens
        if node.deleted or node.parent is None:  # one test on the hot path
            if node.deleted:
                raise InvalidLockError(f"inc_lock_ref on node {node.id}, which was evicted")
            return result
        for acquire in self._acquire:
            acquire(node, result)
        return result

    def dec_lock_ref(
        self, node: TreeNode, params: DecLockRefParams | None = None
    ) -> DecLockRefResult:
        """Release a lock taken by :meth:`inc_lock_ref` (``params``: its receipt).

        Raises :class:`~urc.errors.InvalidLockError` (nothing released) when the node is not
        locked or the receipt does not fit.  Returns the Full tokens made evictable.
        """
        if node.parent is None:
            return _new_tuple(DecLockRefResult, (0,))
        if node.deleted:
            raise InvalidLockError(f"dec_lock_ref on node {node.id}, which was evicted")
        if params is not None and params.node_id is not None and params.node_id != node.id:
            raise InvalidLockError(
                f"receipt for node {params.node_id} used to release node {node.id}"
            )
        for check in self._check_release:
            check(node, params)
        full = self.full
        before = full.protected_size
        for release in self._release:
            release(node, params)
        return _new_tuple(DecLockRefResult, (before - full.protected_size,))

    def dec_swa_lock_only(self, node: TreeNode, params: DecLockRefParams | None = None) -> None:
        """Early window release: release the SWA part of a lock while Full stays locked.

        For a request whose decode moved past the window.  Components of lower priority than
        SWA release their part of the same receipt with it (``release_lock_early``), so
        ``full >= swa >= mamba`` lock counts hold.  Sets ``params.skip_swa``; the final
        :meth:`dec_lock_ref` must carry it (``cache_finished_req`` does when
        ``req.swa_lock_released`` is set).  Raises :class:`~urc.errors.InvalidLockError`
        (nothing released) for a receipt that does not fit or was already early-released,
        :class:`~urc.errors.InvalidInputError` on a cache without SWA.
        """
        swa = self._by_type.get(ComponentType.SWA)
        if swa is None:
            raise InvalidInputError("dec_swa_lock_only on a cache without an SWA component")
        if node.parent is None:
            return
        if node.deleted:
            raise InvalidLockError(f"dec_swa_lock_only on node {node.id}, which was evicted")
        if params is not None:
            if params.node_id is not None and params.node_id != node.id:
                raise InvalidLockError(
                    f"receipt for node {params.node_id} used to release node {node.id}"
                )
            if params.skip_swa:
                raise InvalidLockError("the SWA part of this lock was already released")
        swa.release_component_lock(node, params)  # validates before it releases
        prio = swa.eviction_priority(False)
        for c in self._early_release_hooks:
            if c.eviction_priority(False) < prio:
                c.release_lock_early(node, params)
        if params is not None:
            params.skip_swa = True

    # ================================================================== request caching
    def cache_finished_req(
        self, req: Req, is_insert: bool = True, *, kv_len_to_handle: int | None = None
    ) -> None:
        """Hand a finished request's KV to the tree and release everything it held;
        ``kv_len_to_handle`` caps the tokens cached (see
        :func:`urc.request_caching.cache_finished_req` for the KV ranges)."""
        request_caching.cache_finished_req(self, req, is_insert, kv_len_to_handle)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Cache the KV computed so far and move the request's lock onto it (see
        :func:`urc.request_caching.cache_unfinished_req`)."""
        request_caching.cache_unfinished_req(self, req, chunked)

    # ================================================================== sizes
    def evictable_size(self) -> int:
        """Full device tokens on unlocked nodes."""
        return self.full.evictable_size

    def protected_size(self) -> int:
        """Full device tokens on locked nodes."""
        return self.full.protected_size

    def full_evictable_size(self) -> int:
        return self.full.evictable_size

    def full_protected_size(self) -> int:
        return self.full.protected_size

    def component_evictable_size(self, ct: ComponentType) -> int:
        """Evictable device size of component ``ct`` in its unit (0 when absent)."""
        c = self._by_type.get(ct)
        return 0 if c is None else c.evictable_size

    def component_protected_size(self, ct: ComponentType) -> int:
        """Protected device size of component ``ct`` in its unit (0 when absent)."""
        c = self._by_type.get(ct)
        return 0 if c is None else c.protected_size

    def swa_evictable_size(self) -> int:
        return self.component_evictable_size(ComponentType.SWA)

    def swa_protected_size(self) -> int:
        return self.component_protected_size(ComponentType.SWA)

    def mamba_evictable_size(self) -> int:
        return self.component_evictable_size(ComponentType.MAMBA)

    def mamba_protected_size(self) -> int:
        return self.component_protected_size(ComponentType.MAMBA)

    def total_size(self) -> int:
        """Full device tokens held by the tree."""
        return self.full.evictable_size + self.full.protected_size

    def available_and_evictable_str(self) -> str:
        """Free slots plus evictable size, Full first, then one line per other component
        (SGLang's log text)."""
        full = self.full
        free, evictable = full.pool_available(), full.evictable_size
        lines = [
            f"Available full tokens: {free + evictable} "
            f"(full_available_size={free} + full_evictable_size_={evictable})"
        ]
        for c in self.components[1:]:
            free, evictable = c.pool_available(), c.evictable_size
            lines.append(
                f"Available {c.component_type.name.lower()}: {free + evictable} "
                f"(available_size={free} + component_evictable_size_={evictable})"
            )
        return "\n".join(lines) + "\n"

    def supports_swa(self) -> bool:
        return ComponentType.SWA in self._by_type

    def supports_mamba(self) -> bool:
        return ComponentType.MAMBA in self._by_type

    def is_tree_cache(self) -> bool:
        return True

    def is_chunk_cache(self) -> bool:
        return False

    def stats(self) -> CacheStats:
        """A snapshot of sizes (per component and tier) and cumulative counters; O(1) (see
        :func:`urc.stats.snapshot`)."""
        return snapshot(self)

    # ================================================================== whole-tree operations
    def _nodes(self) -> list[TreeNode]:
        """Every node but the root, parents before children."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_values_flatten(self) -> torch.Tensor:
        """Every Full device index held by the tree."""
        values = [
            cd.value
            for n in self._nodes()
            if (cd := n.data[_FULL]) is not None and cd.value is not None
        ]
        if not values:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(values)

    def reset(self) -> None:
        """Free everything the tree holds and start empty.

        Raises :class:`~urc.errors.InvalidLockError` (nothing changed) while any node is
        locked: its slots are in use by a request.
        """
        nodes = self._nodes()
        for node in nodes:
            for cd in node.data:
                if cd is not None and (cd.lock_ref or cd.host_lock_ref):
                    raise InvalidLockError(f"reset while node {node.id} is locked")
        for node in reversed(nodes):
            for c in self._components_rev:
                if c.node_has_component_data(node):
                    c.evict_component(node, Tier.DEVICE)
                if c.node_has_component_data(node, Tier.HOST):
                    c.evict_host(node)
            node.deleted = True
        self.pending_backups.clear()
        for c in self.components:
            c.reset()
        self.num_nodes = 0
        self.root = self._new_root()

    def sanity_check(self) -> None:
        """Recompute every invariant from scratch; ``AssertionError`` names the first broken
        one (see :func:`urc.checks.sanity_check`)."""
        checks.sanity_check(self)

    def check_pools(
        self,
        held: Mapping[ComponentType, int] | None = None,
        host_held: Mapping[ComponentType, int] | None = None,
    ) -> None:
        """Assert ``free + evictable + protected + held == capacity`` for every pool (see
        :func:`urc.checks.check_pools`)."""
        checks.check_pools(self, held, host_held)

    def pretty_print(self) -> str:
        """An indented dump of the tree (also printed)."""
        return checks.pretty_print(self)

    def iter_nodes(self) -> Sequence[TreeNode]:
        """Every node but the root (parents before children)."""
        return self._nodes()
