"""Streaming line splitting for JSON-lines files, sync and async, in bounded memory.

Files are read in fixed-size binary chunks rather than line by line: with aiofiles every read
is a hop to a worker thread, so one hop per chunk (default 1 MiB) instead of one per line keeps
the async reader as fast as the sync one. Memory is bounded by the chunk size plus the longest
line, and the longest line is itself capped (``max_line_bytes``), so a multi-GB file, or a
corrupt one with no newlines, never gets loaded whole.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Iterator

import aiofiles

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_LINE_BYTES",
    "LineTooLongError",
    "aiter_lines",
    "iter_lines",
]

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_LINE_BYTES = 64 << 20


class LineTooLongError(ValueError):
    """A line grew past ``max_line_bytes`` before its newline was found."""

    def __init__(self, line_number: int, max_line_bytes: int) -> None:
        super().__init__(f"line {line_number} is longer than {max_line_bytes} bytes")
        self.line_number = line_number
        self.max_line_bytes = max_line_bytes


class _Splitter:
    """Turns a stream of byte chunks into ``(line_number, line)`` pairs (1-based numbers).

    Lines are yielded without their ``\\n``; a final line without a newline is yielded by
    :meth:`finish`. Kept separate from I/O so the sync and async readers share it exactly.
    An unfinished line is kept as a list of pieces, so a line spanning many chunks is joined
    once, not re-copied on every chunk.
    """

    __slots__ = ("_line_number", "_max_line_bytes", "_pending", "_pending_bytes")

    def __init__(self, max_line_bytes: int) -> None:
        if max_line_bytes <= 0:
            raise ValueError(f"max_line_bytes must be > 0, got {max_line_bytes}")
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._line_number = 0
        self._max_line_bytes = max_line_bytes

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        """Return the lines completed by ``chunk``.

        Raises:
            LineTooLongError: if the unfinished line buffered across chunks exceeds
                ``max_line_bytes`` (this is what bounds memory).
        """
        if b"\n" not in chunk:
            self._pending.append(chunk)
            self._pending_bytes += len(chunk)
            self._check_pending()
            return []
        parts = chunk.split(b"\n")
        if self._pending:
            self._pending.append(parts[0])
            parts[0] = b"".join(self._pending)
        tail = parts.pop()
        self._pending = [tail] if tail else []
        self._pending_bytes = len(tail)
        first = self._line_number + 1
        self._line_number += len(parts)
        self._check_pending()
        return list(enumerate(parts, start=first))

    def finish(self) -> list[tuple[int, bytes]]:
        """Return the last line if the file did not end with a newline."""
        if not self._pending:
            return []
        self._line_number += 1
        last = b"".join(self._pending)
        self._pending = []
        self._pending_bytes = 0
        return [(self._line_number, last)]

    def _check_pending(self) -> None:
        if self._pending_bytes > self._max_line_bytes:
            raise LineTooLongError(self._line_number + 1, self._max_line_bytes)


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")


def iter_lines(
    path: str | os.PathLike[str],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[tuple[int, bytes]]:
    """Yield ``(line_number, line_bytes)`` for every line of ``path``, reading incrementally.

    Raises:
        OSError: if the file cannot be opened or read.
        LineTooLongError: if a line exceeds ``max_line_bytes``.
    """
    _check_chunk_bytes(chunk_bytes)
    splitter = _Splitter(max_line_bytes)
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            yield from splitter.feed(chunk)
    yield from splitter.finish()


async def aiter_lines(
    path: str | os.PathLike[str],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> AsyncGenerator[tuple[int, bytes], None]:
    """Async twin of :func:`iter_lines`: file reads run in aiofiles' worker thread.

    Close it with ``contextlib.aclosing`` if you stop early, so the file is closed promptly.

    Raises:
        OSError: if the file cannot be opened or read.
        LineTooLongError: if a line exceeds ``max_line_bytes``.
    """
    _check_chunk_bytes(chunk_bytes)
    splitter = _Splitter(max_line_bytes)
    async with aiofiles.open(path, "rb") as f:
        while chunk := await f.read(chunk_bytes):
            for item in splitter.feed(chunk):
                yield item
    for item in splitter.finish():
        yield item
