"""The hot loops of match and insert: compiled implementations and their pure-Python twins.

:func:`py_walk` (the tree walk of match and insert) and :func:`py_match_tail` (a match's
hit, stamps and values once walked) are the reference; ``urc._native._walk`` (built from
``urc/_native/walk.c`` when a C compiler is there at install time) computes exactly the same
results without building a list slice per node, comparing tokens or reading attributes
through the interpreter.  Which one a cache uses is
:attr:`urc.config.CacheConfig.walk_impl` (:class:`WalkImpl`): ``AUTO`` takes the compiled
ones when they were built, ``PYTHON`` always the twins.  Both behave identically (the suite
runs the same operation sequences on both and compares them step by step), so the choice
only changes speed.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from urc.errors import ConfigError
from urc.key import TokenIds

if TYPE_CHECKING:
    from urc.node import TreeNode

__all__ = [
    "MatchRules",
    "MatchTailFn",
    "MatchTailResult",
    "WalkFn",
    "WalkImpl",
    "WalkResult",
    "choose_impl",
    "common_len",
    "native_available",
    "page_key",
    "py_deepest_boundary",
    "py_match_tail",
    "py_walk",
    "select_match_tail",
    "select_walk",
]

#: ``(nodes, pos, partial, m)``: see :func:`py_walk`.
WalkResult = tuple["list[TreeNode]", int, "TreeNode | None", int]
WalkFn = Callable[["TreeNode", Any, TokenIds, int, int], WalkResult]
#: ``(component type, window)`` pairs: where a match may end (see :func:`py_deepest_boundary`).
MatchRules = tuple[tuple[int, int], ...]
#: ``(k, hit, clock, values)``: see :func:`py_match_tail`.
MatchTailResult = tuple[int, int, int, "list[Any] | None"]
MatchTailFn = Callable[["list[TreeNode]", MatchRules, int, bool], MatchTailResult]

_T = TypeVar("_T")

# Compare this many tokens per C-level slice comparison when locating a mismatch.
_SCAN_STEP = 64


class WalkImpl(Enum):
    """Which implementation of :func:`py_walk` a cache runs."""

    AUTO = "auto"  # the compiled one when it was built, else the Python twin
    NATIVE = "native"  # the compiled one (ConfigError when it was not built)
    PYTHON = "python"  # the pure-Python twin


def py_walk(node: TreeNode, ck: Any, tokens: TokenIds, pos: int, page_size: int) -> WalkResult:
    """Follow ``tokens[pos:]`` down from ``node``; changes nothing.

    The first child is looked up under ``ck`` (the caller knows the root's namespaced key;
    ``None``: the page key at ``pos``, as for every later one), each later one under the
    page key of the next page (:func:`page_key`).  Returns
    ``(nodes, pos, partial, m)``: the children whose whole edge matched, in order; the
    position after them; the child where the match ends inside its edge (``None`` when the
    walk ended at a node boundary, at a missing child or at a mismatch in the edge's first
    page) and how many of its tokens match (whole pages, ``0 < m < len(partial.key)``).
    Tokens compare with ``==``: ``tokens`` and the node keys are both packed (``array('q')``)
    or both lists of EAGLE bigram pairs (``urc.key``); ``len(tokens)`` is a multiple of
    ``page_size``.
    """
    nodes: list[TreeNode] = []
    n = len(tokens)
    if ck is None and pos < n:
        ck = page_key(tokens, pos, page_size)
    while pos < n:
        child = node.children.get(ck)
        if child is None:
            break
        edge = child.key
        klen = len(edge)
        if tokens[pos : pos + klen] == edge:  # one C-level comparison in the usual case
            nodes.append(child)
            node = child
            pos += klen
            if pos < n:
                ck = page_key(tokens, pos, page_size)
            continue
        m = common_len(edge, tokens, pos)
        m -= m % page_size
        return nodes, pos, (child if m else None), m
    return nodes, pos, None, 0


def page_key(tokens: TokenIds, pos: int, page_size: int) -> Any:
    """The child key of a node whose key starts at ``tokens[pos]``: the token itself (page
    1), else the page's bytes (packed keys: one object to hash and compare, and the compiled
    walk compares it with one ``memcmp``) or the tuple of its bigram pairs (EAGLE)."""
    if page_size == 1:
        return tokens[pos]
    page = tokens[pos : pos + page_size]
    return page.tobytes() if type(page) is array or type(page) is memoryview else tuple(page)


def common_len(edge: TokenIds, tokens: TokenIds, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[pos:]`` (any length)."""
    n = min(len(edge), len(tokens) - pos)
    i = 0
    step = _SCAN_STEP
    while i + step <= n and edge[i : i + step] == tokens[pos + i : pos + i + step]:
        i += step
    while i < n and edge[i] == tokens[pos + i]:
        i += 1
    return i


def py_deepest_boundary(path: list[TreeNode], rules: MatchRules) -> int:
    """The deepest ``i`` (0: none) where every rule ``(ct, window)`` accepts ``path[:i]``:
    component ``ct`` holds its device value on ``path[i - 1]`` and on every node above it
    that the last ``window`` tokens up to the end of ``path[i - 1]`` reach (on all of them up
    to the root when the path is shorter).  ``window`` 0: the last node alone (Mamba: a state
    to resume from); the sliding window (SWA: a whole window of KV).  Changes nothing."""
    for i in range(len(path), 0, -1):
        if all([_rule_accepts(path, i, ct, window) for ct, window in rules]):
            return i
    return 0


def _rule_accepts(path: list[TreeNode], i: int, ct: int, window: int) -> bool:
    acc = 0
    for j in range(i - 1, -1, -1):
        node = path[j]
        if node.data[ct].value is None:  # type: ignore[union-attr]
            return False
        acc += node.key_len
        if acc >= window:
            return True
    return True


def py_match_tail(
    path: list[TreeNode], rules: MatchRules, clock: int, with_values: bool
) -> MatchTailResult:
    """A device-only match's hit once walked: ``k`` (the deepest boundary
    :func:`py_deepest_boundary` accepts; ``len(path)`` without rules), ``hit`` (the tokens
    of ``path[:k]``), the clock after stamping ``path[:k]`` root first (one tick each from
    ``clock``: mutates their ``last_access_time``) and, with ``with_values``, their Full
    values in order (``None`` without)."""
    k = py_deepest_boundary(path, rules) if rules else len(path)
    hit = 0
    values: list[Any] | None = [] if with_values else None
    for node in path[:k]:
        clock += 1
        node.last_access_time = clock
        hit += node.key_len
        if values is not None:
            values.append(node.full.value)
    return k, hit, clock, values


def _native() -> tuple[WalkFn, MatchTailFn] | tuple[None, None]:
    try:
        from urc._native._walk import match_tail, walk
    except ImportError:
        return None, None
    return walk, match_tail


_NATIVE, _NATIVE_TAIL = _native()


def native_available() -> bool:
    """Whether the compiled walk (and match tail) was built and imports."""
    return _NATIVE is not None


def select_walk(impl: WalkImpl, packed: bool = True) -> WalkFn:
    """The walk ``impl`` names (``ConfigError`` for ``NATIVE`` when it was not built).  The
    compiled walk reads packed keys only; a tree of EAGLE bigram keys (lists of pairs,
    ``packed`` False) walks with the Python twin whatever ``impl`` says."""
    return choose_impl(impl, _NATIVE if packed else py_walk, py_walk, "urc._native._walk")


def select_match_tail(impl: WalkImpl) -> MatchTailFn:
    """The match tail ``impl`` names (as :func:`select_walk`)."""
    return choose_impl(impl, _NATIVE_TAIL, py_match_tail, "urc._native._walk")


def choose_impl(impl: WalkImpl, native: _T | None, python: _T, module: str) -> _T:
    """``python`` for ``PYTHON``, else ``native`` when it was built (``module``: its name for
    the :class:`~urc.errors.ConfigError` that ``NATIVE`` without it raises)."""
    if impl is WalkImpl.PYTHON:
        return python
    if native is None:
        if impl is WalkImpl.NATIVE:
            raise ConfigError(
                f"walk_impl=NATIVE but {module} is not built "
                "(reinstall with a C compiler and Python headers available)"
            )
        return python
    return native
