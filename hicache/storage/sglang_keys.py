"""SGLang HiCache's L3 key scheme (0.5.23, ``--hicache-storage-key-scheme rank-suffix``).

SGLang names the L3 page ``i`` of a token path by a SHA-256 chain (``get_storage_hash_str``
in ``sglang/srt/mem_cache/utils.py``, computed by ``cpp_utils/hash_binding.cpp``)::

    h_i = sha256(h_{i-1} || tokens of page i)       (h_{-1}: the namespace seed, or nothing)

with the tokens packed as little-endian uint32 (a page holding a larger id: a ``0xff`` tag and
uint64 words; the same chain as SGLang's KV-event block hashes, ``urc.kv_events``).  A request
with an ``extra_key`` or a ``cache_salt`` seeds the chain with
``storage_namespace_seed(extra_key, cache_salt)``; a request with neither starts unseeded.
Its file backend ``HiCacheFile`` stores the page as ``<hex of h_i><suffix>.bin``, the suffix
being ``_<model name, "/" as "-">_<tp rank>_<tp size>`` (a non-MLA model, no pipeline or
context parallelism).

:func:`sglang_page_keys` returns urc key strings of this scheme (``sglang:<hex><suffix>``,
see :mod:`hicache.storage.keys`), so any urc backend can hold them; :func:`sglang_namespace`
maps a urc namespace to SGLang's ``(extra_key, cache_salt)`` pair.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.storage.errors import InvalidStorageKeyError
from hicache.storage.keys import SGLANG_KEY_PATTERN, ExtraKey, encode_namespace
from urc.kv_events.block_hash import page_digests

__all__ = [
    "SGLangNaming",
    "sglang_namespace",
    "sglang_namespace_seed",
    "sglang_page_hashes",
    "sglang_page_keys",
]


@dataclass(frozen=True)
class SGLangNaming:
    """The deployment part of SGLang's L3 object names: the model name SGLang's storage
    config carries (``--served-model-name``, else the model path) and this rank's attention
    TP rank and size.  A urc replica sharing an L3 with SGLang replicas of the same model
    and TP size uses their ``model_name`` (rank 0 of size 1 for a TP-1 fleet).

    Raises :class:`~hicache.storage.errors.InvalidStorageKeyError` for a name that would not
    make a path-safe object name, or a bad rank.
    """

    model_name: str = ""
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidStorageKeyError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if SGLANG_KEY_PATTERN.fullmatch("sglang:" + "0" * 64 + self.suffix) is None:
            raise InvalidStorageKeyError(
                f"model name {self.model_name!r} has characters outside [A-Za-z0-9._/-]"
            )

    @property
    def suffix(self) -> str:
        """``HiCacheFile``'s ``config_suffix``: ``_<model>_<tp rank>_<tp size>``."""
        model = "-".join(self.model_name.split("/"))
        return f"_{model}_{self.tp_rank}_{self.tp_size}"


def sglang_namespace(extra_key: ExtraKey) -> tuple[str | None, str | None]:
    """SGLang's ``(extra_key, cache_salt)`` of a urc namespace.

    ``("extra", e)``, ``("salt", s)`` and ``("extra", e, "salt", s)`` (string parts: what the
    SGLang plug-in makes of SGLang's keys) map to their parts; ``None`` to ``(None, None)``.
    An empty salt is no salt (SGLang's ``RadixKey`` stores ``cache_salt or None``).
    Any other urc namespace has no SGLang spelling: it maps to the extra key
    ``"urc:" + hex(encode_namespace(ns))``, unique per namespace, so it still never shares a
    page with another namespace.
    """
    if extra_key is None:
        return None, None
    parts = extra_key
    if all(isinstance(p, str) for p in parts):
        if len(parts) == 2 and parts[0] == "extra":
            return str(parts[1]), None
        if len(parts) == 2 and parts[0] == "salt":
            return None, str(parts[1]) or None
        if len(parts) == 4 and parts[0] == "extra" and parts[2] == "salt":
            return str(parts[1]), str(parts[3]) or None
    return "urc:" + encode_namespace(extra_key).hex(), None


def sglang_namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The digest SGLang seeds a namespaced chain with (``storage_namespace_seed``), or
    ``None`` without a namespace."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def sglang_page_hashes(
    tokens: Sequence[int], page_size: int, extra_key: ExtraKey = None
) -> list[bytes]:
    """SGLang's storage digests of the whole pages of ``tokens`` (a path from the root) in
    urc namespace ``extra_key``; a trailing partial page is ignored.

    Raises :class:`~hicache.storage.errors.InvalidStorageKeyError` for a bad page size or a
    negative token id (SGLang refuses those too).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InvalidStorageKeyError(f"page_size must be a positive int, not {page_size!r}")
    whole = len(tokens) - len(tokens) % page_size
    seed = sglang_namespace_seed(*sglang_namespace(extra_key))
    try:
        return page_digests(tokens[:whole], seed, page_size)
    except (ValueError, OverflowError) as exc:
        raise InvalidStorageKeyError(f"token ids SGLang cannot hash: {exc}") from exc


def sglang_page_keys(
    tokens: Sequence[int], page_size: int, naming: SGLangNaming, extra_key: ExtraKey = None
) -> list[str]:
    """urc key strings (``sglang:<hex><suffix>``) of SGLang's L3 pages of ``tokens``."""
    suffix = naming.suffix
    return [f"sglang:{d.hex()}{suffix}" for d in sglang_page_hashes(tokens, page_size, extra_key)]
