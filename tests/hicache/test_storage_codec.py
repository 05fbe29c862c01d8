"""The on-store page format: a page round-trips through its header, and a page of another
format version (version 1 held KV pages layer-major, with the same size) is never read."""

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
)


def test_a_page_round_trips_through_its_header() -> None:
    page = torch.randn(2, 4, 3, 8).to(torch.bfloat16)
    data = encode_page(page)
    assert len(data) == HEADER_SIZE + page.nbytes
    out = torch.empty_like(page)
    assert decode_page_into(data, out) is PageStatus.OK
    assert torch.equal(out, page)


@pytest.mark.parametrize("version", [1, PAGE_FORMAT_VERSION + 1])
def test_a_page_of_another_format_version_is_corrupt_and_leaves_the_buffer_untouched(
    version: int,
) -> None:
    payload = torch.randn(2, 4, 3, 8).numpy().tobytes()
    header = struct.pack("<4sHHQI", PAGE_MAGIC, version, 0, len(payload), zlib.crc32(payload))
    out = torch.zeros(2, 4, 3, 8)
    assert decode_page_into(header + payload, out) is PageStatus.CORRUPT
    assert int(out.count_nonzero()) == 0


def test_the_format_is_version_2_since_kv_pages_are_token_major() -> None:
    assert PAGE_FORMAT_VERSION == 2
