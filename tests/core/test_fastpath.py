"""The compiled tree walk and its pure-Python twin (``urc.fastpath``) behave identically.

Two levels: the walk functions themselves on random trees of packed keys (``array('q')``:
big, negative and small ids, namespaces, wide nodes) and what they reject; and whole caches,
one per implementation, driven through the same random operation sequences (inserts,
matches, locks, evictions, request caching) for every component set and page sizes 1 and 4,
compared after every step:
results, every size counter and the whole tree (keys, values, locks, stamps, hit counts).
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lockstep_harness import LOCKSTEP_SETTINGS, SETS, Lockstep, Side
from test_cache_properties import ops

from urc import (
    CacheConfig,
    ComponentType,
    InsertParams,
    RadixKey,
    TreeNode,
    build_cache,
)
from urc.cache import UnifiedRadixCache
from urc.errors import ConfigError
from urc.fastpath import (
    WalkImpl,
    native_available,
    py_deepest_boundary,
    py_match_tail,
    py_walk,
    select_match_tail,
    select_walk,
)
from urc.matching import _deepest_boundary

needs_native = pytest.mark.skipif(not native_available(), reason="urc._native._walk not built")


def test_python_choice_is_the_twin_and_auto_prefers_the_compiled_walk() -> None:
    assert select_walk(WalkImpl.PYTHON) is py_walk
    # EAGLE bigram keys are lists of pairs: the compiled walk reads packed keys only.
    assert select_walk(WalkImpl.AUTO, packed=False) is py_walk
    assert select_match_tail(WalkImpl.PYTHON) is py_match_tail
    auto = select_walk(WalkImpl.AUTO)
    assert (auto is not py_walk) == native_available()
    assert (select_match_tail(WalkImpl.AUTO) is not py_match_tail) == native_available()


def test_native_choice_without_the_extension_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import urc.fastpath as fp

    monkeypatch.setattr(fp, "_NATIVE", None)
    monkeypatch.setattr(fp, "_NATIVE_TAIL", None)
    with pytest.raises(ConfigError, match="not built"):
        select_walk(WalkImpl.NATIVE)
    with pytest.raises(ConfigError, match="not built"):
        select_match_tail(WalkImpl.NATIVE)
    assert select_walk(WalkImpl.AUTO) is py_walk
    assert select_match_tail(WalkImpl.AUTO) is py_match_tail


# ---------------------------------------------------------------- the walk functions
def _token(kind: str, v: int) -> int:
    if kind == "big":
        return (1 << 62) + (v << 20)  # high bits differ, low bytes alike
    if kind == "neg":
        return -v - 1
    return v + 1000


def _packed(tokens: list[int]) -> array[int]:
    return array("q", tokens)


_blocks = st.lists(st.integers(0, 3), min_size=1, max_size=6)


def _python_walk_cache(ps: int, kv_size: int) -> UnifiedRadixCache:
    return build_cache(
        CacheConfig(
            page_size=ps,
            kv_size=kv_size,
            max_num_reqs=1,
            max_context_len=8,
            walk_impl=WalkImpl.PYTHON,
        )
    )


def _assert_walks_agree(
    native: Any, node: TreeNode, first: Any, toks: list[Any], pos: int, ps: int
) -> None:
    a = py_walk(node, first, toks, pos, ps)
    b = native(node, first, toks, pos, ps)
    assert a[0] == b[0] and a[1:] == b[1:], (a, b)


@needs_native
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("kind", ["int", "big", "neg"])
@settings(max_examples=25, deadline=None)
@given(
    stored=st.lists(_blocks, min_size=1, max_size=6),
    queries=st.lists(st.tuples(_blocks, st.integers(0, 3)), min_size=1, max_size=6),
)
def test_native_walk_returns_what_the_python_walk_returns(
    ps: int, kind: str, stored: list[list[int]], queries: list[tuple[list[int], int]]
) -> None:
    native = select_walk(WalkImpl.NATIVE)
    cache = _python_walk_cache(ps, 64 * ps)

    def key(blocks: list[int], cut: int = 0) -> array[int]:
        toks = [_token(kind, b * 16 + i) for b in blocks for i in range(ps)]
        # ``cut``: the last page diverges inside it (a partial match of that page).
        if cut and toks:
            toks[-1 - (cut - 1) % ps] = _token(kind, 999)
        return _packed(toks)

    for i, blocks in enumerate(stored):
        toks = key(blocks)
        value = cache.token_to_kv_pool_allocator.alloc(len(toks))
        if value is None:
            break
        # Every other key also in a namespace: the root then holds children whose first page
        # is not their child key.
        extra = ("tenant", 1) if i % 2 else None
        cache.insert(InsertParams(key=RadixKey(toks, extra), value=value))
    for blocks, cut in queries:
        toks = key(blocks, cut)
        ck = cache.tree.root_child_key(toks, None)
        for pos in range(0, len(toks), ps):
            # ``None``: the walk takes the page key at ``pos`` itself.
            for first in (ck, None):
                _assert_walks_agree(native, cache.root, first, toks, pos, ps)
            ck = cache.tree.page_key(toks, pos)
        for node in cache.iter_nodes():  # from below the root: later lookups may scan
            _assert_walks_agree(native, node, None, toks, 0, ps)


@needs_native
@pytest.mark.parametrize("ps", [1, 4])
@settings(max_examples=25, deadline=None)
@given(
    stored=st.lists(_blocks, min_size=1, max_size=24),
    queries=st.lists(st.tuples(_blocks, st.integers(0, 3)), min_size=1, max_size=6),
)
def test_native_walk_agrees_past_sixteen_children_and_under_namespaces(
    ps: int, stored: list[list[int]], queries: list[tuple[list[int], int]]
) -> None:
    """Up to 16 children the compiled walk scans the child keys' ints instead of building
    the page's key (skipping namespaced root keys); past that it builds the key and looks it
    up: both ways find what the twin finds."""
    native = select_walk(WalkImpl.NATIVE)
    cache = _python_walk_cache(ps, 512 * ps)

    def key(blocks: list[int]) -> list[int]:
        return [1000 + b * 16 + i for b in blocks for i in range(ps)]

    wide = [[0, b] for b in range(20)]  # > 16 children below one node
    for i, blocks in enumerate([*stored, *([b] for b in range(20)), *wide]):
        toks = key(blocks)
        value = cache.token_to_kv_pool_allocator.alloc(len(toks))
        if value is None:
            break
        extra = ("tenant", 1) if i % 3 == 1 else None
        cache.insert(InsertParams(key=RadixKey(toks, extra), value=value))
    for blocks, cut in [*queries, ([0, 19], 0), ([0, 7, 1], 2)]:
        ids = key(blocks)
        if cut and ids:
            ids[-1 - (cut - 1) % ps] = 5_000_000  # diverge inside the last page
        toks = _packed(ids)
        for first in (None, cache.tree.root_child_key(toks, None)):
            _assert_walks_agree(native, cache.root, first, toks, 0, ps)
        for node in cache.iter_nodes():
            _assert_walks_agree(native, node, None, toks, 0, ps)


@needs_native
@pytest.mark.parametrize(
    "tokens", [[1, 2], (1, 2), array("i", [1, 2]), array("d", [1.0, 2.0])], ids=repr
)
def test_native_walk_rejects_unpacked_tokens_with_a_type_error(tokens: Any) -> None:
    """Only an ``array('q')`` is a packed key: anything else is a TypeError, not a
    misread buffer."""
    cache = build_cache(CacheConfig(kv_size=64, max_num_reqs=1, max_context_len=8))
    cache.insert(
        InsertParams(key=RadixKey([1, 2]), value=cache.token_to_kv_pool_allocator.alloc(2))
    )
    native = select_walk(WalkImpl.NATIVE)
    with pytest.raises(TypeError, match="array"):
        native(cache.root, 1, tokens, 0, 1)


@needs_native
def test_native_walk_rejects_a_node_key_that_is_not_packed() -> None:
    native = select_walk(WalkImpl.NATIVE)
    root = TreeNode(_packed([]), None, (None, None, None), None, 0)
    root.children[1] = TreeNode([1, 2], root, (None, None, None), None, 0)
    with pytest.raises(TypeError, match=r"node\.key must be an array"):
        native(root, 1, _packed([1, 2]), 0, 1)


@needs_native
def test_native_walk_reads_other_node_types_through_their_attributes() -> None:
    """The compiled walk reads ``children`` and ``key`` of TreeNode slots directly; any other
    node type (here a plain class, and a TreeNode subclass) is read like Python reads it,
    also when the types alternate."""

    class Plain:
        def __init__(self, key: list[int]) -> None:
            self.key = _packed(key)
            self.children: dict[int, Any] = {}

    class Sub(TreeNode):
        __slots__ = ("extra",)

    native = select_walk(WalkImpl.NATIVE)
    cache = build_cache(CacheConfig(kv_size=64, max_num_reqs=1, max_context_len=8))
    value = cache.token_to_kv_pool_allocator.alloc(3)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=value))
    proot, pa = Plain([]), Plain([1, 2])
    proot.children[1] = pa
    pa.children[3] = Plain([3, 4])
    sroot = Sub(_packed([]), None, (None, None, None), None, 0)
    sroot.children[1] = Sub(_packed([1, 2, 3]), sroot, (None, None, None), None, 0)
    for _ in range(2):
        for root in (cache.root, proot, sroot, cache.root):
            for q in map(_packed, ([1, 2, 3, 4], [1, 2, 9], [1, 2])):
                a = py_walk(root, 1, q, 0, 1)  # type: ignore[arg-type]
                b = native(root, 1, q, 0, 1)  # type: ignore[arg-type]
                assert a[0] == b[0] and a[1:] == b[1:], (a, b)


# ---------------------------------------------------------------- whole caches in lockstep
impl = WalkImpl.NATIVE if native_available() else WalkImpl.PYTHON


@needs_native
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("components", SETS, ids=lambda s: "+".join(c.name for c in s))
@LOCKSTEP_SETTINGS
@given(ops=ops)  # the FULL property test's programs, on every component set
def test_python_and_native_caches_agree_after_every_step(
    ps: int, components: tuple[ComponentType, ...], ops: list[tuple[Any, ...]]
) -> None:
    m = Lockstep(components, ps, (Side(WalkImpl.PYTHON), Side(impl)))
    for op in ops:
        m.run(op)
    for c in m.caches:
        c.sanity_check()


@needs_native
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("components", SETS, ids=lambda s: "+".join(c.name for c in s))
@LOCKSTEP_SETTINGS
@given(ops=ops)
def test_match_tail_twins_and_component_validators_agree_on_every_path(
    ps: int, components: tuple[ComponentType, ...], ops: list[tuple[Any, ...]]
) -> None:
    """On every root-to-node path of random caches (tombstones included): the window
    rules' deepest boundary is the validators' (``deepest_boundary``), and both match
    tails find it, stamp the same nodes alike and gather the same value tensors."""
    m = Lockstep(components, ps, (Side(WalkImpl.PYTHON), Side(WalkImpl.PYTHON)))
    for op in ops:
        m.run(op)
    cache = m.caches[0]
    rules = cache.hooks.match_rules
    assert rules is not None
    native = select_match_tail(WalkImpl.NATIVE)
    for node in cache.iter_nodes():
        path = cache.tree.path_to(node)
        k = py_deepest_boundary(path, rules) if rules else len(path)
        assert k == _deepest_boundary(cache, path, True), [n.id for n in path]
        stamps = [n.last_access_time for n in path]
        tails = []
        for tail in (py_match_tail, native):
            for with_values in (True, False):
                for n, t in zip(path, stamps, strict=True):
                    n.last_access_time = t
                got = tail(path, rules, 1000, with_values)
                tails.append((got, [n.last_access_time for n in path]))
        (a, sa), (a2, _), (b, sb), (b2, _) = tails
        assert a[0] == k and a[:3] == b[:3] == a2[:3] == b2[:3] and sa == sb
        assert a[1] == sum(n.key_len for n in path[:k]) and a[2] == 1000 + k
        assert a2[3] is None and b2[3] is None
        held = [id(n.full.value) for n in path[:k]]
        assert [id(v) for v in a[3]] == [id(v) for v in b[3]] == held
        assert sa == [1001 + i if i < k else t for i, t in enumerate(stamps)]
        for n, t in zip(path, stamps, strict=True):
            n.last_access_time = t
    cache.sanity_check()


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("components", SETS[1:], ids=lambda s: "+".join(c.name for c in s))
@LOCKSTEP_SETTINGS
@given(ops=ops)
def test_window_rules_and_validators_run_the_same_matches(
    ps: int, components: tuple[ComponentType, ...], ops: list[tuple[Any, ...]]
) -> None:
    """A cache whose matches find their hit by the window rules and one whose matches ask
    the validators stay equal after every step."""
    m = Lockstep(components, ps, (Side(impl), Side(impl, window_rules=False)))
    for op in ops:
        m.run(op)
    for c in m.caches:
        c.sanity_check()


def test_match_tail_rejects_malformed_rules() -> None:
    cache = build_cache(CacheConfig(kv_size=64, max_num_reqs=1, max_context_len=8))
    tails = [py_match_tail] + ([select_match_tail(WalkImpl.NATIVE)] if native_available() else [])
    for tail in tails:
        with pytest.raises((TypeError, ValueError)):
            tail([cache.root], ((0,),), 0, True)  # type: ignore[arg-type]
