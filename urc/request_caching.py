"""The request layer: one request's life in the tree, over any
:class:`~urc.request_protocol.CachingRequest` (urc's ``Req``, the SGLang plug-in's view of
SGLang's ``Req``).

SGLang 0.5.23's terms, as functions of the cache state:

- :func:`lock` / :func:`unlock` / :func:`release_swa`: a request's :class:`TreeLock`;
- :func:`checkpoint`: insert the request's ``[0, up_to)`` (page-aligned), point its row at
  the tree's copy, move its lock to the node the insert ended on and advance
  ``cache_protected_len``;
- :func:`release`: the request is done with the tree: its lock goes and, unless a
  checkpoint handed the components' state to the tree, the components free what it holds.

SGLang 0.5.16's ``cache_finished_req`` / ``cache_unfinished_req`` (what
:class:`~urc.cache.UnifiedRadixCache` offers under those names, with urc's pools owning the
request's slots) are short compositions of the same steps.  Component hooks run around
every insert: ``validate_caching_req``, ``prepare_for_caching_req`` (fills insert params,
may truncate the key) and ``cleanup_after_caching_req`` (releases what the tree did not
take).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from urc.errors import InvalidInputError
from urc.insertion import insert
from urc.key import RadixKey
from urc.lock_receipts import TreeLock
from urc.locking import dec_lock_ref, dec_swa_lock_only, inc_lock_ref
from urc.matching import match_path, path_device_indices
from urc.node import TreeNode
from urc.params import InsertParams, InsertResult, MatchPrefixParams
from urc.req import Req
from urc.reuse_hint import ReuseHint

if TYPE_CHECKING:
    from urc.request_protocol import CachingRequest
    from urc.state import CacheState

__all__ = [
    "cache_finished_req",
    "cache_unfinished_req",
    "checkpoint",
    "lock",
    "move_lock",
    "release",
    "release_swa",
    "unlock",
]


# ---------------------------------------------------------------------------- the tree lock
def lock(state: CacheState, node: TreeNode) -> TreeLock:
    """Lock ``node``'s path for one holder; :func:`unlock` releases it.  Raises
    :class:`~urc.errors.InvalidLockError` (nothing locked) for an evicted node."""
    return TreeLock(node, inc_lock_ref(state, node).to_dec_params())


def unlock(state: CacheState, tree_lock: TreeLock | None) -> None:
    """Release ``tree_lock`` (``None``, or a lock on the root: nothing to do); its SWA part
    is skipped when :func:`release_swa` released it already.  The caller forgets the lock."""
    if tree_lock is None:
        return
    node = tree_lock.node
    if node.parent is not None:
        receipt = tree_lock.receipt
        if tree_lock.swa_released:
            receipt.skip_swa = True
        dec_lock_ref(state, node, receipt)


def release_swa(state: CacheState, tree_lock: TreeLock | None) -> None:
    """The request's window moved past its prefix: release the SWA part of ``tree_lock``
    early (Full stays locked until :func:`unlock`), once."""
    if tree_lock is None or tree_lock.swa_released:
        return
    if tree_lock.node.parent is not None:
        dec_swa_lock_only(state, tree_lock.node, tree_lock.receipt)
    tree_lock.swa_released = True


def move_lock(state: CacheState, req: CachingRequest, node: TreeNode) -> None:
    """Move ``req``'s tree lock to ``node`` (``req.lock``, ``req.last_node``).  The new node
    is locked before the old lock goes: both paths share a prefix, so neither walk goes past
    the first node the other holds, and nothing is evictable in between."""
    new_lock = lock(state, node)
    unlock(state, req.lock)
    req.lock = new_lock
    req.last_node = node


def _drop_lock(state: CacheState, req: CachingRequest) -> None:
    unlock(state, req.lock)
    req.lock = None
    req.last_node = None


# ---------------------------------------------------------------------------- one insert
def _row(state: CacheState, req: CachingRequest, is_finished: bool) -> int:
    """The request's ``req_to_token`` row, after the components validated the request."""
    row = req.req_pool_idx
    if row is None:
        raise InvalidInputError(f"request {req.rid} has no req_pool_idx")
    state.req_to_token_pool.check_row(row)
    for check in state.hooks.req_checks:
        check.validate_caching_req(req, is_finished)
    return row


def _prepare(
    state: CacheState, req: CachingRequest, n_tokens: int, is_finished: bool, chunked: bool
) -> tuple[InsertParams, int]:
    """Insert params filled by the components, keyed by the first ``aligned`` of the first
    ``n_tokens`` tokens (truncated where a component asked, then page-aligned), and
    ``aligned``.  The key's ids are ``req.fill_prefix(aligned)``: valid for this call only."""
    fill = req.fill_ids
    n_tokens = min(n_tokens, len(fill))
    params = InsertParams(
        prev_prefix_len=req.cache_protected_len,
        chunked=chunked,
        priority=req.priority,
        session_id=req.session_id,
    )
    eff = n_tokens
    for c in state.hooks.prepare:
        limit = c.prepare_for_caching_req(req, params, n_tokens, is_finished)
        if limit is not None and limit < eff:
            eff = max(limit, 0)
    ps = state.page_size
    if state.is_eagle:
        key = RadixKey(list(fill[:eff]), req.extra_key).bigram()
        aligned = len(key) - len(key) % ps
        key = key[:aligned]
    else:
        aligned = eff - eff % ps
        key = RadixKey(req.fill_prefix(aligned), req.extra_key)
    params.key = key
    return params, aligned


def _cleanup(
    state: CacheState,
    req: CachingRequest,
    is_finished: bool,
    result: InsertResult | None,
    params: InsertParams | None,
) -> None:
    for c in state.hooks.cleanup:
        c.cleanup_after_caching_req(req, is_finished, result, params)


# ---------------------------------------------------------------------------- 0.5.23's layer
def checkpoint(
    state: CacheState, req: CachingRequest, up_to: int, *, finished: bool = False
) -> InsertResult | None:
    """Insert the request's ``[0, up_to)`` (truncated where a component asks, then
    page-aligned: ``a`` tokens) into the tree, point row ``[cache_protected_len, a)`` at
    the tree's copy, move ``req.lock`` / ``req.last_node`` to the node the insert ended on
    and set ``cache_protected_len = a`` (SGLang 0.5.23's ``checkpoint``).

    Frees only the duplicates the insert found (already cached tokens past the protected
    prefix); the rest of the row stays the request's, for its owner to free.  A FULL-only
    tree also splits the path at the prompt's page-aligned end, so eviction can drop the
    output without the prompt.  ``finished``: the components hand the request's own state
    to the tree (Mamba donates its slot) and free the rest; otherwise they fork it.  With
    ``a == 0`` nothing is inserted and the lock stays.  Returns the insert's result
    (``None``: nothing inserted).  Raises :class:`~urc.errors.InvalidInputError` (nothing
    changed) for a request without a valid row, with invalid component fields or with
    ``up_to`` below its protected prefix.
    """
    row = _row(state, req, finished)
    if up_to < req.cache_protected_len:
        raise InvalidInputError(
            f"request {req.rid}: checkpoint up to {up_to} < protected {req.cache_protected_len}"
        )
    params, aligned = _prepare(state, req, up_to, finished, False)
    if aligned <= 0 or aligned < req.cache_protected_len:
        _cleanup(state, req, finished, None, params)
        return None
    pool = state.req_to_token_pool
    values = pool.read(row, 0, aligned)
    params.value = values
    result = insert(state, params)
    _split_at_prompt(state, req, params, values, aligned)
    last = result.last_device_node
    assert last is not None, f"insert of {aligned} tokens ended on no node"
    protected = req.cache_protected_len
    if aligned > protected:
        path = path_device_indices(state, last)
        assert path.shape[0] == aligned, f"path holds {path.shape[0]} != {aligned}"
        pool.write(row, protected, path[protected:])
    move_lock(state, req, last)
    req.cache_protected_len = aligned
    _cleanup(state, req, finished, result, params)
    return result


def _split_at_prompt(
    state: CacheState,
    req: CachingRequest,
    params: InsertParams,
    values: torch.Tensor,
    aligned: int,
) -> None:
    """A FULL-only tree: insert the prompt's page-aligned prefix again (a split there, one
    priority higher), as SGLang 0.5.23's checkpoint does."""
    if len(state.components) != 1 or state.is_eagle:
        return
    prompt = req.prompt_len
    prompt -= prompt % state.page_size
    if 0 < prompt < aligned:
        assert params.key is not None
        insert(
            state,
            InsertParams(
                key=params.key[:prompt],
                value=values[:prompt],
                prev_prefix_len=prompt,
                priority=params.priority + 1,
                session_id=params.session_id,
            ),
        )


def release(state: CacheState, req: CachingRequest, *, checkpointed: bool) -> None:
    """The request is done with the tree: its lock is released (``req.lock`` and
    ``req.last_node`` cleared) and, unless a finished :func:`checkpoint` already handed its
    component state to the tree (``checkpointed``), the components free what it holds
    (Mamba: its state slots).  The request's Full slots and row stay its owner's to free.
    A request whose owner released the lock already (``req.lock is None``, as SGLang's
    ``release_kv_cache`` does) keeps its ``last_node``."""
    if req.lock is not None:
        _drop_lock(state, req)
    if not checkpointed:
        _cleanup(state, req, True, None, None)


# ---------------------------------------------------------------------------- 0.5.16's names
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

    The insert is :func:`checkpoint`'s without its lock move and row rewrite (the row and
    the lock go right after: :func:`release`), then the frees.
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
    _drop_lock(state, req)
    _cleanup(state, req, True, result, params)
    state.req_to_token_pool.free(row)
    req.req_pool_idx = None


def cache_unfinished_req(state: CacheState, req: Req, chunked: bool = False) -> None:
    """Cache the KV computed so far (chunked prefill) and keep the request going.

    :func:`checkpoint` of the committed length, with 0.5.16's re-match: inserts ``[0, a)``
    (``a``: committed length, page-aligned), then matches the same key (recency and hit
    counters, as SGLang 0.5.16), rewrites the request's ``req_to_token`` row with the
    tree's indices for the hit (duplicates were freed), moves the request's lock to the
    node ending the hit and sets ``prefix_indices``, ``cache_protected_len ==
    len(prefix_indices)`` and ``last_node``.  The unaligned tail stays request-owned.

    One deliberate difference: where the match stops short of ``a`` (an SWA window or a
    Mamba state missing at the end), SGLang would leave tree-owned slots in the request's
    unprotected range (freed twice at finish); here the lock and ``cache_protected_len``
    cover the whole inserted path instead (as 0.5.23's checkpoint does).
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
        last, indices = _rematch(state, req, row, params, result, resume, aligned)
        move_lock(state, req, last)
        req.prefix_indices = indices
        req.cache_protected_len = aligned
    _cleanup(state, req, False, result, params)


def _rematch(
    state: CacheState,
    req: Req,
    row: int,
    params: InsertParams,
    result: InsertResult,
    resume: TreeNode | None,
    aligned: int,
) -> tuple[TreeNode, torch.Tensor]:
    """0.5.16's re-match of the key just inserted: the node the request's lock moves to and
    the path's indices, written into the request's row past its protected prefix."""
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
        last = inserted  # see cache_unfinished_req's docstring
        indices = path_device_indices(state, last) if held is None else held
    assert last is not None
    assert indices.shape[0] == aligned, f"path holds {indices.shape[0]} != {aligned}"
    if k is None and aligned > protected:
        state.req_to_token_pool.write(row, protected, indices[protected:])
    return last, indices


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
