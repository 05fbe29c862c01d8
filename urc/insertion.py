"""Insertion: ``UnifiedRadixCache.insert`` — a key and its Full device slots into the tree.

The walk descends like a match (splitting where the key leaves an edge), lets components
take their part of each overlapped node (``update_component_on_insert_overlap``), frees the
caller's slots that duplicate cached tokens, hangs the rest on a new leaf and lets the
components commit their data on it (``commit_insert_component_data``).  Slot ownership::

    [0, prev_prefix_len)         the tree's own (the caller got them from a match): kept
    [prev_prefix_len, prefix)    duplicates of cached tokens: freed here
    [prefix, aligned)            new: the new leaf owns them
    [aligned, len(key))          unaligned tail: ignored, still the caller's

Every slot from ``prev_prefix_len`` on must be held by the caller, each page once: the
allocator's ``claim_value`` checks that and makes those pages the tree's in the same pass
(refused with nothing changed otherwise); the duplicates are then freed and the unaligned
tail handed back to the caller (``unclaim``) before ``insert`` returns.

The walk is read-only and comes first.  At page 1, when no component takes part of an
overlapped node and no node on the path is host-only, every duplicate is freed: the claim
then adopts only ``[prefix, aligned)``, and the duplicates are checked and freed in one pass
(``free_held``) as the last check, before anything changes -- a long prompt's cached part
is read once, not claimed and then freed (a tenth of a 78k-token insert).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from urc.errors import InvalidIndicesError, InvalidInputError, KeyValueMismatchError
from urc.host import transfers as host_transfers
from urc.host_protocol import WritePolicy
from urc.key import RadixKey, TokenIds, check_key
from urc.node import FULL_INDEX, TreeNode
from urc.params import InsertParams, InsertResult
from urc.reuse_hint import ReuseHint

if TYPE_CHECKING:
    from urc.state import CacheState

__all__ = ["insert"]


_Tensor = torch.Tensor
_INT64 = np.dtype(np.int64)


def _add_leaf(
    state: CacheState,
    parent: TreeNode,
    key: TokenIds,
    value: torch.Tensor,
    ns: Any,
    priority: int,
) -> TreeNode:
    tree = state.tree
    leaf = tree.new_node(parent, key, ns)
    leaf.priority = priority
    full = leaf.data[FULL_INDEX]
    assert full is not None
    full.value = value
    full_c = state.full
    full_c.evictable_size += leaf.key_len
    tree.link(parent, leaf)
    full_c.note_child(parent)
    full_c.note_leaf(leaf)
    if state.kv_events is not None:
        state.kv_events.stored_on_device(leaf)
    return leaf


def _check_value(
    state: CacheState, n_key: int, value: torch.Tensor | None, owned_from: int
) -> tuple[torch.Tensor, np.ndarray | None]:
    """``value`` once it is known to be a valid tensor, and its host view where the
    allocator's ``claim_value`` will check its slots (``None``: ``claim_value`` makes its
    own view, or there is none, or nothing to check); raises the insert's typed errors."""
    claim_value = state.claim_value
    if n_key > owned_from and claim_value is not None and state.on_cpu and type(value) is _Tensor:
        # The common case, checked on the host view the claim reads anyway: numpy's
        # attributes cost a fraction of torch's (``dtype``, ``device`` and ``shape`` build
        # objects).  Anything unusual takes the checks below, which say what is wrong.
        try:
            host = value.numpy()
        except (TypeError, RuntimeError):  # not a plain CPU tensor
            host = None
        if host is not None and host.dtype is _INT64 and host.ndim == 1 and len(host) == n_key:
            return value, host
    if value is None:
        raise InvalidInputError("insert needs a value tensor of device indices")
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
        raise InvalidIndicesError(f"value must be a 1-D int64 tensor, got {value!r:.80}")
    if value.device != state.device:
        raise InvalidIndicesError(f"value is on {value.device}, the cache on {state.device}")
    if value.shape[0] != n_key:
        raise KeyValueMismatchError(f"key has {n_key} tokens, value {value.shape[0]}")
    if n_key > owned_from and claim_value is None:
        lo, hi = torch.aminmax(value)
        size = state.token_to_kv_pool_allocator.size
        if int(lo) < 0 or int(hi) >= size:
            raise InvalidIndicesError(f"value indices outside [0, {size}): [{lo}, {hi}]")
    return value, None


def _refuse_key(key: object) -> NoReturn:
    if key is None:
        raise InvalidInputError("insert needs a key")
    check_key(key, "insert's key")
    raise AssertionError(f"{key!r} is a RadixKey")


def insert(
    state: CacheState, params: InsertParams, resume_from: TreeNode | None = None
) -> InsertResult:
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
    if not isinstance(key, RadixKey):
        _refuse_key(key)
    if state.is_eagle and not key.is_bigram:
        key = key.bigram()
    n_key = len(key)
    prev = params.prev_prefix_len
    if not prev >= 0:
        raise InvalidInputError(f"prev_prefix_len must be >= 0, got {prev}")
    inserted_len = params.inserted_len
    if not inserted_len >= 0:
        raise InvalidInputError(f"inserted_len must be >= 0, got {inserted_len}")
    if params.reuse_hint is not None:
        if type(params.reuse_hint) is not ReuseHint:
            raise InvalidInputError(f"reuse_hint must be a ReuseHint, got {params.reuse_hint!r}")
        # The hint takes this session when it names none (after the insert: check it now).
        sid = params.session_id
        if sid is not None and not isinstance(sid, str):
            raise InvalidInputError(
                f"session_id must be a str or None, got {sid!r} ({type(sid).__name__})"
            )
    resumed: list[TreeNode] = []
    start_len = 0
    if resume_from is not None:
        resumed = state.tree.path_to(resume_from)
        start_len = sum([p.key_len for p in resumed])
        if resume_from.full is None or not resume_from.full.lock_ref or start_len > prev:
            raise InvalidInputError(
                f"resume_from node {resume_from.id} must be locked and end at or before "
                f"prev_prefix_len {prev} (it ends at {start_len})"
            )
    owned_from = prev if resumed else 0
    # The pages the allocator's claim_value adopts: from the first page boundary at or
    # above ``prev`` (a partly protected page is checked, not adopted).
    ps = state.page_size
    claimed = min(n_key, -(-prev // ps) * ps) if prev else 0
    value, host = _check_value(state, n_key, params.value, owned_from)
    tree = state.tree
    tokens = tree.tokens_of(key)
    n = len(tokens)
    # The structural walk first (read-only, urc.fastpath: compiled when built), from the
    # resumed node if any; the per-node steps come once every check has passed.  Hooks
    # that split a node keep it as the lower piece, so the walked path stays valid.
    node = resumed[-1] if resumed else tree.root
    pos = start_len
    ns = key.extra_key
    walked: list[TreeNode] = []
    partial: TreeNode | None = None
    pm = 0
    if pos < n:
        # None: the walk looks the first child up under the page key where it starts.
        ck = tree.root_child_key(tokens, ns) if not resumed and ns is not None else None
        walked, _, partial, pm = tree.walk(node, ck, tokens, pos, ps)
        if partial is not None:
            walked.append(partial)
    overlap_hooks = state.hooks.overlap
    # Page 1 with no overlap hook and no host-only node on the path: the caller's slots
    # for cached tokens, [prev, matched), are all freed, so they are checked and freed in
    # one pass (``free_held``) after every other check, instead of adopted by the claim
    # and freed again (the long-context insert's largest memory pass).
    matched = -1
    if host is not None and ps == 1 and not overlap_hooks:
        matched = pos + pm
        for child in walked:
            if child.full.value is None:  # host-only: it adopts the caller's slots
                matched = -1
                break
            if child is not partial:
                matched += child.key_len
        if matched < prev:
            matched = -1
    adopt_from = matched if matched > claimed else claimed
    alloc = state.token_to_kv_pool_allocator
    if n_key > owned_from and state.claim_value is not None:
        host = state.claim_value(value, owned_from, claimed, True, host, adopt_from)
    try:
        for c in state.hooks.validate_insert:
            c.validate_insert(params, n_key)
    except BaseException:
        if host is not None:
            alloc.unclaim(host, adopt_from, n_key)
        raise
    if host is not None and n < n_key:
        alloc.unclaim(host, adopt_from if adopt_from > n else n, n_key)  # the caller's tail
    if n == 0:
        return InsertResult(prefix_len=0, mamba_exist=True)
    if matched > prev:
        assert host is not None, f"matched {matched} without a host view"
        if not alloc.free_held(host, prev, matched):  # the last check: nothing changed yet
            alloc.unclaim(host, adopt_from, n)
            raise alloc.value_refusal(host, claimed, n_key)
    priority = params.priority
    # SGLang counts hits on insert only: not for chunked prefills, never under write-back.
    count_hits = not params.chunked and state.write_policy is not WritePolicy.WRITE_BACK
    note_hits = count_hits and state.backup_threshold is not None
    path: list[TreeNode] = []
    free_ranges: list[tuple[int, int]] = []
    pos = 0
    for below in resumed:
        # What the walk below does to a locked node wholly below ``prev``: stamp, raise
        # the priority, count the hit (the overlap hooks and frees have nothing to do).
        tree.touch(below)
        if priority > below.priority:
            below.priority = priority
        if count_hits and pos + below.key_len > inserted_len:
            below.hit_count += 1
            if note_hits:
                host_transfers.note_hit(state, below)
        path.append(below)
        pos += below.key_len
    # Conditional expressions, not min()/max(): a builtin min or max call costs as much as
    # the rest of a node's step (the bench's reference insert walks ~6 nodes).
    split_at = len(walked) - 1 if partial is not None else -1
    for i, child in enumerate(walked):
        m = child.key_len
        if i == split_at:
            child = tree.split(child, pm)  # stamps both halves
            m = pm
        else:
            tree.clock += 1  # Tree.touch, inline
            child.last_access_time = tree.clock
        if priority > child.priority:
            child.priority = priority
        fcd = child.full
        assert fcd is not None
        if fcd.value is None:
            # Host-only node: it adopts the incoming slots as its device value.
            _adopt_device_value(state, child, value[pos : pos + m].clone(), pos, params)
        else:
            consumed = m
            for c in overlap_hooks:
                kept = c.update_component_on_insert_overlap(child, m, pos, value, params)
                if kept < consumed:
                    consumed = kept
            start = prev if prev > pos else pos  # slots below prev_prefix_len stay
            end = pos + consumed
            if start < end and matched < 0:  # (else freed with the checks)
                if free_ranges and free_ranges[-1][1] == start:
                    free_ranges[-1] = (free_ranges[-1][0], end)
                else:
                    free_ranges.append((start, end))
        # After the hooks (a recovery split leaves ``child`` the lower part); a node the
        # request inserted before (it ends within ``inserted_len``) counts no hit again.
        if count_hits and pos + m > inserted_len:
            child.hit_count += 1
            if note_hits:
                host_transfers.note_hit(state, child)
        path.append(child)
        pos += m
        node = child
    if free_ranges:
        # The allocator copies what it frees: the caller may overwrite its tensor
        # (cache_unfinished_req rewrites the req_to_token row it passed).
        free_span = state.free_span
        # claim_value validated [owned_from, n), which holds every free range, and no Full
        # slot of the value was freed since: its host view lets the allocator skip the checks.
        for a, b in free_ranges:
            if free_span is not None:
                free_span(value, a, b, host)  # no tensor slice
            else:
                state.free_checked(value[a:b])
    prefix_len = pos
    if pos < n:
        state.counters.inserted_tokens += n - pos
        # The leaf keeps a copy (the caller may reuse its tensor); on CPU through the host
        # view: one numpy copy costs a third of a torch slice and clone.
        if host is not None and state.on_cpu:
            own = torch.from_numpy(host[pos:n].copy())
        else:
            own = value[pos:n].clone()
        target = _add_leaf(state, node, tokens[pos:], own, ns, priority)
        path.append(target)
        is_new_leaf = True
    else:
        target = node
        is_new_leaf = False
    result = InsertResult(prefix_len, n, target)
    for c in state.hooks.commit:
        target = c.commit_insert_component_data(target, is_new_leaf, params, result)
    result.last_device_node = target
    for c in state.hooks.insert_end:
        c.on_insert_end(path)
    hint = params.reuse_hint
    if hint is not None and state.full.strategy.uses_hints:
        if hint.session_id is None and params.session_id is not None:
            hint = replace(hint, session_id=params.session_id)
        state.full.note_hint(path, hint)
    if is_new_leaf and count_hits and n > inserted_len:  # after the commit hooks split it
        leaf = path[-1]
        leaf.hit_count += 1
        if note_hits:
            host_transfers.note_hit(state, leaf)
    return result


def _adopt_device_value(
    state: CacheState, node: TreeNode, value: torch.Tensor, pos: int, params: InsertParams
) -> None:
    """Give a host-only node fresh device slots (HiCache: re-insert over an evicted node)."""
    full = node.data[FULL_INDEX]
    assert full is not None and full.lock_ref == 0
    full.value = value
    state.full.evictable_size += node.key_len
    for c in state.hooks.recover:
        c.recover_after_unevict(node, pos, params)
    if node.heap_entry is None and state.full.is_device_leaf(node):
        state.full.note_leaf(node)
    if state.kv_events is not None:
        state.kv_events.stored_on_device(node)
