"""``RadixKey``: the token ids a cache operation is about, plus an optional namespace.

Keys with different ``extra_key`` never share a node: the namespace is part of the child key
of every child of the root, so two namespaces are two disjoint subtrees.  A namespace is a
typed tuple (``("lora", 3)``), never a concatenated string; a plain string is accepted for
SGLang compatibility and becomes a 1-tuple.

Token ids are held packed: one int64 per token in an ``array('q')``, as SGLang 0.5.23's own
``RadixKey`` holds them.  A node's key is a slice of it, so a 16k-token leaf is one 128 KiB
buffer (copied and freed with a memcpy and a free) instead of a list of 16k int objects, and
the compiled walk compares edges with ``memcmp`` (``urc.fastpath``).  They arrive as an
``array('q')`` or a contiguous 1-D ``memoryview`` of int64s (used as it is, not copied: the
hot path; the tree never mutates it and keeps copies of what it stores, and a caller must not
mutate it while an operation runs), a list or tuple of ints (packed once, by a compiled
packer when it was built), another integer ``array`` or 1-D ``memoryview``, a ``range``, or
a 1-D integer torch tensor or numpy array.  Anything else -- ``None``, a string, floats, a 2-D
tensor, ids outside int64 -- is an :class:`~urc.errors.InvalidInputError`.

EAGLE bigram keys (``is_bigram``) are the exception: a list of ``(t_i, t_i+1)`` pairs, built
from packed ids by :meth:`RadixKey.bigram`.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from urc.errors import InvalidInputError

__all__ = ["ExtraKey", "RadixKey", "Token", "TokenIds", "check_key", "pack_tokens"]

Token = Hashable  # an int, or a (int, int) pair in EAGLE bigram mode
ExtraKey = tuple[str | int, ...]
#: A key's token ids: packed (``array('q')``), or a list of bigram pairs (EAGLE).
TokenIds = Any


def _python_pack(tokens: list[Any] | tuple[Any, ...]) -> array[int]:
    """The packer without the C extension."""
    return array("q", tokens)


def _packer() -> Callable[[list[Any] | tuple[Any, ...]], array[int]]:
    try:
        from urc._native._pack import pack
    except ImportError:
        return _python_pack
    return pack  # type: ignore[no-any-return]


_pack: Callable[[list[Any] | tuple[Any, ...]], array[int]] = _packer()


class RadixKey:
    """Packed token ids (``array('q')``) with an optional ``extra_key`` namespace.

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
        self.token_ids: TokenIds = (
            token_ids
            if (type(token_ids) is array and token_ids.typecode == "q")
            or (type(token_ids) is memoryview and _packed_view(token_ids))
            else pack_tokens(token_ids, is_bigram)
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

    __hash__ = None  # type: ignore[assignment]  # mutable ids inside

    def __repr__(self) -> str:
        head = list(self.token_ids[:8])
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


def _packed_view(view: memoryview) -> bool:
    """Whether ``view`` is a contiguous 1-D view of int64s (held without a copy)."""
    return view.format == "q" and view.ndim == 1 and view.c_contiguous


def pack_tokens(token_ids: object, is_bigram: bool = False) -> TokenIds:
    """``token_ids`` packed into an ``array('q')`` (see the module docstring for what is
    accepted); a bigram key's list of pairs is kept as it is.  Raises
    :class:`~urc.errors.InvalidInputError` for anything else, or for ids outside int64."""
    try:
        if isinstance(token_ids, list | tuple):
            if is_bigram:  # pairs: kept as a list (taken as it is, like a packed array)
                return token_ids if isinstance(token_ids, list) else list(token_ids)
            return _pack(token_ids)
        if isinstance(token_ids, range):
            return array("q", token_ids)
        if isinstance(token_ids, array):
            if token_ids.typecode in _INT_TYPECODES:
                return array("q", token_ids)
        elif isinstance(token_ids, memoryview):
            if token_ids.ndim == 1 and token_ids.format in _INT_TYPECODES:
                return array("q", token_ids.tolist())
        elif isinstance(token_ids, torch.Tensor):
            if token_ids.dim() == 1 and not (
                token_ids.is_floating_point()
                or token_ids.is_complex()
                or token_ids.dtype is torch.bool
            ):
                ids = token_ids.detach().to("cpu", torch.int64).contiguous()
                return array("q", ids.numpy().tobytes())
        elif isinstance(token_ids, np.ndarray) and token_ids.ndim == 1:
            if token_ids.dtype.kind not in "iu":
                raise TypeError(f"a {token_ids.dtype} array")
            if token_ids.dtype == np.uint64 and token_ids.size and token_ids.max() >= 1 << 63:
                raise OverflowError("a token id is outside int64")
            return array("q", token_ids.astype(np.int64).tobytes())
    except (TypeError, OverflowError) as e:
        raise InvalidInputError(f"RadixKey token ids must be int64 token ids: {e}") from None
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
