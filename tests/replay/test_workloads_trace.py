"""Mooncake trace reader: parsing, validation, ordering, token expansion and streaming."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from contextlib import aclosing
from pathlib import Path

import pytest
from trace_paths import conversation_trace, requires_conversation_trace

from urc.apps.workloads import (
    TOKEN_ID_LIMIT,
    VOCAB_SIZE,
    TraceFormatError,
    TraceOrderError,
    aiter_mooncake_records,
    aiter_mooncake_trace,
    block_start_token,
    expand_hash_ids,
    iter_mooncake_records,
    iter_mooncake_trace,
)


def _line(timestamp: int, input_length: int, output_length: int, hash_ids: list[int]) -> str:
    return json.dumps(
        {
            "timestamp": timestamp,
            "input_length": input_length,
            "output_length": output_length,
            "hash_ids": hash_ids,
        }
    )


def _write(tmp_path: Path, lines: list[str], *, newline: str = "\n", final: bool = True) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_bytes((newline.join(lines) + (newline if final else "")).encode())
    return path


# Handwritten: blank lines (empty and whitespace), a partial last block, a shared first block.
HANDWRITTEN = [
    _line(0, 1024, 10, [7, 8]),
    "",
    _line(5, 1100, 20, [7, 8, 9]),  # last block holds 1100 - 2*512 = 76 tokens
    "   ",
    _line(5, 300, 0, [7]),  # a partial block of the same id as a full one
    _line(9, 512, 3, [11]),
]


def test_parses_handwritten_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, HANDWRITTEN)
    records = list(iter_mooncake_records(path))
    assert [r.line_number for r in records] == [1, 3, 5, 6]
    assert [r.timestamp_ms for r in records] == [0, 5, 5, 9]
    assert [r.hash_ids for r in records] == [(7, 8), (7, 8, 9), (7,), (11,)]

    requests = list(iter_mooncake_trace(path, namespace=("tenant-a",)))
    assert [r.index for r in requests] == [0, 1, 2, 3]
    assert [r.input_length for r in requests] == [1024, 1100, 300, 512]
    assert [len(r.input_ids) for r in requests] == [1024, 1100, 300, 512]
    assert [r.output_length for r in requests] == [10, 20, 0, 3]
    assert all(r.namespace == ("tenant-a",) for r in requests)
    first, second, partial, other = requests
    # Equal hash-id chains give equal tokens; the partial block is a prefix of the full one.
    assert second.input_ids[:1024] == first.input_ids
    assert partial.input_ids == first.input_ids[:300]
    # A different id gives a different block, differing from its very first token.
    assert other.input_ids[0] != first.input_ids[0]
    assert second.input_ids[1024] not in (first.input_ids[0], first.input_ids[512])


def test_small_block_size_and_file_edge_cases(tmp_path: Path) -> None:
    # CRLF endings and no trailing newline are both accepted.
    lines = [_line(1, 6, 1, [3, 4]), _line(2, 4, 1, [3])]
    path = _write(tmp_path, lines, newline="\r\n", final=False)
    requests = list(iter_mooncake_trace(path, block_size=4))
    assert [r.input_ids for r in requests] == [
        tuple(expand_hash_ids((3, 4), 6, 4)),
        tuple(expand_hash_ids((3,), 4, 4)),
    ]
    assert requests[1].input_ids == requests[0].input_ids[:4]
    start = block_start_token(3)
    assert requests[1].input_ids == (
        start,
        *range((start + 1) % VOCAB_SIZE, (start + 4) % VOCAB_SIZE),
    )


def test_empty_file_and_empty_prompt(tmp_path: Path) -> None:
    assert list(iter_mooncake_trace(_write(tmp_path, []))) == []
    (request,) = iter_mooncake_trace(_write(tmp_path, [_line(0, 0, 5, [])]))
    assert request.input_ids == ()
    assert request.hash_ids == ()


MALFORMED = [
    pytest.param("{not json", None, "invalid JSON", id="bad-json"),
    pytest.param("[1, 2]", None, "JSON object", id="not-object"),
    pytest.param(
        '{"input_length": 1, "output_length": 1, "hash_ids": [1]}',
        "timestamp",
        "missing",
        id="missing-timestamp",
    ),
    pytest.param(
        '{"timestamp": "3", "input_length": 1, "output_length": 1, "hash_ids": [1]}',
        "timestamp",
        "integer",
        id="string-timestamp",
    ),
    pytest.param(
        '{"timestamp": 3, "input_length": 1.5, "output_length": 1, "hash_ids": [1]}',
        "input_length",
        "integer",
        id="float-length",
    ),
    pytest.param(
        '{"timestamp": 3, "input_length": true, "output_length": 1, "hash_ids": [1]}',
        "input_length",
        "integer",
        id="bool-length",
    ),
    pytest.param(
        '{"timestamp": 3, "input_length": -1, "output_length": 1, "hash_ids": []}',
        "input_length",
        ">= 0",
        id="negative-input",
    ),
    pytest.param(
        '{"timestamp": 3, "input_length": 1, "output_length": -2, "hash_ids": [1]}',
        "output_length",
        ">= 0",
        id="negative-output",
    ),
    pytest.param(
        '{"timestamp": 3, "input_length": 1, "output_length": 1}',
        "hash_ids",
        "missing",
        id="missing-hash-ids",
    ),
    pytest.param(
        '{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": 1}',
        "hash_ids",
        "list",
        id="hash-ids-not-list",
    ),
    pytest.param(
        '{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [-1]}',
        "hash_ids",
        "item 0",
        id="negative-hash-id",
    ),
    pytest.param(
        '{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}',
        "hash_ids",
        "item 0",
        id="string-hash-id",
    ),
    pytest.param(_line(3, 1025, 1, [1, 2]), "hash_ids", "needs 3 blocks", id="too-few-ids"),
    pytest.param(_line(3, 1024, 1, [1, 2, 3]), "hash_ids", "needs 2 blocks", id="too-many-ids"),
    pytest.param(_line(3, 0, 1, [1]), "hash_ids", "needs 0 blocks", id="ids-for-empty"),
]


@pytest.mark.parametrize(("bad", "field", "message"), MALFORMED)
def test_malformed_line_raises_typed_error(
    tmp_path: Path, bad: str, field: str | None, message: str
) -> None:
    path = _write(tmp_path, [_line(0, 10, 1, [1]), "", bad, _line(9, 10, 1, [1])])
    with pytest.raises(TraceFormatError) as info:
        list(iter_mooncake_trace(path))
    assert info.value.line_number == 3
    assert info.value.path == str(path)
    assert info.value.field == field
    assert message in str(info.value)
    assert f"{path}:3:" in str(info.value)


@pytest.mark.asyncio
@pytest.mark.parametrize(("bad", "field", "message"), MALFORMED[:3])
async def test_malformed_line_raises_typed_error_async(
    tmp_path: Path, bad: str, field: str | None, message: str
) -> None:
    path = _write(tmp_path, [_line(0, 10, 1, [1]), bad])
    seen = []
    with pytest.raises(TraceFormatError) as info:
        async for request in aiter_mooncake_trace(path):
            seen.append(request)
    assert len(seen) == 1  # the good line before the bad one was yielded first
    assert (info.value.line_number, info.value.field) == (2, field)
    assert message in str(info.value)


def test_out_of_order_timestamp_raises(tmp_path: Path) -> None:
    lines = [_line(10, 5, 1, [1]), _line(10, 5, 1, [1]), "", _line(9, 5, 1, [1])]
    path = _write(tmp_path, lines)
    reader = iter_mooncake_trace(path)
    assert [r.timestamp_ms for r in (next(reader), next(reader))] == [10, 10]  # ties are fine
    with pytest.raises(TraceOrderError) as info:
        next(reader)
    assert (info.value.line_number, info.value.field) == (4, "timestamp")
    assert isinstance(info.value, TraceFormatError)


def test_distinct_hash_ids_give_distinct_first_tokens() -> None:
    ids = range(300_000)
    starts = {block_start_token(h) for h in ids}
    assert len(starts) == len(ids)
    assert all(0 <= s < TOKEN_ID_LIMIT for s in starts)
    # ids past 2**31 are folded in, deterministically
    big = 1 << 40
    assert block_start_token(big) == block_start_token(big)
    assert block_start_token(big) != block_start_token(big + 1)
    with pytest.raises(ValueError):
        block_start_token(-1)


def _id_with_start(target: int) -> int:
    # Invert block_start_token's bijection (each step is invertible modulo 2**31).
    mask = TOKEN_ID_LIMIT - 1
    x = target
    x ^= (x >> 13) ^ (x >> 26)
    x = (x * pow(0x6C8E9CF5, -1, TOKEN_ID_LIMIT)) & mask
    x ^= x >> 16
    x = ((x - 0x1B873593) * pow(0x2545F491, -1, TOKEN_ID_LIMIT)) & mask
    assert block_start_token(x) == target
    return x


def test_block_after_its_first_token_wraps_around_the_shared_vocabulary() -> None:
    hash_id = _id_with_start(VOCAB_SIZE - 3)
    tokens = expand_hash_ids((hash_id,), 6, 512)
    assert tokens == [VOCAB_SIZE - 3, VOCAB_SIZE - 2, VOCAB_SIZE - 1, 0, 1, 2]
    long = expand_hash_ids((hash_id,), 3 * VOCAB_SIZE, 3 * VOCAB_SIZE)
    assert len(long) == 3 * VOCAB_SIZE
    assert long[1:] == [(VOCAB_SIZE - 2 + i) % VOCAB_SIZE for i in range(3 * VOCAB_SIZE - 1)]


def test_expanded_tokens_are_shared_int_objects_across_requests() -> None:
    """Two requests over the same block hold the same int objects after its first token
    (the tree then stores one pointer a token and compares by identity)."""
    a = expand_hash_ids((7, 8), 1024, 512)
    b = expand_hash_ids((7, 8), 1024, 512)
    assert a == b
    assert all(x is y for x, y in zip(a[1:512], b[1:512], strict=True))
    assert all(x is y for x, y in zip(a[513:], b[513:], strict=True))


def test_expand_rejects_inconsistent_lengths() -> None:
    with pytest.raises(ValueError):
        expand_hash_ids((1, 2), 512, 512)
    with pytest.raises(ValueError):
        expand_hash_ids((), 3, 512)


def _generated_trace(tmp_path: Path, count: int) -> Path:
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(count):
            ids = list(range(i, i + 40))
            f.write(_line(i, 40 * 512 - 7, 100, ids) + "\n")
    return path


def test_reads_incrementally_with_bounded_memory(tmp_path: Path) -> None:
    path = _generated_trace(tmp_path, 12_000)
    size = path.stat().st_size
    assert size > 3_000_000
    tracemalloc.start()
    try:
        count = 0
        for record in iter_mooncake_records(path, chunk_bytes=64 * 1024):
            count += 1
            assert len(record.hash_ids) == 40
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 12_000
    assert peak < size / 5  # the file is never held whole


def test_chunk_boundaries_do_not_change_the_result(tmp_path: Path) -> None:
    path = _write(tmp_path, HANDWRITTEN)
    expected = list(iter_mooncake_records(path))
    for chunk_bytes in (1, 7, 64, 1 << 20):
        assert list(iter_mooncake_records(path, chunk_bytes=chunk_bytes)) == expected


def test_yields_before_reading_the_rest(tmp_path: Path) -> None:
    # The tail is garbage; the first request still comes out before the error is seen.
    path = _write(tmp_path, [_line(0, 3, 1, [1]), "x" * 100_000])
    reader = iter_mooncake_records(path, chunk_bytes=64)
    assert next(reader).line_number == 1
    with pytest.raises(TraceFormatError):
        next(reader)


def test_overlong_line_is_a_format_error(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(0, 3, 1, [1]), "x" * 5000], final=False)
    with pytest.raises(TraceFormatError) as info:
        list(iter_mooncake_records(path, chunk_bytes=256, max_line_bytes=1000))
    assert info.value.line_number == 2
    assert info.value.field is None


@pytest.mark.asyncio
async def test_async_reader_matches_sync_reader(tmp_path: Path) -> None:
    path = _generated_trace(tmp_path, 100)
    sync_requests = list(iter_mooncake_trace(path, block_size=512))
    async_requests = [r async for r in aiter_mooncake_trace(path, chunk_bytes=4096)]
    assert async_requests == sync_requests
    records = [r async for r in aiter_mooncake_records(path)]
    assert [r.hash_ids for r in records] == [r.hash_ids for r in sync_requests]


@pytest.mark.asyncio
async def test_async_reader_can_stop_early(tmp_path: Path) -> None:
    path = _generated_trace(tmp_path, 50)
    async with aclosing(aiter_mooncake_trace(path, chunk_bytes=1024)) as requests:
        async for request in requests:
            if request.index == 2:
                break
    assert request.index == 2


def test_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        list(iter_mooncake_records(tmp_path / "absent.jsonl"))


@pytest.mark.asyncio
@requires_conversation_trace
async def test_real_conversation_trace_parses(
    record_property: Callable[[str, object], None],
) -> None:
    count = tokens = 0
    last_timestamp = -1
    async for request in aiter_mooncake_trace(conversation_trace()):
        assert request.index == count
        assert request.timestamp_ms >= last_timestamp
        assert len(request.input_ids) == request.input_length
        last_timestamp = request.timestamp_ms
        count += 1
        tokens += request.input_length
    assert count > 0
    record_property("requests", count)
    record_property("input_tokens", tokens)
    print(f"conversation trace: {count} requests, {tokens} input tokens")
