"""Versioned page keys for the L3 storage tier: chained SHA-256 hashes of whole token pages.

For page ``i`` of ``page_size`` token ids::

    h_i = sha256(VERSION_PREFIX || h_{i-1} || namespace || component || tokens as <int64)

with ``h_{-1} = ROOT_HASH`` (32 zero bytes).  Chaining makes a page's key depend on the whole
prefix before it, so equal keys mean equal prefixes, and a tree node can extend its parent's
hash without rehashing the prefix.  The namespace (``extra_key``) and the component are
length-prefixed and type-tagged, so no two distinct inputs encode to the same bytes.

The key string is ``urc<KEY_FORMAT_VERSION>:<component>:<64 hex digits>``.  Changing any part
of this format must bump ``KEY_FORMAT_VERSION``; golden tests pin the digests.

A second key grammar names pages under SGLang's key scheme (:class:`KeyScheme`, built by
``hicache.storage.sglang_keys``): ``sglang:<64 hex digits><suffix>``, the SGLang page hash
followed by the deployment suffix ``_<model>_<tp rank>_<tp size>`` that SGLang's
``HiCacheFile`` appends.  Such a key always names a Full (KV) page.  Backends name values
after ``str(key)``; ``FileStorage`` names SGLang-scheme files as ``HiCacheFile`` does.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from hicache.storage.errors import InvalidStorageKeyError

__all__ = [
    "KEY_FORMAT_VERSION",
    "KEY_PATTERN",
    "ROOT_HASH",
    "SGLANG_FILE_STEM",
    "SGLANG_KEY_PATTERN",
    "SGLANG_SUFFIX_PATTERN",
    "VERSION_PREFIX",
    "ExtraKey",
    "KeyScheme",
    "PageKey",
    "SGLangPageKey",
    "StorageComponent",
    "encode_namespace",
    "extend_page_hashes",
    "format_page_key",
    "page_keys",
    "parse_page_key",
    "validate_keys",
]

KEY_FORMAT_VERSION = 1
"""Version of the hash input and of the key string; bump it on any format change."""

VERSION_PREFIX = f"urc-page-key\x00v{KEY_FORMAT_VERSION}\x00".encode("ascii")
"""Domain-separation prefix of every hash input; it carries ``KEY_FORMAT_VERSION``."""

ROOT_HASH = bytes(32)
"""The "previous hash" of the first page of a sequence."""

KEY_PATTERN = re.compile(r"urc([0-9]+):(full|swa|mamba):([0-9a-f]{64})")
"""A valid key string matches this in full (``fullmatch``: no trailing newline slips through);
backends build paths and names from its groups only."""

_SGLANG_HASH = r"[0-9a-f]{64}"
_SGLANG_SUFFIX = r"_[A-Za-z0-9._-]*_[0-9]+_[0-9]+"

SGLANG_FILE_STEM = _SGLANG_HASH + _SGLANG_SUFFIX
"""The regex of an SGLang page's file stem: the page hash and the deployment suffix."""

SGLANG_SUFFIX_PATTERN = re.compile(_SGLANG_SUFFIX)
"""An SGLang deployment suffix (``_<model>_<tp rank>_<tp size>``) matches this in full."""

SGLANG_KEY_PATTERN = re.compile(rf"sglang:({_SGLANG_HASH})({_SGLANG_SUFFIX})")
"""A valid SGLang-scheme key string matches this in full: the page hash, then the deployment
suffix (model name with ``/`` as ``-``, TP rank, TP size; path-safe characters only)."""

ExtraKey = tuple[str | int, ...] | None
"""A namespace (LoRA id, cache salt, tenant): typed parts, never one concatenated string."""

_INT64 = struct.Struct("<q")


class StorageComponent(Enum):
    """Which cached state a page belongs to; part of both the hash input and the key string."""

    FULL = "full"
    SWA = "swa"
    MAMBA = "mamba"


class KeyScheme(Enum):
    """Whose key scheme a page key follows."""

    URC = "urc"
    """urc's versioned keys (this module): namespaced, per component, checksummed pages."""
    SGLANG = "sglang"
    """SGLang HiCache's page hashes plus its deployment suffix (Full pages only)."""


@dataclass(frozen=True)
class PageKey:
    """A parsed key string: its format version, component and 32-byte digest."""

    version: int
    component: StorageComponent
    digest: bytes
    scheme: ClassVar[KeyScheme] = KeyScheme.URC

    def __str__(self) -> str:
        return f"urc{self.version}:{self.component.value}:{self.digest.hex()}"

    def __hash__(self) -> int:
        # Equal keys have equal digests; a bytes object caches its hash (the generated
        # hash would rebuild a tuple and hash the Enum on every index lookup).
        return hash(self.digest)


@dataclass(frozen=True)
class SGLangPageKey(PageKey):
    """A parsed SGLang-scheme key string (``version`` 0, a Full page): SGLang's page hash
    (``digest``) and the deployment ``suffix``.  Never equal to a urc ``PageKey``."""

    suffix: str = ""
    scheme: ClassVar[KeyScheme] = KeyScheme.SGLANG

    def __str__(self) -> str:
        return f"sglang:{self.digest.hex()}{self.suffix}"

    @property
    def sglang_name(self) -> str:
        """SGLang's object name: hash and suffix (``HiCacheFile`` stores ``<name>.bin``)."""
        return f"{self.digest.hex()}{self.suffix}"


def _length_prefixed(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<I", len(payload)) + payload


def encode_namespace(extra_key: ExtraKey) -> bytes:
    """Encode ``extra_key`` unambiguously (type tag + length prefix per part).

    ``None`` and ``()`` encode differently on purpose: "no namespace" is not "an empty one".
    Raises ``InvalidStorageKeyError`` for a part that is not ``str`` or ``int`` (``bool`` is
    rejected too, because ``True == 1`` would invite accidental aliasing by callers).
    """
    if extra_key is None:
        return b"N"
    if not isinstance(extra_key, tuple):
        raise InvalidStorageKeyError(f"extra_key must be a tuple or None, not {extra_key!r}")
    parts = [b"T", struct.pack("<I", len(extra_key))]
    for part in extra_key:
        if isinstance(part, bool) or not isinstance(part, str | int):
            raise InvalidStorageKeyError(f"extra_key parts must be str or int, not {part!r}")
        if isinstance(part, str):
            parts.append(_length_prefixed(b"s", part.encode("utf-8")))
        else:
            parts.append(_length_prefixed(b"i", str(part).encode("ascii")))
    return b"".join(parts)


def _component_tag(component: StorageComponent) -> bytes:
    if not isinstance(component, StorageComponent):
        raise InvalidStorageKeyError(f"component must be a StorageComponent, not {component!r}")
    return _length_prefixed(b"c", component.value.encode("ascii"))


def extend_page_hashes(
    parent_hash: bytes,
    tokens: Sequence[int],
    page_size: int,
    component: StorageComponent,
    extra_key: ExtraKey = None,
) -> list[bytes]:
    """Return the digests of the whole pages of ``tokens``, chained from ``parent_hash``.

    ``parent_hash`` is ``ROOT_HASH`` for a sequence that starts at token 0, or the last digest
    of the preceding pages (e.g. a tree node's parent).  A trailing partial page is ignored.
    Nothing is mutated.  Raises ``InvalidStorageKeyError`` for a bad page size, parent hash,
    namespace, component, or a token id outside int64.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InvalidStorageKeyError(f"page_size must be a positive int, not {page_size!r}")
    if not isinstance(parent_hash, bytes) or len(parent_hash) != 32:
        raise InvalidStorageKeyError("parent_hash must be 32 bytes")
    # The namespace and component are the same for every page: encode them once.
    suffix = encode_namespace(extra_key) + _component_tag(component)
    page_format = struct.Struct(f"<{page_size}q")
    digests: list[bytes] = []
    previous = parent_hash
    for start in range(0, len(tokens) - page_size + 1, page_size):
        try:
            token_bytes = page_format.pack(*tokens[start : start + page_size])
        except struct.error as exc:
            raise InvalidStorageKeyError(f"token ids must be int64: {exc}") from exc
        previous = hashlib.sha256(VERSION_PREFIX + previous + suffix + token_bytes).digest()
        digests.append(previous)
    return digests


def format_page_key(digest: bytes, component: StorageComponent) -> str:
    """Return the key string of one page digest (``urc1:<component>:<hex>``)."""
    if len(digest) != 32:
        raise InvalidStorageKeyError("a page digest is 32 bytes")
    return str(PageKey(KEY_FORMAT_VERSION, component, digest))


def page_keys(
    tokens: Sequence[int],
    page_size: int,
    component: StorageComponent,
    extra_key: ExtraKey = None,
    parent_hash: bytes = ROOT_HASH,
) -> list[str]:
    """Return the key strings of the whole pages of ``tokens`` (see ``extend_page_hashes``)."""
    digests = extend_page_hashes(parent_hash, tokens, page_size, component, extra_key)
    return [format_page_key(d, component) for d in digests]


def parse_page_key(key: str) -> PageKey:
    """Parse and validate a key string; raise ``InvalidStorageKeyError`` if it is malformed.

    Only keys of the current ``KEY_FORMAT_VERSION`` are accepted: a backend never serves
    pages hashed under another format.  SGLang-scheme keys (``sglang:...``) parse to a Full
    :class:`SGLangPageKey`.
    """
    if not isinstance(key, str):
        raise InvalidStorageKeyError(f"not a page key: {key!r}")
    return _parse_key_string(key)


_COMPONENT_OF = {component.value: component for component in StorageComponent}


# The storage worker names a chain's pages from its root on every write (each job checks
# which leading pages are stored), so the same keys are parsed over and over: a bounded
# memo of the parsed (immutable) keys makes a repeat a lookup.  Malformed keys raise and
# are not kept.
@functools.lru_cache(maxsize=1 << 16)
def _parse_key_string(key: str) -> PageKey:
    match = KEY_PATTERN.fullmatch(key)
    if match is None:  # urc's keys first: they cost nothing extra
        sgl = SGLANG_KEY_PATTERN.fullmatch(key)
        if sgl is None:
            raise InvalidStorageKeyError(f"not a page key: {key!r}")
        return SGLangPageKey(0, StorageComponent.FULL, bytes.fromhex(sgl.group(1)), sgl.group(2))
    version, component, digest = match.groups()
    if int(version) != KEY_FORMAT_VERSION:
        raise InvalidStorageKeyError(f"unsupported key format version {version} in {key!r}")
    return PageKey(KEY_FORMAT_VERSION, _COMPONENT_OF[component], bytes.fromhex(digest))


def validate_keys(keys: Sequence[str]) -> list[PageKey]:
    """Parse every key of a batch; raise ``InvalidStorageKeyError`` on the first bad one."""
    if isinstance(keys, str):
        raise InvalidStorageKeyError("keys must be a sequence of key strings, not one string")
    return [parse_page_key(k) for k in keys]
