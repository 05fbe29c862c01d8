"""L3 storage tier: versioned page keys, the page codec and async page stores.

``StorageBackend`` is the contract; ``FileStorage`` (local directory, the embedded default)
implements it with the core dependencies only.  The shared backends need optional packages
and are imported from their own modules: ``hicache.storage.valkey.ValkeyStorage`` (the
``redis`` extra) and ``hicache.storage.mooncake.MooncakeStorage`` (the Mooncake wheel).

Pages are keyed by urc's own scheme (``keys``) or, to share an L3 with SGLang HiCache
replicas, by SGLang's (``sglang_keys``: ``KeyScheme.SGLANG``).
"""

from __future__ import annotations

from hicache.storage.base import StorageBackend
from hicache.storage.codec import PageStatus, decode_page_into, encode_page
from hicache.storage.errors import (
    ClearUnsupportedError,
    InvalidBufferError,
    InvalidStorageKeyError,
    StorageClosedError,
    StorageError,
    StorageTimeout,
    StorageUnavailableError,
)
from hicache.storage.file import FileStorage
from hicache.storage.keys import (
    KEY_FORMAT_VERSION,
    ROOT_HASH,
    ExtraKey,
    KeyScheme,
    PageKey,
    StorageComponent,
    extend_page_hashes,
    format_page_key,
    page_keys,
    parse_page_key,
)
from hicache.storage.sglang_keys import SGLangNaming, sglang_page_keys
from hicache.storage.stats import StorageErrorObserver, StorageOp, StorageStats

__all__ = [
    "KEY_FORMAT_VERSION",
    "ROOT_HASH",
    "ClearUnsupportedError",
    "ExtraKey",
    "FileStorage",
    "InvalidBufferError",
    "InvalidStorageKeyError",
    "KeyScheme",
    "PageKey",
    "PageStatus",
    "SGLangNaming",
    "StorageBackend",
    "StorageClosedError",
    "StorageComponent",
    "StorageError",
    "StorageErrorObserver",
    "StorageOp",
    "StorageStats",
    "StorageTimeout",
    "StorageUnavailableError",
    "decode_page_into",
    "encode_page",
    "extend_page_hashes",
    "format_page_key",
    "page_keys",
    "parse_page_key",
    "sglang_page_keys",
]
