"""Ideal prefix-cache hit-rate oracles: hand-computed cases, cross-checks, the real trace."""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_paths import conversation_trace, requires_conversation_trace

from urc.apps.workloads import (
    BlockPrefixOracle,
    MooncakeRecord,
    TokenPrefixOracle,
    TraceRequest,
    expand_hash_ids,
    ideal_block_hits,
    ideal_token_hits,
    iter_mooncake_records,
)

REAL_TRACE = conversation_trace()


def _record(hash_ids: tuple[int, ...], input_length: int) -> MooncakeRecord:
    return MooncakeRecord(0, 0, input_length, 0, hash_ids)


# block_size 4. Expected hits worked out by hand, per page size:
#   ids      len  reasoning                                           p=1  p=2  p=4
#   1 2 3    10   nothing seen yet                                      0    0    0
#   1 2 4    12   chains (1), (1,2) seen; (1,2,4) new                   8    8    8
#   1 2 3    11   (1,2,3) seen, but only 2 tokens of block 3 cached    10   10    8
#   2 1       5   block 2 was seen, but never as a first block          0    0    0
#   1 2 3    12   block 3 now cached with 3 tokens                     11   10    8
#   1         3   3 of block 1's tokens                                 3    2    0
HAND_TRACE = [
    ((1, 2, 3), 10),
    ((1, 2, 4), 12),
    ((1, 2, 3), 11),
    ((2, 1), 5),
    ((1, 2, 3), 12),
    ((1,), 3),
]
HAND_HITS = {1: [0, 8, 10, 0, 11, 3], 2: [0, 8, 10, 0, 10, 2], 4: [0, 8, 8, 0, 8, 0]}


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_block_oracle_on_hand_computed_trace(page_size: int) -> None:
    oracle = BlockPrefixOracle(block_size=4, page_size=page_size)
    hits = [oracle.observe(ids, length) for ids, length in HAND_TRACE]
    assert hits == HAND_HITS[page_size]

    stats = ideal_block_hits(
        [_record(ids, length) for ids, length in HAND_TRACE], block_size=4, page_size=page_size
    )
    assert (stats.requests, stats.input_tokens) == (6, 53)
    assert stats.hit_tokens == {1: 32, 2: 30, 4: 24}[page_size]
    assert stats.hit_rate == pytest.approx(stats.hit_tokens / 53)


def _request(
    index: int, tokens: tuple[int, ...], namespace: tuple[str, ...] | None = None
) -> TraceRequest:
    return TraceRequest(index, index, tokens, 1, len(tokens), namespace)


def test_token_oracle_on_hand_computed_sequences() -> None:
    sequences = [(1, 2, 3, 4), (1, 2, 3, 5), (1, 2), (9,), (1, 2, 3, 4, 5, 6)]
    # page 1: longest common prefix with any earlier sequence: 0, 3, 2, 0, 4 -> 9 of 17
    # page 2: whole pages only: (1,2) | (1,2) | none | (1,2)(3,4) -> 0, 2, 2, 0, 4 -> 8 of 17
    oracle = TokenPrefixOracle(page_size=1)
    assert [oracle.observe(s) for s in sequences] == [0, 3, 2, 0, 4]
    oracle = TokenPrefixOracle(page_size=2)
    assert [oracle.observe(s) for s in sequences] == [0, 2, 2, 0, 4]
    requests = [_request(i, s) for i, s in enumerate(sequences)]
    assert ideal_token_hits(requests, page_size=1).hit_tokens == 9
    stats = ideal_token_hits(requests, page_size=2)
    assert (stats.requests, stats.input_tokens, stats.hit_tokens) == (5, 17, 8)


def test_token_oracle_keeps_namespaces_apart() -> None:
    requests = [
        _request(0, (1, 2, 3), ("a",)),
        _request(1, (1, 2, 3), ("b",)),
        _request(2, (1, 2, 3), None),
        _request(3, (1, 2, 3), ("a",)),
    ]
    assert ideal_token_hits(requests).hit_tokens == 3


def test_oracles_reject_bad_arguments() -> None:
    with pytest.raises(ValueError):
        TokenPrefixOracle(page_size=0)
    with pytest.raises(ValueError):
        BlockPrefixOracle(block_size=512, page_size=48)
    with pytest.raises(ValueError):
        BlockPrefixOracle(block_size=4).observe((1, 2), 4)
    synthetic = TraceRequest(0, 0, (1, 2), 1, 2)
    with pytest.raises(ValueError):
        ideal_block_hits([synthetic])
    assert ideal_token_hits([]).hit_rate == 0.0


BLOCK = 4


@st.composite
def _traces(draw: st.DrawFn) -> list[tuple[tuple[int, ...], int]]:
    trace = []
    for _ in range(draw(st.integers(1, 12))):
        ids = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=5)))
        last = draw(st.integers(1, BLOCK))
        trace.append((ids, (len(ids) - 1) * BLOCK + last))
    return trace


@settings(max_examples=200, deadline=None)
@given(trace=_traces(), page_size=st.sampled_from([1, 2, 4]))
def test_block_oracle_equals_token_oracle_on_expanded_tokens(
    trace: list[tuple[tuple[int, ...], int]], page_size: int
) -> None:
    # The two oracles are independent ways of computing the same number, per request.
    blocks = BlockPrefixOracle(block_size=BLOCK, page_size=page_size)
    tokens = TokenPrefixOracle(page_size=page_size)
    for ids, length in trace:
        expanded = expand_hash_ids(ids, length, BLOCK)
        assert blocks.observe(ids, length) == tokens.observe(expanded)


@requires_conversation_trace
def test_ideal_hit_rate_of_real_trace(record_property: Callable[[str, object], None]) -> None:
    records = list(iter_mooncake_records(REAL_TRACE))
    page1 = ideal_block_hits(records, block_size=512, page_size=1)
    page64 = ideal_block_hits(records, block_size=512, page_size=64)
    assert 0.0 < page64.hit_rate <= page1.hit_rate < 1.0
    assert page1.input_tokens == sum(r.input_length for r in records)
    unique_blocks = len({h for r in records for h in r.hash_ids})
    for name, value in [
        ("requests", page1.requests),
        ("input_tokens", page1.input_tokens),
        ("unique_blocks", unique_blocks),
        ("ideal_hit_rate_page1", page1.hit_rate),
        ("ideal_hit_rate_page64", page64.hit_rate),
    ]:
        record_property(name, value)
    print(
        f"conversation trace: {page1.requests} requests, {page1.input_tokens} input tokens, "
        f"{unique_blocks} unique blocks; ideal hit rate {page1.hit_rate:.4f} (page 1), "
        f"{page64.hit_rate:.4f} (page 64)"
    )

    # Cross-check on a prefix of the trace: the token oracle over expanded tokens agrees.
    head = list(islice(records, 400))
    token_oracle = TokenPrefixOracle(page_size=64)
    expected = ideal_block_hits(head, block_size=512, page_size=64).hit_tokens
    got = sum(token_oracle.observe(expand_hash_ids(r.hash_ids, r.input_length, 512)) for r in head)
    assert got == expected
