"""The tree walk of match and insert: a compiled implementation and its pure-Python twin.

:func:`py_walk` is the reference; ``urc._native._walk.walk`` (built from
``urc/_native/walk.c`` when a C compiler is there at install time) computes exactly the same
result without building a list slice per node or comparing tokens through the interpreter.
Which one a cache uses is :attr:`urc.config.CacheConfig.walk_impl` (:class:`WalkImpl`):
``AUTO`` takes the compiled one when it was built, ``PYTHON`` always the twin.  Both are
read-only and behave identically (the suite runs the same operation sequences on both and
compares them step by step), so the choice only changes speed.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from urc.errors import ConfigError

if TYPE_CHECKING:
    from urc.tree import TreeNode

__all__ = [
    "WalkFn",
    "WalkImpl",
    "WalkResult",
    "choose_impl",
    "common_len",
    "native_available",
    "py_walk",
    "select_walk",
]

#: ``(nodes, pos, partial, m)``: see :func:`py_walk`.
WalkResult = tuple["list[TreeNode]", int, "TreeNode | None", int]
WalkFn = Callable[["TreeNode", Any, list[Any], int, int], WalkResult]

_T = TypeVar("_T")

# Compare this many tokens per C-level slice comparison when locating a mismatch.
_SCAN_STEP = 64


class WalkImpl(Enum):
    """Which implementation of :func:`py_walk` a cache runs."""

    AUTO = "auto"  # the compiled one when it was built, else the Python twin
    NATIVE = "native"  # the compiled one (ConfigError when it was not built)
    PYTHON = "python"  # the pure-Python twin


def py_walk(node: TreeNode, ck: Any, tokens: list[Any], pos: int, page_size: int) -> WalkResult:
    """Follow ``tokens[pos:]`` down from ``node``; changes nothing.

    The first child is looked up under ``ck`` (the caller knows the root's namespaced key;
    ``None``: the page key at ``pos``, as for every later one), each later one under
    ``tokens[pos]`` (page 1) or the tuple of the next page.  Returns
    ``(nodes, pos, partial, m)``: the children whose whole edge matched, in order; the
    position after them; the child where the match ends inside its edge (``None`` when the
    walk ended at a node boundary, at a missing child or at a mismatch in the edge's first
    page) and how many of its tokens match (whole pages, ``0 < m < len(partial.key)``).
    Tokens compare with ``==``; ``len(tokens)`` is a multiple of ``page_size``.
    """
    nodes: list[TreeNode] = []
    n = len(tokens)
    if ck is None and pos < n:
        ck = tokens[pos] if page_size == 1 else tuple(tokens[pos : pos + page_size])
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
                ck = tokens[pos] if page_size == 1 else tuple(tokens[pos : pos + page_size])
            continue
        m = common_len(edge, tokens, pos)
        m -= m % page_size
        return nodes, pos, (child if m else None), m
    return nodes, pos, None, 0


def common_len(edge: list[Any], tokens: list[Any], pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[pos:]`` (any length)."""
    n = min(len(edge), len(tokens) - pos)
    i = 0
    step = _SCAN_STEP
    while i + step <= n and edge[i : i + step] == tokens[pos + i : pos + i + step]:
        i += step
    while i < n and edge[i] == tokens[pos + i]:
        i += 1
    return i


def _native() -> WalkFn | None:
    try:
        from urc._native._walk import walk
    except ImportError:
        return None
    return walk  # type: ignore[no-any-return]


_NATIVE = _native()


def native_available() -> bool:
    """Whether the compiled walk was built and imports."""
    return _NATIVE is not None


def select_walk(impl: WalkImpl) -> WalkFn:
    """The walk ``impl`` names (:class:`~urc.errors.ConfigError` for ``NATIVE`` when the
    extension is absent)."""
    return choose_impl(impl, _NATIVE, py_walk, "urc._native._walk")


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
