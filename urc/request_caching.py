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
from urc.key import RadixKey
from urc.params import InsertParams, InsertResult
from urc.req import Req
from urc.tree import TreeNode

if TYPE_CHECKING:
    from urc.cache import UnifiedRadixCache

__all__ = ["cache_finished_req", "cache_unfinished_req", "release_req_lock"]


def _row(cache: UnifiedRadixCache, req: Req, is_finished: bool) -> int:
    """The request's ``req_to_token`` row, after the components validated the request."""
    row = req.req_pool_idx
    if row is None:
        raise InvalidInputError(f"request {req.rid} has no req_pool_idx")
    for check in cache._req_checks:
        check.validate_caching_req(req, is_finished)
    return row


def _prepare(
    cache: UnifiedRadixCache, req: Req, is_finished: bool, chunked: bool
) -> tuple[InsertParams, RadixKey, int]:
    """Insert params filled by the components, the tree key of the committed tokens
    (truncated where a component asked) and its page-aligned length."""
    token_ids = req.fill_ids[: req.kv_committed_len]
    params = InsertParams(
        key=RadixKey(token_ids, req.extra_key),
        prev_prefix_len=req.cache_protected_len,
        chunked=chunked,
    )
    eff = len(token_ids)
    for c in cache._prepare_hooks:
        limit = c.prepare_for_caching_req(req, params, len(token_ids), is_finished)
        if limit is not None and limit < eff:
            eff = max(limit, 0)
    key = RadixKey(token_ids[:eff], req.extra_key)
    if cache.is_eagle:
        key = key.bigram()
    n_key = len(key)
    return params, key, n_key - n_key % cache.page_size


def cache_finished_req(cache: UnifiedRadixCache, req: Req, is_insert: bool = True) -> None:
    """Hand a finished request's KV to the tree and release everything it held.

    KV ranges (token positions of ``req``; ``a`` = inserted length, page-aligned)::

        [0, cache_protected_len)           tree-owned; unlocked here
        [cache_protected_len, a)           inserted; duplicates of cached tokens freed
        [max(a, protected), allocated)     unaligned tail, truncated or uncomputed: freed

    Frees the request's ``req_to_token`` row.  With ``is_insert=False`` nothing is
    inserted and ``[cache_protected_len, allocated)`` is freed.
    """
    row = _row(cache, req, True)
    allocated = max(req.kv_allocated_len, req.kv_committed_len)
    kv = cache.req_to_token_pool.read(row, 0, allocated)
    params: InsertParams | None = None
    result: InsertResult | None = None
    keep = req.cache_protected_len
    if is_insert:
        params, key, aligned = _prepare(cache, req, True, False)
        if aligned > 0:
            params.key = key[:aligned]
            params.value = kv[:aligned]
            result = cache.insert(params)
        keep = max(aligned, keep)
    if keep < allocated:
        cache.free_request_kv(kv[keep:allocated])
    release_req_lock(cache, req)
    for c in cache._cleanup_hooks:
        c.cleanup_after_caching_req(req, True, result, params)
    cache.req_to_token_pool.free(row)
    req.req_pool_idx = None


def cache_unfinished_req(cache: UnifiedRadixCache, req: Req, chunked: bool = False) -> None:
    """Cache the KV computed so far (chunked prefill) and keep the request going.

    Inserts ``[0, a)`` (``a``: committed length, page-aligned), rewrites the request's
    ``req_to_token`` row with the tree's indices for that range (duplicates were freed),
    moves the request's lock to the node ending at ``a`` and sets ``prefix_indices``,
    ``cache_protected_len == len(prefix_indices) == a`` and ``last_node``.
    The unaligned tail stays request-owned.
    """
    row = _row(cache, req, False)
    params, key, aligned = _prepare(cache, req, False, chunked)
    result: InsertResult | None = None
    if aligned > 0 and aligned >= req.cache_protected_len:
        params.key = key[:aligned]
        params.value = cache.req_to_token_pool.read(row, 0, aligned)
        result = cache.insert(params)
        last = result.last_device_node
        assert last is not None
        indices = _path_indices(cache, last)
        assert indices.shape[0] == aligned, f"path holds {indices.shape[0]} != {aligned}"
        protected = req.cache_protected_len
        if aligned > protected:
            cache.req_to_token_pool.write(row, protected, indices[protected:])
        receipt = cache.inc_lock_ref(last)  # lock the new node before unlocking the old one
        release_req_lock(cache, req)
        req.prefix_indices = indices
        req.cache_protected_len = aligned
        req.last_node = last
        req.lock_receipt = receipt
    for c in cache._cleanup_hooks:
        c.cleanup_after_caching_req(req, False, result, params)


def _path_indices(cache: UnifiedRadixCache, node: TreeNode) -> torch.Tensor:
    """Full device indices from the root down to ``node`` (all must be on device)."""
    values = []
    while node.parent is not None:
        v = node.full.value  # type: ignore[union-attr]
        assert v is not None, f"node {node.id} on the path has no device value"
        values.append(v)
        node = node.parent
    if not values:
        return torch.empty(0, dtype=torch.int64, device=cache.device)
    values.reverse()
    return torch.cat(values)


def release_req_lock(cache: UnifiedRadixCache, req: Req) -> None:
    """Release the lock ``req`` holds (with its receipt) and forget it."""
    node = req.last_node
    if node is not None and node.parent is not None:
        receipt = req.lock_receipt
        params = receipt.to_dec_params() if receipt is not None else None
        if params is not None and req.swa_lock_released:
            params.skip_swa = True
        cache.dec_lock_ref(node, params)
    req.last_node = None
    req.lock_receipt = None
    req.swa_lock_released = False
