"""``RadixKey``: the token ids a cache operation is about, plus an optional namespace.

Keys with different ``extra_key`` never share a node: the namespace is part of the child key
of every child of the root, so two namespaces are two disjoint subtrees.  A namespace is a
typed tuple (``("lora", 3)``), never a concatenated string; a plain string is accepted for
SGLang compatibility and becomes a 1-tuple.

Token ids arrive as a list (kept as it is, not copied: the hot path), a tuple, an
``array.array`` of integers (``array('q')``), a 1-D integer torch tensor or numpy array, or a
``range``; all but the list are converted once to a list of Python ints, so a tensor key
matches the same list key (a tensor's elements would be 0-d tensors, which hash by
identity).  Anything else -- ``None``, a string, a float or 2-D tensor -- is an
:class:`~urc.errors.InvalidInputError`.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from urc.errors import InvalidInputError

__all__ = ["ExtraKey", "RadixKey", "Token", "check_key", "token_list"]

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
        self.token_ids: list[Any] = (
            token_ids if isinstance(token_ids, list) else token_list(token_ids)
        )
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


_INT_TYPECODES = frozenset("bBhHiIlLqQ")


def token_list(token_ids: object) -> list[Any]:
    """``token_ids`` as a list of tokens (see the module docstring for what is accepted);
    raises :class:`~urc.errors.InvalidInputError` for anything else."""
    if isinstance(token_ids, tuple | range):
        return list(token_ids)
    if isinstance(token_ids, array):
        if token_ids.typecode in _INT_TYPECODES:
            return token_ids.tolist()
    elif isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 1 and not (
            token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype is torch.bool
        ):
            return token_ids.tolist()
    elif isinstance(token_ids, np.ndarray) and token_ids.ndim == 1 and token_ids.dtype.kind in "iu":
        return token_ids.tolist()  # type: ignore[no-any-return]
    raise InvalidInputError(
        "RadixKey token ids must be a list, tuple, integer array('q'), range or 1-D integer "
        f"tensor, got {_describe(token_ids)}"
    )


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dim()}-D {obj.dtype} tensor"
    if isinstance(obj, np.ndarray):
        return f"a {obj.ndim}-D {obj.dtype} array"
    if isinstance(obj, array):
        return f"array({obj.typecode!r})"
    return type(obj).__name__


def check_key(key: object, what: str = "key") -> RadixKey:
    """``key`` when it is a :class:`RadixKey`; :class:`~urc.errors.InvalidInputError`
    otherwise (a bare list, ``None``, a string...)."""
    if isinstance(key, RadixKey):
        return key
    raise InvalidInputError(f"{what} must be a RadixKey, got {type(key).__name__}")
