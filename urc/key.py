"""``RadixKey``: the token ids a cache operation is about, plus an optional namespace.

Keys with different ``extra_key`` never share a node: the namespace is part of the child key
of every child of the root, so two namespaces are two disjoint subtrees.  A namespace is a
typed tuple (``("lora", 3)``), never a concatenated string; a plain string is accepted for
SGLang compatibility and becomes a 1-tuple.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any

__all__ = ["ExtraKey", "RadixKey", "Token"]

Token = Hashable  # an int, or a (int, int) pair in EAGLE bigram mode
ExtraKey = tuple[str | int, ...]


class RadixKey:
    """Token ids (a list) with an optional ``extra_key`` namespace.

    ``is_bigram`` marks a key whose tokens are already EAGLE bigrams (pairs of consecutive
    token ids); :meth:`bigram` builds that view from plain ids.
    """

    __slots__ = ("extra_key", "is_bigram", "token_ids")

    def __init__(
        self,
        token_ids: Sequence[Any],
        extra_key: ExtraKey | str | None = None,
        is_bigram: bool = False,
    ) -> None:
        self.token_ids: list[Any] = token_ids if isinstance(token_ids, list) else list(token_ids)
        self.extra_key: ExtraKey | None = (extra_key,) if isinstance(extra_key, str) else extra_key
        self.is_bigram = is_bigram

    def __len__(self) -> int:
        return len(self.token_ids)

    def __iter__(self) -> Any:
        return iter(self.token_ids)

    def __getitem__(self, item: slice) -> RadixKey:
        return RadixKey(self.token_ids[item], self.extra_key, self.is_bigram)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RadixKey):
            return (self.token_ids, self.extra_key, self.is_bigram) == (
                other.token_ids,
                other.extra_key,
                other.is_bigram,
            )
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable list inside

    def __repr__(self) -> str:
        head = self.token_ids[:8]
        more = "..." if len(self.token_ids) > 8 else ""
        return f"RadixKey({head}{more}, len={len(self)}, extra_key={self.extra_key!r})"

    def page_aligned(self, page_size: int) -> RadixKey:
        """This key truncated to whole pages (itself when already aligned)."""
        n = len(self.token_ids)
        aligned = n - n % page_size
        return self if aligned == n else self[:aligned]

    def bigram(self) -> RadixKey:
        """The EAGLE bigram view: ``[(t0, t1), (t1, t2), ...]`` (one shorter than the ids)."""
        if self.is_bigram:
            return self
        ids = self.token_ids
        return RadixKey(list(itertools.pairwise(ids)), self.extra_key, True)
