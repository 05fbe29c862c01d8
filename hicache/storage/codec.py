"""The on-store format of one page: a fixed header followed by the tensor's raw bytes.

Header (little-endian, ``HEADER_SIZE`` bytes)::

    magic b"URCP" | format version u16 | reserved u16 | payload length u64 | crc32 u32
    | key tag 12 bytes

The key tag (``key_tag``: 96 bits of BLAKE2b over the key string) binds a value to the key it
was stored under: a page copied, linked or renamed under another key's name fails its check
like a torn one, instead of serving the other key's bytes with a valid checksum.

Format versions: 3 since the header carries the key tag; 2 when the storage worker began to
write KV pages token-major (``[2, page_size, layers, heads, dim]``, SGLang's ``page_first``
data page, whatever the host layout); version 1 pages held them layer-major, with the same
size.  A page of another version is never read (it reads as corrupt).

Every backend stores exactly ``encode_page(buffer, key)`` and checks reads with
``decode_page_into(data, buffer, key)``, so a torn write, a truncated file, a value from
another program or another key's page is detected before a single byte reaches the caller's
buffer.

The one exception is a page ``FileStorage`` shares with SGLang's ``HiCacheFile``: that file
holds the raw payload only (``raw_page``/``copy_raw_page_into``), as SGLang writes and reads
it, so only its size can be checked.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from enum import Enum

import anyio
import numpy as np
import torch

from hicache.storage.errors import InvalidBufferError
from hicache.storage.keys import PageKey

__all__ = [
    "HEADER_SIZE",
    "PAGE_FORMAT_VERSION",
    "PAGE_MAGIC",
    "PageStatus",
    "buffer_bytes",
    "check_buffer",
    "copy_raw_page_into",
    "decode_page_into",
    "decode_page_into_async",
    "encode_page",
    "encode_page_async",
    "key_tag",
    "payload_length",
    "raw_page",
]

PAGE_MAGIC = b"URCP"
PAGE_FORMAT_VERSION = 3
_TAG_BYTES = 12
_HEADER = struct.Struct(f"<4sHHQI{_TAG_BYTES}s")
HEADER_SIZE = _HEADER.size
# Checksumming runs at a few GB/s: below this size it costs less than a hop to a worker
# thread, above it it would stall the event loop for longer than a hop costs.
_OFFLOAD_BYTES = 512 * 1024


class PageStatus(Enum):
    """Outcome of decoding one stored page into a buffer."""

    OK = "ok"
    """The payload was verified and copied into the buffer."""
    CORRUPT = "corrupt"
    """Bad magic, version, length, key tag or checksum: the stored value is damaged, or is
    another key's page (delete it)."""
    SIZE_MISMATCH = "size_mismatch"
    """A sound page whose size differs from the buffer's: a miss, the value is kept."""


def check_buffer(buffer: torch.Tensor) -> None:
    """Raise ``InvalidBufferError`` unless ``buffer`` is a contiguous CPU tensor."""
    if not isinstance(buffer, torch.Tensor):
        raise InvalidBufferError(
            f"a page buffer must be a torch.Tensor, not {type(buffer).__name__}"
        )
    if buffer.device.type != "cpu":
        raise InvalidBufferError(f"a page buffer must be on the CPU, not {buffer.device}")
    if not buffer.is_contiguous():
        raise InvalidBufferError("a page buffer must be contiguous")


def buffer_bytes(buffer: torch.Tensor) -> np.ndarray:
    """Return a writable uint8 numpy view of ``buffer``'s memory (no copy).

    ``buffer`` must pass ``check_buffer``.  Flattening first lets ``view(torch.uint8)``
    reinterpret any element size; ``detach`` keeps autograd out of it.
    """
    array: np.ndarray = buffer.detach().reshape(-1).view(torch.uint8).numpy()
    return array


def key_tag(key: PageKey) -> bytes:
    """The 12-byte tag of ``key`` a page header records (BLAKE2b of the key string)."""
    return hashlib.blake2b(str(key).encode("ascii"), digest_size=_TAG_BYTES).digest()


def encode_page(buffer: torch.Tensor, key: PageKey) -> bytes:
    """Return header + raw bytes of ``buffer`` (one copy), bound to ``key``; ``buffer`` is
    not mutated."""
    check_buffer(buffer)
    payload = buffer_bytes(buffer)
    header = _HEADER.pack(
        PAGE_MAGIC, PAGE_FORMAT_VERSION, 0, payload.nbytes, zlib.crc32(payload.data), key_tag(key)
    )
    return b"".join((header, payload.data))  # one copy of the payload


def payload_length(header: bytes | bytearray | memoryview, key: PageKey) -> int | None:
    """The payload length a page header of ``key`` announces, or ``None`` if the header is
    not one of ``key``'s pages in this format (too short, bad magic, version or key tag).

    Lets a reader check a stored value's size before reading all of it."""
    view = memoryview(header).cast("B")
    if len(view) < HEADER_SIZE:
        return None
    magic, version, _reserved, length, _crc, tag = _HEADER.unpack_from(view)
    if magic != PAGE_MAGIC or version != PAGE_FORMAT_VERSION or tag != key_tag(key):
        return None
    return int(length)


def decode_page_into(
    data: bytes | bytearray | memoryview, buffer: torch.Tensor, key: PageKey
) -> PageStatus:
    """Verify one stored page of ``key`` and, only if it is sound, is ``key``'s and fits,
    copy it into ``buffer``.

    Returns ``PageStatus.OK`` after filling ``buffer`` completely; any other status leaves
    ``buffer`` untouched (never a partial write).  ``buffer`` must pass ``check_buffer``.
    """
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        return PageStatus.CORRUPT
    magic, version, _reserved, length, crc, tag = _HEADER.unpack_from(view)
    if magic != PAGE_MAGIC or version != PAGE_FORMAT_VERSION or length != len(view) - HEADER_SIZE:
        return PageStatus.CORRUPT
    if tag != key_tag(key):
        return PageStatus.CORRUPT  # another key's page under this key's name
    payload = view[HEADER_SIZE:]
    if zlib.crc32(payload) != crc:
        return PageStatus.CORRUPT
    target = buffer_bytes(buffer)
    if target.nbytes != length:
        return PageStatus.SIZE_MISMATCH
    # numpy copies from a read-only source without the warning torch.frombuffer would raise.
    target[:] = np.frombuffer(payload, dtype=np.uint8)
    return PageStatus.OK


async def encode_page_async(buffer: torch.Tensor, key: PageKey) -> bytes:
    """``encode_page``, in a worker thread for large pages (zlib releases the GIL)."""
    if buffer.nbytes < _OFFLOAD_BYTES:
        return encode_page(buffer, key)
    return await anyio.to_thread.run_sync(encode_page, buffer, key)


async def decode_page_into_async(
    data: bytes | bytearray | memoryview, buffer: torch.Tensor, key: PageKey
) -> PageStatus:
    """``decode_page_into``, in a worker thread for large pages (zlib releases the GIL)."""
    if len(data) < _OFFLOAD_BYTES:
        return decode_page_into(data, buffer, key)
    return await anyio.to_thread.run_sync(decode_page_into, data, buffer, key)


def raw_page(buffer: torch.Tensor) -> bytes:
    """The raw bytes of ``buffer`` (no header: SGLang's ``HiCacheFile`` format)."""
    check_buffer(buffer)
    return buffer_bytes(buffer).tobytes()


def copy_raw_page_into(data: bytes | bytearray | memoryview, buffer: torch.Tensor) -> PageStatus:
    """Copy a raw page into ``buffer`` if the sizes match (``OK``), else leave ``buffer``
    untouched (``SIZE_MISMATCH``); a raw page has nothing else to verify."""
    view = memoryview(data).cast("B")
    target = buffer_bytes(buffer)
    if target.nbytes != len(view):
        return PageStatus.SIZE_MISMATCH
    target[:] = np.frombuffer(view, dtype=np.uint8)
    return PageStatus.OK
