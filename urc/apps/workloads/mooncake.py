"""Reader for Mooncake-format request traces (JSON lines), streaming, sync and async.

One JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}

``timestamp`` is the arrival time in ms; each hash id names one block of ``block_size`` tokens
(512 in the published traces), the last block holding the remainder, so
``len(hash_ids) == ceil(input_length / block_size)``. Other keys are ignored. Blank lines are
skipped. Requests must appear in non-decreasing timestamp order (the published traces are
sorted): an earlier timestamp after a later one raises :class:`TraceOrderError` rather than
being reordered, because a bounded reorder window would silently change the replayed order,
and an unbounded one would need the whole file in memory.

Errors are typed: every malformed line raises :class:`TraceFormatError` carrying ``path``,
``line_number`` (1-based, blank lines counted) and the offending ``field``.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, Generator, Iterator
from contextlib import aclosing
from dataclasses import dataclass

from urc.apps.workloads.blocks import expand_hash_ids
from urc.apps.workloads.lines import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    LineTooLongError,
    aiter_lines,
    iter_lines,
)
from urc.apps.workloads.request import TraceRequest

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MooncakeRecord",
    "TraceFormatError",
    "TraceOrderError",
    "aiter_mooncake_records",
    "aiter_mooncake_trace",
    "iter_mooncake_records",
    "iter_mooncake_trace",
]

DEFAULT_BLOCK_SIZE = 512


class TraceFormatError(ValueError):
    """A trace line is malformed.

    Attributes:
        path: the trace file.
        line_number: 1-based line number (blank lines counted).
        field: the JSON field at fault, or ``None`` when the line as a whole is (bad JSON, not
            an object, too long).
    """

    def __init__(
        self, path: str | os.PathLike[str], line_number: int, message: str, field: str | None
    ) -> None:
        super().__init__(f"{os.fspath(path)}:{line_number}: {message}")
        self.path = os.fspath(path)
        self.line_number = line_number
        self.field = field


class TraceOrderError(TraceFormatError):
    """A request's timestamp is earlier than the previous request's."""


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    """One validated trace line, before token expansion (cheap: no token list built).

    ``hash_ids`` is consistent with ``input_length`` for the ``block_size`` it was read with.
    """

    line_number: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int_field(obj: dict[str, object], name: str, fail: _Fail) -> int:
    if name not in obj:
        raise fail(f"missing field {name!r}", name)
    value = obj[name]
    # bool is an int subclass; true/false in a length field is a bug in the trace, not a 1/0.
    if type(value) is not int:
        raise fail(f"field {name!r} must be an integer, got {type(value).__name__}", name)
    if value < 0:
        raise fail(f"field {name!r} must be >= 0, got {value}", name)
    return value


class _Fail:
    """Builds TraceFormatErrors for one line, so validation code stays short."""

    __slots__ = ("line_number", "path")

    def __init__(self, path: str | os.PathLike[str], line_number: int) -> None:
        self.path = path
        self.line_number = line_number

    def __call__(self, message: str, field: str | None) -> TraceFormatError:
        return TraceFormatError(self.path, self.line_number, message, field)


def _parse_line(
    raw: bytes, path: str | os.PathLike[str], line_number: int, block_size: int
) -> MooncakeRecord | None:
    """Return the validated record of one line, ``None`` for a blank line."""
    if not raw.strip():
        return None
    fail = _Fail(path, line_number)
    try:
        obj = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise fail(f"invalid JSON: {exc}", None) from exc
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}", None)
    timestamp = _int_field(obj, "timestamp", fail)
    input_length = _int_field(obj, "input_length", fail)
    output_length = _int_field(obj, "output_length", fail)
    if "hash_ids" not in obj:
        raise fail("missing field 'hash_ids'", "hash_ids")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise fail(f"field 'hash_ids' must be a list, got {type(ids).__name__}", "hash_ids")
    for position, hash_id in enumerate(ids):
        if type(hash_id) is not int or hash_id < 0:
            raise fail(
                f"field 'hash_ids' item {position} must be an integer >= 0, got {hash_id!r}",
                "hash_ids",
            )
    # ceil division: the last block holds between 1 and block_size real tokens.
    needed = -(-input_length // block_size)
    if len(ids) != needed:
        raise fail(
            f"field 'hash_ids' has {len(ids)} ids but input_length {input_length} needs "
            f"{needed} blocks of {block_size} tokens (the last one partial)",
            "hash_ids",
        )
    return MooncakeRecord(line_number, timestamp, input_length, output_length, tuple(ids))


class _RecordStream:
    """Parses lines into records and enforces timestamp order; shared by sync and async."""

    __slots__ = ("block_size", "last_timestamp", "path")

    def __init__(self, path: str | os.PathLike[str], block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.path = path
        self.block_size = block_size
        self.last_timestamp = -1

    def accept(self, line_number: int, raw: bytes) -> MooncakeRecord | None:
        record = _parse_line(raw, self.path, line_number, self.block_size)
        if record is None:
            return None
        if record.timestamp_ms < self.last_timestamp:
            raise TraceOrderError(
                self.path,
                line_number,
                f"field 'timestamp' {record.timestamp_ms} is earlier than the previous "
                f"request's {self.last_timestamp}; the trace must be sorted by timestamp",
                "timestamp",
            )
        self.last_timestamp = record.timestamp_ms
        return record

    def too_long(self, exc: LineTooLongError) -> TraceFormatError:
        return TraceFormatError(self.path, exc.line_number, str(exc), None)


def iter_mooncake_records(
    path: str | os.PathLike[str],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[MooncakeRecord]:
    """Yield the validated records of a trace, streaming, without expanding tokens.

    Raises:
        TraceFormatError: on a malformed line (``TraceOrderError`` on a timestamp going back).
        OSError: if the file cannot be read.
        ValueError: if ``block_size`` is not positive.
    """
    stream = _RecordStream(path, block_size)
    try:
        for line_number, raw in iter_lines(
            path, chunk_bytes=chunk_bytes, max_line_bytes=max_line_bytes
        ):
            record = stream.accept(line_number, raw)
            if record is not None:
                yield record
    except LineTooLongError as exc:
        raise stream.too_long(exc) from exc


async def aiter_mooncake_records(
    path: str | os.PathLike[str],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> AsyncGenerator[MooncakeRecord, None]:
    """Async twin of :func:`iter_mooncake_records` (file reads via aiofiles).

    Raises: as :func:`iter_mooncake_records`.
    """
    stream = _RecordStream(path, block_size)
    lines = aiter_lines(path, chunk_bytes=chunk_bytes, max_line_bytes=max_line_bytes)
    try:
        # aclosing: if our consumer stops early, close the file now, not at loop shutdown.
        async with aclosing(lines):
            async for line_number, raw in lines:
                record = stream.accept(line_number, raw)
                if record is not None:
                    yield record
    except LineTooLongError as exc:
        raise stream.too_long(exc) from exc


def _to_request(
    record: MooncakeRecord, index: int, block_size: int, namespace: tuple[str, ...] | None
) -> TraceRequest:
    tokens = expand_hash_ids(record.hash_ids, record.input_length, block_size)
    return TraceRequest(
        index=index,
        timestamp_ms=record.timestamp_ms,
        input_ids=tuple(tokens),
        output_length=record.output_length,
        input_length=record.input_length,
        namespace=namespace,
        hash_ids=record.hash_ids,
    )


def iter_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    namespace: tuple[str, ...] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Generator[TraceRequest, None, None]:
    """Yield the trace's requests with token ids expanded from hash ids, in file order.

    Token ids follow :func:`urc.apps.workloads.blocks.expand_hash_ids`; every request gets
    ``namespace`` as its extra key. Memory is bounded by one chunk, one line and one request.

    Raises: as :func:`iter_mooncake_records`.
    """
    records = iter_mooncake_records(
        path, block_size=block_size, chunk_bytes=chunk_bytes, max_line_bytes=max_line_bytes
    )
    for index, record in enumerate(records):
        yield _to_request(record, index, block_size, namespace)


async def aiter_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    namespace: tuple[str, ...] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> AsyncGenerator[TraceRequest, None]:
    """Async twin of :func:`iter_mooncake_trace`, the one the replay command uses.

    Close it with ``contextlib.aclosing`` when stopping early so the file closes promptly.

    Raises: as :func:`iter_mooncake_records`.
    """
    records = aiter_mooncake_records(
        path, block_size=block_size, chunk_bytes=chunk_bytes, max_line_bytes=max_line_bytes
    )
    index = 0
    async with aclosing(records):
        async for record in records:
            yield _to_request(record, index, block_size, namespace)
            index += 1
