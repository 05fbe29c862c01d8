"""Page keys: golden digests pin the format; chaining, namespace and component isolation."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.storage.errors import InvalidStorageKeyError
from hicache.storage.keys import (
    KEY_FORMAT_VERSION,
    ROOT_HASH,
    VERSION_PREFIX,
    StorageComponent,
    encode_namespace,
    extend_page_hashes,
    format_page_key,
    page_keys,
    parse_page_key,
    validate_keys,
)

FULL = StorageComponent.FULL

# Golden values: if one of these changes, the key format changed and KEY_FORMAT_VERSION
# must be bumped (stores written by an older version must never be read as this one).
GOLDEN = [
    (
        (list(range(8)), 4, FULL, None),
        [
            "urc1:full:0e0328532af23bc1aee5eaada5325a30d2ac777f3f32339aa557ae0747bcc950",
            "urc1:full:8d966eba0b6651784d84f0e79cee5a0254b06df7a1947910175df522c56eeb38",
        ],
    ),
    (
        ([1, 2, 3, 4], 4, StorageComponent.SWA, ("lora", 7)),
        ["urc1:swa:26b233df57c61ffdae9c42f930bba92af3a81955ba8913162a12b98f5a5c1536"],
    ),
    (
        ([5], 1, StorageComponent.MAMBA, ()),
        ["urc1:mamba:634e68d2c98539dc8f7d5692c31de88621603327ce9fa5e2268bf1c7cfc300d2"],
    ),
]


@pytest.mark.parametrize(("args", "expected"), GOLDEN)
def test_golden_keys(args: tuple, expected: list[str]) -> None:  # type: ignore[type-arg]
    tokens, page_size, component, extra_key = args
    assert page_keys(tokens, page_size, component, extra_key) == expected


def test_first_page_follows_the_documented_formula() -> None:
    """Recompute h_0 by hand from the module's documented layout."""
    namespace = b"N"  # None
    component = b"c" + struct.pack("<I", 4) + b"full"
    tokens = struct.pack("<4q", 0, 1, 2, 3)
    digest = hashlib.sha256(VERSION_PREFIX + ROOT_HASH + namespace + component + tokens).digest()
    assert KEY_FORMAT_VERSION == 1
    assert page_keys(list(range(4)), 4, FULL)[0] == f"urc1:full:{digest.hex()}"


def test_only_whole_pages_are_keyed() -> None:
    assert page_keys(list(range(7)), 4, FULL) == page_keys(list(range(4)), 4, FULL)
    assert page_keys([1, 2, 3], 4, FULL) == []


@given(
    tokens=st.lists(st.integers(0, 2**31), min_size=0, max_size=64),
    page_size=st.sampled_from([1, 2, 4, 8]),
    split=st.integers(0, 16),
)
def test_chaining_extends_from_a_prefix(tokens: list[int], page_size: int, split: int) -> None:
    """Keys of a sequence = keys of a page-aligned prefix + extension from its last hash."""
    whole = extend_page_hashes(ROOT_HASH, tokens, page_size, FULL)
    cut = min(split, len(whole)) * page_size
    head = extend_page_hashes(ROOT_HASH, tokens[:cut], page_size, FULL)
    parent = head[-1] if head else ROOT_HASH
    tail = extend_page_hashes(parent, tokens[cut:], page_size, FULL)
    assert head + tail == whole


def test_a_page_key_depends_on_the_whole_prefix() -> None:
    a = page_keys([1, 2, 9, 9], 2, FULL)
    b = page_keys([3, 4, 9, 9], 2, FULL)
    assert a[1] != b[1]  # same second page, different first page


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (None, ()),
        (("a",), ("b",)),
        (("ab",), ("a", "b")),
        ((1,), ("1",)),
        (("a", 1), (1, "a")),
        ((12,), (1, 2)),
    ],
)
def test_namespaces_never_collide(left: tuple | None, right: tuple | None) -> None:  # type: ignore[type-arg]
    assert encode_namespace(left) != encode_namespace(right)
    tokens = list(range(4))
    assert page_keys(tokens, 4, FULL, left) != page_keys(tokens, 4, FULL, right)


def test_components_never_collide() -> None:
    digests = {
        component: extend_page_hashes(ROOT_HASH, [1, 2], 2, component)[0]
        for component in StorageComponent
    }
    assert len(set(digests.values())) == len(StorageComponent)


def test_parse_round_trip() -> None:
    key = page_keys([1, 2], 2, StorageComponent.SWA)[0]
    parsed = parse_page_key(key)
    assert parsed.component is StorageComponent.SWA
    assert parsed.version == KEY_FORMAT_VERSION
    assert str(parsed) == key
    assert format_page_key(parsed.digest, parsed.component) == key


GOOD_HEX = "a" * 64


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "urc1:full:" + "a" * 63,
        "urc1:full:" + "A" * 64,
        "urc1:kv:" + GOOD_HEX,
        "urc2:full:" + GOOD_HEX,  # a future format is not served by this version
        "urc1:full:" + GOOD_HEX + "\n",
        "../../etc/passwd",
        "urc1:full:../" + "a" * 61,
        "urc\u0661:full:" + GOOD_HEX,  # a non-ASCII digit (ARABIC-INDIC ONE)
    ],
)
def test_bad_keys_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidStorageKeyError):
        parse_page_key(bad)


def test_validate_keys_rejects_a_bare_string() -> None:
    with pytest.raises(InvalidStorageKeyError):
        validate_keys("urc1:full:" + GOOD_HEX)


@pytest.mark.parametrize("part", [True, 1.5, b"x", None])
def test_bad_namespace_parts_are_rejected(part: object) -> None:
    with pytest.raises(InvalidStorageKeyError):
        page_keys([1], 1, FULL, (part,))  # type: ignore[arg-type]


@pytest.mark.parametrize("page_size", [0, -1, True])
def test_bad_page_sizes_are_rejected(page_size: int) -> None:
    with pytest.raises(InvalidStorageKeyError):
        page_keys([1, 2], page_size, FULL)


def test_tokens_outside_int64_are_rejected() -> None:
    with pytest.raises(InvalidStorageKeyError):
        page_keys([2**63], 1, FULL)
