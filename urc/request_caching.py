"""Request-level caching: ``cache_finished_req`` and ``cache_unfinished_req``.

Part of :class:`~urc.cache.UnifiedRadixCache` (its methods of those names call these), kept
apart because it is a layer above the tree: it turns a running request's KV ranges into an
insert, a lock move and frees.  Component hooks run around it: ``validate_caching_req``,
``prepare_for_caching_req`` (fills insert params, may truncate the key) and
``cleanup_after_caching_req`` (releases what the tree did not take).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from urc.errors import InvalidInputError
from urc.insertion import insert
from urc.key import RadixKey
from urc.locking import dec_lock_ref, inc_lock_ref
from urc.matching import match_path, path_device_indices
from urc.node import TreeNode
from urc.params import InsertParams, InsertResult, MatchPrefixParams
from urc.req import Req
from urc.reuse_hint import ReuseHint

if TYPE_CHECKING:
    from urc.state import CacheState

__all__ = ["cache_finished_req", "cache_unfinished_req", "release_req_lock"]


def _row(state: CacheState, req: Req, is_finished: bool) -> int:
    """The request's ``req_to_token`` row, after the components validated the request."""
    row = req.req_pool_idx
    if row is None:
        raise InvalidInputError(f"request {req.rid} has no req_pool_idx")
    state.req_to_token_pool.check_row(row)
    for check in state.hooks.req_checks:
        check.validate_caching_req(req, is_finished)
    return row


def _prepare(
    state: CacheState, req: Req, n_tokens: int, is_finished: bool, chunked: bool
) -> tuple[InsertParams, int]:
    """Insert params filled by the components, keyed by the first ``aligned`` of the first
    ``n_tokens`` tokens (truncated where a component asked, then page-aligned), and
    ``aligned``.  The key's ids are ``req.fill_prefix(aligned)`` (a view of the request's
    packed prompt): valid for this call only."""
    fill = req.fill_ids
    n_tokens = min(n_tokens, len(fill))
    params = InsertParams(prev_prefix_len=req.cache_protected_len, chunked=chunked)
    eff = n_tokens
    for c in state.hooks.prepare:
        limit = c.prepare_for_caching_req(req, params, n_tokens, is_finished)
        if limit is not None and limit < eff:
            eff = max(limit, 0)
    ps = state.page_size
    if state.is_eagle:
        key = RadixKey(fill[:eff], req.extra_key).bigram()
        aligned = len(key) - len(key) % ps
        key = key[:aligned]
    else:
        aligned = eff - eff % ps
        key = RadixKey(req.fill_prefix(aligned), req.extra_key)
    params.key = key
    return params, aligned


def _handled_len(state: CacheState, req: Req, kv_len_to_handle: int | None) -> int:
    """Tokens ``cache_finished_req`` may cache: ``kv_len_to_handle``, or the committed
    length (the prompt only, under ``strip_thinking_cache`` after thinking tokens)."""
    committed = req.kv_committed_len
    if kv_len_to_handle is not None:
        if not 0 <= kv_len_to_handle <= committed:
            raise InvalidInputError(
                f"kv_len_to_handle must be in [0, {committed}], got {kv_len_to_handle}"
            )
        return kv_len_to_handle
    if state.config.strip_thinking_cache and req.reasoning_tokens > 0:
        return min(committed, len(req.origin_input_ids))
    return committed


def cache_finished_req(
    state: CacheState,
    req: Req,
    is_insert: bool = True,
    kv_len_to_handle: int | None = None,
    hint: ReuseHint | None = None,
) -> None:
    """Hand a finished request's KV to the tree and release everything it held.

    KV ranges (token positions of ``req``; ``h`` = tokens handled (``kv_len_to_handle``, or
    see :func:`_handled_len`), ``a`` = inserted length (``h`` page-aligned and truncated
    where a component asks), ``c`` = committed, ``e`` = allocated)::

        [0, cache_protected_len)           tree-owned; unlocked here
        [cache_protected_len, a)           inserted; duplicates of cached tokens freed
        [max(a, protected), c)             unaligned tail, truncated, stripped thinking: freed
        [c, e)                             over-allocated (never computed): freed

    A range the caller took with ``req.pop_committed_kv_cache()`` (``[protected, c)``: not
    inserted either) or ``req.pop_overallocated_kv_cache()`` (``[c, e)``) is the caller's
    to free.  Frees the request's ``req_to_token`` row.  With ``is_insert=False`` nothing
    is inserted.  ``hint`` (:mod:`urc.reuse_hint`) goes with the insert to the eviction
    policy (ignored by policies that do not use hints).  Raises
    :class:`~urc.errors.InvalidInputError` (nothing changed) for a ``kv_len_to_handle``
    outside ``[0, c]`` or a ``hint`` that is not a ``ReuseHint``.
    """
    if hint is not None and type(hint) is not ReuseHint:
        raise InvalidInputError(f"hint must be a ReuseHint, got {hint!r}")
    row = _row(state, req, True)
    handled = _handled_len(state, req, kv_len_to_handle)
    committed = req.kv_committed_len
    allocated = max(req.kv_allocated_len, committed)
    kv = state.req_to_token_pool.read(row, 0, allocated)
    params: InsertParams | None = None
    result: InsertResult | None = None
    free_start = req.cache_protected_len
    free_end = committed if req.kv_overallocated_freed else allocated
    if req.kv_committed_freed:
        free_start = max(free_start, committed)
    elif is_insert:
        params, aligned = _prepare(state, req, handled, True, False)
        if aligned > 0:
            params.value = kv[:aligned]
            params.reuse_hint = hint
            result = insert(state, params)
        free_start = max(aligned, free_start)
    if free_start < free_end:
        state.free_checked(kv[free_start:free_end])
    release_req_lock(state, req)
    for c in state.hooks.cleanup:
        c.cleanup_after_caching_req(req, True, result, params)
    state.req_to_token_pool.free(row)
    req.req_pool_idx = None


def cache_unfinished_req(state: CacheState, req: Req, chunked: bool = False) -> None:
    """Cache the KV computed so far (chunked prefill) and keep the request going.

    As SGLang: inserts ``[0, a)`` (``a``: committed length, page-aligned), then matches the
    same key, rewrites the request's ``req_to_token`` row with the tree's indices for the
    hit (duplicates were freed), moves the request's lock to the node ending the hit and
    sets ``prefix_indices``, ``cache_protected_len == len(prefix_indices)`` and
    ``last_node``.  The unaligned tail stays request-owned.

    One deliberate difference: where the match stops short of ``a`` (an SWA window or a
    Mamba state missing at the end), SGLang would leave tree-owned slots in the request's
    unprotected range (freed twice at finish); here the lock and ``cache_protected_len``
    cover the whole inserted path instead.
    """
    row = _row(state, req, False)
    params, aligned = _prepare(state, req, req.kv_committed_len, False, chunked)
    result: InsertResult | None = None
    if aligned > 0 and aligned >= req.cache_protected_len:
        params.value = state.req_to_token_pool.read(row, 0, aligned)
        # The walk resumes at the request's own locked node and the re-match is of the path
        # just inserted: a chunk's commit costs the chunk, not the prompt so far.
        start = req.last_node
        resume = start if start is not None and not state.is_eagle else None
        result = insert(state, params, resume)
        inserted = result.last_device_node
        assert inserted is not None
        key = params.key
        assert key is not None
        path = state.tree.path_to(inserted)
        protected = req.cache_protected_len
        # The row holds the tree's indices of the old lock's path; the new nodes' slots
        # follow it (replacing duplicates the insert freed), so the row's ``[0, a)`` is the
        # re-match's result and nothing O(prompt) is copied per chunk.
        k = _nodes_below(path, resume)
        if k is not None:
            pos = protected
            for node in path[k:]:
                v = node.full.value
                assert v is not None, f"node {node.id} on the inserted path has no device value"
                state.req_to_token_pool.write(row, pos, v)
                pos += node.key_len
            assert pos == aligned, f"inserted path ends at {pos}, not {aligned}"
            row_view = state.req_to_token_pool.read(row, 0, aligned)
            held: torch.Tensor | None = row_view
            hit = match_path(state, MatchPrefixParams(key=key), path, (len(path), row_view))
        else:
            held = None
            hit = match_path(state, MatchPrefixParams(key=key), path)
        last: TreeNode | None = hit.last_device_node
        indices = hit.indices
        if indices.shape[0] != aligned:
            last = result.last_device_node  # see the docstring
            assert last is not None
            indices = path_device_indices(state, last) if held is None else held
        assert last is not None
        assert indices.shape[0] == aligned, f"path holds {indices.shape[0]} != {aligned}"
        if k is None and aligned > protected:
            state.req_to_token_pool.write(row, protected, indices[protected:])
        # Lock the new node before releasing the old one (SGLang releases first; the end
        # state is the same, and this way both walks stop at the first locked node).
        receipt = inc_lock_ref(state, last)
        release_req_lock(state, req)
        req.lock_receipt = receipt
        req.prefix_indices = indices
        req.cache_protected_len = aligned
        req.last_node = last
    for c in state.hooks.cleanup:
        c.cleanup_after_caching_req(req, False, result, params)


def _nodes_below(path: list[TreeNode], resume: TreeNode | None) -> int | None:
    """How many nodes of ``path`` (root first) end at or above ``resume`` (0 for the root);
    ``None`` when ``resume`` is not on it (no resumed walk)."""
    if resume is None:
        return None
    if resume.parent is None:
        return 0
    k = len(path)  # the old lock's node is a few nodes from the path's end
    while k and path[k - 1] is not resume:
        k -= 1
    return k or None


def release_req_lock(state: CacheState, req: Req) -> None:
    """Release the lock ``req`` holds (with its receipt) and forget it."""
    node = req.last_node
    if node is not None and node.parent is not None:
        receipt = req.lock_receipt
        params = receipt.to_dec_params() if receipt is not None else None
        if params is not None and req.swa_lock_released:
            params.skip_swa = True
        dec_lock_ref(state, node, params)
    req.last_node = None
    req.lock_receipt = None
    req.swa_lock_released = False
