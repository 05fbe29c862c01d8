"""RadixKey: namespaces, page alignment, EAGLE bigrams."""

from __future__ import annotations

from urc import RadixKey


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
    assert k.bigram() is k
    assert RadixKey([1]).bigram().token_ids == []
