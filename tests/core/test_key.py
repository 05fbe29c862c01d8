"""RadixKey: namespaces, page alignment, EAGLE bigrams."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pytest
import torch

from urc import (
    CacheConfig,
    ComponentType,
    InsertParams,
    InvalidInputError,
    MatchPrefixParams,
    RadixKey,
    UnifiedRadixCache,
    build_cache,
)


def test_page_aligned_truncates_to_whole_pages() -> None:
    k = RadixKey(list(range(10)), ("ns",))
    assert len(k.page_aligned(4)) == 8 and k.page_aligned(4).extra_key == ("ns",)
    assert k.page_aligned(1) is k


def test_string_namespace_becomes_a_tuple_and_namespaces_compare() -> None:
    assert RadixKey([1], "a").extra_key == ("a",)
    assert RadixKey([1], ("a", 1)) != RadixKey([1], ("a", 2))
    assert RadixKey([1, 2])[1:] == RadixKey([2])


def test_bigram_view_pairs_consecutive_tokens() -> None:
    k = RadixKey([1, 2, 3, 4], ("x",)).bigram()
    assert k.token_ids == [(1, 2), (2, 3), (3, 4)] and k.is_bigram and k.extra_key == ("x",)
    assert all(type(a) is int and type(b) is int for a, b in k.token_ids)
    assert k.bigram() is k
    assert RadixKey([1]).bigram().token_ids == []


# ---------------------------------------------------------------------- accepted types (issue 33)
def _cache() -> UnifiedRadixCache:
    return build_cache(CacheConfig(kv_size=256))


@pytest.mark.parametrize(
    "make_key",
    [
        lambda ids: ids,
        tuple,
        lambda ids: array("q", ids),
        lambda ids: torch.tensor(ids, dtype=torch.int64),
        lambda ids: torch.tensor(ids, dtype=torch.int32),
        lambda ids: np.array(ids, dtype=np.int64),
    ],
    ids=["list", "tuple", "array_q", "tensor_int64", "tensor_int32", "numpy"],
)
def test_a_key_of_any_accepted_type_is_packed_and_matches_the_same_list_key(make_key: Any) -> None:
    """Every accepted type is packed into one ``array('q')`` (a tensor's elements would be
    0-d tensors, which hash by identity: never a hit): the tree matches them alike."""
    cache = _cache()
    ids = list(range(16))
    key = RadixKey(make_key(ids))
    assert type(key.token_ids) is array and key.token_ids.typecode == "q"
    assert key.token_ids.tolist() == ids
    slots = cache.token_to_kv_pool_allocator.alloc(16)
    cache.insert(InsertParams(key=key, value=slots))
    for probe in (RadixKey(ids), RadixKey(make_key(ids)), RadixKey(torch.arange(16))):
        assert cache.match_prefix(MatchPrefixParams(key=probe)).device_prefix_len == 16
    cache.sanity_check()


def test_a_packed_array_is_kept_without_a_copy() -> None:
    ids = array("q", [1, 2, 3])
    assert RadixKey(ids).token_ids is ids
    view = memoryview(ids)[1:]
    assert RadixKey(view).token_ids is view  # a contiguous view of int64s too


@pytest.mark.parametrize(
    "view",
    [memoryview(array("q", [1, 2, 3, 4]))[::2], memoryview(array("i", [1, 3]))],
    ids=["strided", "int32"],
)
def test_other_integer_views_are_packed(view: memoryview) -> None:
    key = RadixKey(view)
    assert type(key.token_ids) is array and key.token_ids.tolist() == [1, 3]


@pytest.mark.parametrize(
    "view",
    [
        memoryview(array("d", [1.0])),
        memoryview(array("q", [1, 2, 3, 4])).cast("B").cast("q", (2, 2)),
    ],
    ids=["floats", "2-d"],
)
def test_views_that_are_not_token_ids_are_a_typed_error(view: memoryview) -> None:
    with pytest.raises(InvalidInputError):
        RadixKey(view)


@pytest.mark.parametrize(
    "ids", [[1, 2.5], ["a"], [None], [1 << 63], [-(1 << 63) - 1], array("Q", [1 << 63])], ids=repr
)
def test_ids_that_are_not_int64_are_a_typed_error(ids: Any) -> None:
    with pytest.raises(InvalidInputError, match="int64"):
        RadixKey(ids)


def test_the_compiled_packer_packs_what_the_python_one_packs() -> None:
    """Ints and int subclasses (bools, numpy ints through ``__index__``), both int64 ends."""
    from urc.key import _packer, _python_pack

    pack = _packer()
    for ids in ([], [0, -1, (1 << 63) - 1, -(1 << 63)], [True, np.int64(7), 3], (5, 6)):
        assert pack(ids) == _python_pack(ids), ids


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "abc",
        b"abc",
        5,
        {1: 2},
        torch.zeros(2, 2, dtype=torch.int64),
        torch.tensor(3),
        torch.zeros(3),
        torch.zeros(3, dtype=torch.bool),
        array("d", [1.0]),
        np.zeros(3),
    ],
    ids=lambda b: type(b).__name__ + (f"_{b.dtype}_{b.dim()}d" if torch.is_tensor(b) else ""),
)
def test_a_key_of_another_type_is_a_typed_error(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="RadixKey token ids"):
        RadixKey(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [None, "abc", [1, 2, 3], (1, 2)])
def test_insert_and_match_refuse_a_key_that_is_not_a_radix_key(bad: object) -> None:
    cache = _cache()
    slots = cache.token_to_kv_pool_allocator.alloc(3)
    with pytest.raises(InvalidInputError):
        cache.insert(InsertParams(key=bad, value=slots))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        cache.match_prefix(MatchPrefixParams(key=bad))  # type: ignore[arg-type]
    cache.sanity_check()
    cache.check_pools({ComponentType.FULL: 3})


def test_eagle_bigram_keys_accept_tensors_too() -> None:
    cache = build_cache(CacheConfig(kv_size=256, is_eagle=True))
    ids = list(range(9))
    slots = cache.token_to_kv_pool_allocator.alloc(8)
    cache.insert(InsertParams(key=RadixKey(torch.tensor(ids)), value=slots))
    hit = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))
    assert hit.device_prefix_len == 8
    cache.sanity_check()


@pytest.mark.parametrize("view", [False, True], ids=["array", "view"])
@pytest.mark.parametrize("ps", [1, 4])
def test_node_keys_are_packed_copies_the_caller_may_reuse(ps: int, view: bool) -> None:
    """The tree keeps packed slices of its own: a caller that refills its ``array('q')``
    after an insert (a server reusing a request buffer) changes nothing in the tree, whether
    it passed the array or a view of it (``view``: what ``Req.fill_prefix`` hands out)."""
    cache = build_cache(CacheConfig(kv_size=256, page_size=ps))
    ids = array("q", range(100, 100 + 8 * ps))
    key = RadixKey(memoryview(ids) if view else ids)
    assert (type(key.token_ids) is memoryview) is view
    cache.insert(InsertParams(key=key, value=cache.token_to_kv_pool_allocator.alloc(8 * ps)))
    split = array("q", [*range(100, 100 + 4 * ps), *range(900, 900 + 4 * ps)])
    key = RadixKey(memoryview(split)[:] if view else split)
    cache.insert(InsertParams(key=key, value=cache.token_to_kv_pool_allocator.alloc(8 * ps)))
    for i in range(len(ids)):
        ids[i] = split[i] = -1
    nodes = list(cache.iter_nodes())
    assert len(nodes) == 3 and all(type(n.key) is array and n.key.typecode == "q" for n in nodes)
    hit = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(range(100, 100 + 8 * ps)))))
    assert hit.device_prefix_len == 8 * ps
    cache.sanity_check()
