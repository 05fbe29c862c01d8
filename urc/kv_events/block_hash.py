"""SGLang's KV-event block hash: a SHA-256 chain over pages, its first 64 bits as int64.

Page ``i`` of a path from the root hashes ``SHA-256(digest of page i-1 || tokens of page i)``
(no prefix for the first page); tokens are packed as little-endian uint32, or, when a page
holds a token above 2**32 - 1, as a 0xff tag byte and little-endian uint64 words
(``sglang/srt/mem_cache/cpp_utils/hash_binding.cpp``).  Bigram (EAGLE) tokens are pairs,
hashed as their two words.  A published block hash is the digest's first 8 bytes read as a
big-endian signed int64 (``hash_str_to_int64`` in ``mem_cache/utils.py``).

The hash depends on the tokens only: SGLang's default event format leaves the ``extra_key``
namespace out of it (and urc has no ``cache_salt``), so equal token paths in different
namespaces publish equal hashes there too.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import sha256
from typing import Any

__all__ = ["hash_to_int64", "page_digests"]

_WIDE_TAG = b"\xff"
_U32_MAX = 0xFFFFFFFF


def _page_bytes(page: Sequence[Any]) -> bytes:
    if page and isinstance(page[0], tuple):
        page = [t for pair in page for t in pair]
    try:
        return array("I", page).tobytes()
    except OverflowError:
        # a token above uint32 (or a negative one, which SGLang refuses: so do we)
        if any(t < 0 for t in page):
            raise ValueError("token ids must be non-negative to be hashed") from None
        return _WIDE_TAG + array("Q", page).tobytes()


def page_digests(tokens: Sequence[Any], prior: bytes | None, page_size: int) -> list[bytes]:
    """The SHA-256 digests of ``tokens``' pages (the last one may be short), chained from
    ``prior`` (the digest of the page before them; ``None`` at the root).

    Raises ``ValueError`` for a negative token id."""
    assert page_size >= 1, f"page_size {page_size}"
    out: list[bytes] = []
    for start in range(0, len(tokens), page_size):
        h = sha256(prior) if prior is not None else sha256()
        h.update(_page_bytes(tokens[start : start + page_size]))
        prior = h.digest()
        out.append(prior)
    return out


def hash_to_int64(digest: bytes) -> int:
    """The published block hash of a page digest: its first 8 bytes, big-endian, signed."""
    return int.from_bytes(digest[:8], "big", signed=True)
