"""The on-store page format: a page round-trips through its header, a page of another
format version (version 1 held KV pages layer-major, with the same size; version 2 had no
key tag) is never read, and a page stored under another key is corrupt."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from hicache.storage.codec import (
    HEADER_SIZE,
    PAGE_FORMAT_VERSION,
    PAGE_MAGIC,
    PageStatus,
    decode_page_into,
    encode_page,
    key_tag,
    payload_length,
)
from hicache.storage.keys import StorageComponent, page_keys, parse_page_key

KEY, OTHER = (parse_page_key(k) for k in page_keys(list(range(8)), 4, StorageComponent.FULL))


def test_a_page_round_trips_through_its_header() -> None:
    page = torch.randn(2, 4, 3, 8).to(torch.bfloat16)
    data = encode_page(page, KEY)
    assert len(data) == HEADER_SIZE + page.nbytes
    out = torch.empty_like(page)
    assert decode_page_into(data, out, KEY) is PageStatus.OK
    assert torch.equal(out, page)
    assert payload_length(data[:HEADER_SIZE], KEY) == page.nbytes


def test_a_page_read_under_another_key_is_corrupt_and_leaves_the_buffer_untouched() -> None:
    """A page copied or linked under another key's name has a valid checksum: only the key
    tag in its header tells it is not that key's page."""
    page = torch.randn(64)
    data = encode_page(page, KEY)
    out = torch.zeros(64)
    assert decode_page_into(data, out, OTHER) is PageStatus.CORRUPT
    assert int(out.count_nonzero()) == 0
    assert payload_length(data, OTHER) is None
    assert key_tag(KEY) != key_tag(OTHER)


@pytest.mark.parametrize("version", [1, 2, PAGE_FORMAT_VERSION + 1])
def test_a_page_of_another_format_version_is_corrupt_and_leaves_the_buffer_untouched(
    version: int,
) -> None:
    payload = torch.randn(2, 4, 3, 8).numpy().tobytes()
    header = struct.pack(
        "<4sHHQI12s", PAGE_MAGIC, version, 0, len(payload), zlib.crc32(payload), key_tag(KEY)
    )
    out = torch.zeros(2, 4, 3, 8)
    assert decode_page_into(header + payload, out, KEY) is PageStatus.CORRUPT
    assert int(out.count_nonzero()) == 0


def test_the_format_is_version_3_since_headers_carry_the_key_tag() -> None:
    assert PAGE_FORMAT_VERSION == 3


def test_a_page_buffer_that_is_not_a_tensor_is_named_by_its_type() -> None:
    """``not list``, never ``<class 'list'>``."""
    from hicache.storage.codec import check_buffer
    from hicache.storage.errors import InvalidBufferError

    with pytest.raises(InvalidBufferError, match=r"not list$"):
        check_buffer([1, 2])  # type: ignore[arg-type]
