"""Matching: the longest cached prefix of a key (``UnifiedRadixCache.match_prefix``) and the
re-match of a path the caller knows (``match_path``).

A walk descends the tree page by page (splitting the node where a match ends inside it),
asks each validating component whether a node may end the match (SWA: a whole window of KV
above it; Mamba: a state on it), then stamps the best match and its ancestors, counts, and
lets components refresh their LRUs and finish the result.  Without a host tier, components
whose rule is a window (``device_match_window``) let the tree's ``match_tail`` find, stamp and
gather the hit in one compiled pass.  The result's device indices are one ``torch.cat`` of the
hit's node values, built when first read (:class:`~urc.params.PendingIndices`), and ``None``
for ``MatchPrefixParams.with_indices=False`` (then :func:`path_device_indices` gives them).
See the cache's docstring for costs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from urc.components.base import MatchValidator
from urc.errors import InvalidInputError
from urc.key import RadixKey, check_key
from urc.node import Tier, TreeNode
from urc.params import MatchPrefixParams, MatchResult, PendingIndices

if TYPE_CHECKING:
    from urc.state import CacheState

__all__ = ["empty_result", "finish_match", "match_path", "match_prefix", "path_device_indices"]

# The bench's match phases: results built with ``tuple.__new__`` (no NamedTuple argument
# parsing), tiers as module constants (an Enum attribute load costs ~0.1 µs).
_new_tuple = tuple.__new__
_DEVICE, _HOST = Tier.DEVICE, Tier.HOST
# MatchResult's defaulted fields (a match with no host hit) up to ``device_len``, in order.
_NO_HOST = tuple(MatchResult._field_defaults[f] for f in MatchResult._fields[4:-1])
assert MatchResult._fields[-1] == "device_len", MatchResult._fields


def match_prefix(state: CacheState, params: MatchPrefixParams) -> MatchResult:
    """Longest cached prefix of ``params.key``.

    Mutates: may split the node where the match ends; refreshes access times (parent <
    child along the path) and component LRUs; Mamba may copy state into ``params.req``.
    Returns the device hit (concatenated indices, or ``None`` and its length with
    ``params.with_indices=False``) and the nodes that end it.
    """
    given: object = params.key  # typed RadixKey, but callers pass anything
    if not isinstance(given, RadixKey):
        check_key(given, "match_prefix's key")
    for check in state.hooks.match_checks:
        check.validate_match(params)
    tree = state.tree
    tokens = tree.tokens_of(params.key)
    n = len(tokens)
    if n == 0:
        return empty_result(state, params.with_indices)
    ns = params.key.extra_key
    ck = None if ns is None else tree.root_child_key(tokens, ns)  # None: the walk's page key
    # The structural walk first (read-only, urc.fastpath: compiled when built), then the
    # per-node steps; the node where the match ends inside its edge is split when the steps
    # reach it, so stamps and splits happen in the order of a node-by-node walk.
    walked, pos, partial, pm = tree.walk(tree.root, ck, tokens, 0, tree.page_size)
    if state.host_tier is None:
        return _match_device_only(state, params, walked, pos, partial, pm, n)
    # With a host tier: one top-down pass finds the device hit and the hit on any tier.
    validators, host_validators = _match_validators(state)
    path: list[TreeNode] = []
    pos = 0
    best = 0
    best_any = 0
    on_device = True
    if partial is not None:
        walked.append(partial)
    last = len(walked) - 1
    for i, child in enumerate(walked):
        m = child.key_len
        if partial is not None and i == last:
            child = tree.split(child, pm)
            m = pm
        fcd = child.full
        assert fcd is not None
        if fcd.value is None:
            if fcd.host_value is None:
                break
            on_device = False  # the device hit ends above the first host-only node
        path.append(child)
        pos += m
        # Every validator sees every node it is walked over (they are stateful): a list,
        # not a short-circuiting generator.
        if on_device and all([validate(child) for validate in validators]):
            best = len(path)
        if all([validate(child) for validate in host_validators]):
            best_any = len(path)
    return finish_match(state, params, path, best, best_any, pos, n)


def _match_device_only(
    state: CacheState,
    params: MatchPrefixParams,
    walked: list[TreeNode],
    pos: int,
    partial: TreeNode | None,
    pm: int,
    n: int,
) -> MatchResult:
    """:func:`match_prefix` without a host tier: the device path is the whole walk, the hit
    its deepest node every validating component accepts.  With window rules
    (``hooks.match_rules``) one pass of the tree's ``match_tail`` (compiled when built)
    finds it from the deepest node up, stamps it and gathers its values; else the path
    validators answer first.  The result of :func:`finish_match` is inline (this is the
    hot path); both end in :func:`_end_match`."""
    tree = state.tree
    # Without a host tier every node holds its Full value on device (sanity_check): the
    # walk's nodes are the device path as they stand.
    if partial is not None:
        walked.append(tree.split(partial, pm))
        pos += pm
    path = walked
    rules = state.hooks.match_rules
    if rules is None:  # validators without a window rule: they find the hit
        path = walked[: _deepest_boundary(state, walked, True)] if walked else walked
        rules = ()
    k, hit, tree.clock, values = tree.match_tail(path, rules, tree.clock, params.with_indices)
    if k:
        last = walked[k - 1]
        indices = None if values is None else PendingIndices(values)
        result = _new_tuple(MatchResult, (indices, last, last, last, *_NO_HOST, hit))
    else:
        result = empty_result(state, params.with_indices)
    return _end_match(state, params, walked, k, k, pos, n, result)


def match_path(
    state: CacheState,
    params: MatchPrefixParams,
    path: list[TreeNode],
    known: tuple[int, torch.Tensor] | None = None,
) -> MatchResult:
    """:func:`match_prefix` of a key the caller knows is exactly the device path ``path``
    (root first, as :meth:`urc.tree.Tree.path_to` gives): the same validation, stamps, hooks and
    result, without walking the key's tokens (request caching re-matches what it just
    inserted this way, so a chunk's commit does not cost the whole prompt again).
    ``known = (k, indices)``: the caller already holds the device indices of
    ``path[:k]``; where the hit ends within them the result's ``device_indices`` is a
    view of ``indices`` (no copy), else ``indices`` and the rest concatenated."""
    for check in state.hooks.match_checks:
        check.validate_match(params)
    if not path:
        return empty_result(state, params.with_indices)
    pos = sum([node.key_len for node in path])
    best = _deepest_boundary(state, path, True)
    matched = best if state.host_tier is None else _deepest_boundary(state, path, False)
    return finish_match(state, params, path, best, matched, pos, pos, known)


def _deepest_boundary(state: CacheState, path: list[TreeNode], device_only: bool) -> int:
    """The deepest ``i`` where a walk of ``path`` would accept ``path[:i]`` (0: none),
    asked from the deepest node up: usually the first answer is yes."""
    validating = state.hooks.validating
    if len(validating) == 1:  # one validating component (SWA or Mamba) answers itself
        return validating[0].deepest_boundary(path, device_only)
    checks = []
    for c in validating:
        check = c.create_path_validator(path, device_only)
        if check is not None:
            checks.append(check)
    for i in range(len(path), 0, -1):
        if all([check(i) for check in checks]):
            return i
    return 0


def _match_validators(
    state: CacheState,
) -> tuple[list[MatchValidator], list[MatchValidator]]:
    """Fresh validators for one tiered match: device-only, and any-tier."""
    validators: list[MatchValidator] = []
    host_validators: list[MatchValidator] = []
    for c in state.hooks.validating:
        v = c.create_match_validator(True)
        if v is not None:
            validators.append(v)
        v = c.create_match_validator(False)
        if v is not None:
            host_validators.append(v)
    return validators, host_validators


def finish_match(
    state: CacheState,
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
    :func:`match_path`)."""
    # Only the best match and its ancestors are stamped, after the walk, parent < child
    # (SGLang's order); nodes walked past the best keep their age.
    state.tree.stamp_path(path[:matched] if matched < len(path) else path)
    if best == 0:
        result = empty_result(state, params.with_indices)
    else:
        last = path[best - 1]
        hit = sum([p.key_len for p in path[:best]])
        indices = _device_indices(path, best, known, hit) if params.with_indices else None
        # MatchResult(indices, last, last, last, device_len=hit) without keyword handling.
        result = _new_tuple(MatchResult, (indices, last, last, last, *_NO_HOST, hit))
    if matched > best:
        host_node = path[matched - 1]
        host_len = 0
        for p in path[best:matched]:
            host_len += p.key_len
        result = result._replace(
            last_host_node=host_node, best_match_node=host_node, host_hit_length=host_len
        )
    return _end_match(state, params, path, best, matched, pos, n, result)


def _end_match(
    state: CacheState,
    params: MatchPrefixParams,
    path: list[TreeNode],
    best: int,
    matched: int,
    pos: int,
    n: int,
    result: MatchResult,
) -> MatchResult:
    """What every match ends with, once stamped and with its result built: the counters,
    the components' match-end and finalize hooks, the hit counts; returns the result."""
    counters = state.counters
    counters.match_requests += 1
    counters.query_tokens += n
    for c in state.hooks.match_end:
        c.on_match_end(path, matched)
    for c in state.hooks.finalize:
        result = c.finalize_match_result(result, params, path, best, pos)
    hits = counters.hit_tokens
    hit = result.device_len  # as stored; the property (a Python call) for one built by hand
    hits[_DEVICE] += result.device_prefix_len if hit is None else hit
    hits[_HOST] += result.host_hit_length
    return result


def _device_indices(
    path: list[TreeNode], best: int, known: tuple[int, torch.Tensor] | None, hit: int
) -> torch.Tensor | PendingIndices:
    """The Full device indices of ``path[:best]`` (``hit`` tokens): pending (concatenated
    when read), or (``known`` covers ``path[:k]`` with ``k >= best``) a view of the
    caller's ``known`` tensor."""
    if known is None:
        k, values = 0, []
    else:
        k, held = known
        if k >= best:
            return held if k == best else held[:hit]
        values = [held]
    values += [p.full.value for p in path[k:best]]  # type: ignore[misc]
    return PendingIndices(values)


def empty_result(state: CacheState, with_indices: bool = True) -> MatchResult:
    """A miss: no device indices (an empty tensor, built when read; ``None`` without
    indices), every node the root."""
    empty = PendingIndices([state.no_indices]) if with_indices else None
    root = state.tree.root
    return _new_tuple(MatchResult, (empty, root, root, root, *_NO_HOST, 0))


def path_device_indices(state: CacheState, node: TreeNode) -> torch.Tensor:
    """The Full device indices on the path from the root down to ``node`` (a fresh tensor;
    empty for the root).  Changes nothing.  Raises
    :class:`~urc.errors.InvalidInputError` when ``node`` was evicted or a node of its path
    is not on device."""
    if node.deleted:
        raise InvalidInputError(f"path_device_indices of node {node.id}, which was evicted")
    values = [p.full.value for p in state.tree.path_to(node)]
    if not values:
        return torch.empty(0, dtype=torch.int64, device=state.device)
    if any(v is None for v in values):
        raise InvalidInputError(f"a node on the path to node {node.id} is not on device")
    return torch.cat(values)  # type: ignore[arg-type]
