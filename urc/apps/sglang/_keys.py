"""SGLang's ``RadixKey`` (token ids in an ``array('q')``, ``extra_key``, ``cache_salt``,
``limit``) as urc's :class:`urc.key.RadixKey`."""

from __future__ import annotations

from typing import Any

from urc.key import ExtraKey, RadixKey

__all__ = ["namespace", "to_urc_key"]


def namespace(extra_key: str | None, cache_salt: str | None) -> ExtraKey | None:
    """urc's namespace for SGLang's two: both split the tree (``cache_salt`` is a tenant
    salt, ``extra_key`` a LoRA or a user's key), so the pair is the namespace."""
    if extra_key is None and cache_salt is None:
        return None
    if cache_salt is None:
        return ("extra", extra_key)  # type: ignore[return-value]
    return ("extra", extra_key if extra_key is not None else "", "salt", cache_salt)


def to_urc_key(key: Any, length: int | None = None) -> RadixKey:
    """urc's key of SGLang's ``key`` (its ``limit`` honoured), cut to ``length`` tokens
    when given.  Both hold packed ``array('q')`` ids: a whole key is shared, not copied; a
    cut one is an array slice (a memcpy)."""
    ids = key.token_ids
    n = len(ids)
    limit = key.limit
    if limit is not None and limit < n:
        n = limit
    if length is not None and length < n:
        n = length
    return RadixKey(ids if n == len(ids) else ids[:n], namespace(key.extra_key, key.cache_salt))
