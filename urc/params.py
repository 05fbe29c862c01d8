"""Parameter and result types of the synchronous API (field names follow SGLang 0.5.16).

The lock receipts and :class:`TreeLock` live in :mod:`urc.lock_receipts` (re-exported
here); ``MatchPrefixParams.req`` is any :class:`~urc.request_protocol.CachingRequest`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from urc.errors import InvalidInputError
from urc.key import RadixKey
from urc.lock_receipts import DecLockRefParams, DecLockRefResult, IncLockRefResult, TreeLock
from urc.node import ComponentType, TreeNode
from urc.reuse_hint import ReuseHint

if TYPE_CHECKING:
    from urc.request_protocol import CachingRequest

__all__ = [
    "DecLockRefParams",
    "DecLockRefResult",
    "EvictParams",
    "EvictResult",
    "IncLockRefResult",
    "InsertParams",
    "InsertResult",
    "MatchPrefixParams",
    "MatchResult",
    "PendingIndices",
    "TreeLock",
]


@dataclass(slots=True)
class MatchPrefixParams:
    """What to match.  ``cow_mamba`` with a ``req`` copies the matched Mamba state into the
    request's own slot (copy-on-write).

    ``with_indices=False`` skips concatenating the hit's device indices (SGLang 0.5.23's
    match): the result's ``device_indices`` is ``None`` and ``device_prefix_len`` tells the
    hit's length; :meth:`~urc.cache.UnifiedRadixCache.path_device_indices` of its
    ``last_device_node`` gives the indices when they are needed.  Everything else (splits,
    stamps, LRUs, copy-on-write, counters) is the same.  For callers that only want the
    length (a scheduler ranking its queue by cached prefix) or that fetch indices later.
    """

    key: RadixKey
    cow_mamba: bool = False
    req: CachingRequest | None = None
    with_indices: bool = True


class PendingIndices:
    """The device indices of a match, concatenated when first read.

    Holds the hit's per-node Full values as they stood at the match (a later split or
    eviction replaces node values, never these tensors), so the concatenation read at
    any time equals the one the match would have built eagerly.  A caller that reads only
    the hit's length (SGLang 0.5.23's ``device_prefix_len``) never pays for the
    ``torch.cat``.
    """

    __slots__ = ("_parts", "_tensor")

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self._parts: list[torch.Tensor] | None = parts
        self._tensor: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        """The concatenated indices: built on the first call, the same tensor after."""
        t = self._tensor
        if t is None:
            assert self._parts is not None, "pending indices without parts"
            t = self._tensor = torch.cat(self._parts)
            self._parts = None
        return t


_RawIndices = torch.Tensor | PendingIndices | None


def _resolve(v: Any) -> Any:
    return v.get() if type(v) is PendingIndices else v


class _MatchFields(NamedTuple):
    device_indices: _RawIndices
    last_device_node: TreeNode
    last_host_node: TreeNode
    best_match_node: TreeNode
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: int | None = None
    cache_protected_len: int | None = None
    device_len: int | None = None


_raw_get = tuple.__getitem__
_raw_iter = tuple.__iter__


class MatchResult(_MatchFields):
    """Outcome of ``match_prefix`` (a NamedTuple, as SGLang's).

    ``device_indices`` concatenates the Full device indices of the matched prefix (length ==
    device hit; ``None`` for a match with ``with_indices=False``).  ``match_prefix`` builds
    it when it is first read (:class:`PendingIndices`: same values, no ``torch.cat`` for a
    caller that never reads it); reading it through the tuple protocol (index, iteration,
    ``_asdict``) builds it too.  ``last_device_node`` ends the device hit;
    ``best_match_node`` is the deepest node every validator accepts, on device or host (the
    load-back anchor); without HiCache ``last_host_node`` equals ``last_device_node``.
    ``host_hit_length`` counts the tokens past the device hit that are on host.
    ``device_len`` is the device hit's length as ``match_prefix`` stored it (``None`` in a
    result built by hand); read it as ``device_prefix_len``, which works for both.
    """

    __slots__ = ()

    @property
    def device_indices(self) -> torch.Tensor | None:
        return _resolve(_raw_get(self, 0))  # type: ignore[no-any-return]

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        return _resolve(_raw_get(self, i)) if i in (0, -len(self)) else _raw_get(self, i)

    def __iter__(self) -> Iterator[Any]:
        it = _raw_iter(self)
        yield _resolve(next(it))
        yield from it

    def _replace(self, /, **changes: Any) -> MatchResult:
        """A copy with ``changes``; a pending ``device_indices`` stays pending (shared)."""
        result = tuple.__new__(MatchResult, map(changes.pop, self._fields, _raw_iter(self)))
        if changes:
            raise TypeError(f"MatchResult has no fields {sorted(changes)}")
        return result

    def _asdict(self) -> dict[str, Any]:
        return dict(zip(self._fields, self, strict=True))

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self._asdict().items())
        return f"MatchResult({body})"

    @property
    def device_prefix_len(self) -> int:
        """Tokens of the device hit (SGLang 0.5.23's name for ``len(device_indices)``)."""
        if self.device_len is not None:
            return self.device_len
        v = self.device_indices
        assert v is not None, "a result without indices stores device_len"
        return int(v.shape[0])

    @property
    def indices(self) -> torch.Tensor:
        """``device_indices``, which must have been built (``with_indices=True``, the
        default); :class:`~urc.errors.InvalidInputError` otherwise."""
        v = self.device_indices
        if v is None:
            raise InvalidInputError(
                "this match ran with_indices=False: use path_device_indices(last_device_node)"
            )
        return v


@dataclass(slots=True)
class InsertParams:
    """What to insert.  Indices ``value[:prev_prefix_len]`` already belong to the tree (the
    caller got them from a match); duplicates past it are freed by ``insert``.

    Mutable, as SGLang's: callers may build it empty and fill ``key`` and ``value`` later
    (``insert`` raises :class:`~urc.errors.InvalidInputError` if either is still missing).
    ``component_evicted_seqlens`` is SGLang 0.5.23's per-component form of
    ``swa_evicted_seqlen``; when it names a component it wins (read it with
    :meth:`get_evicted_seqlen`).  ``session_id`` (SGLang 0.5.23's) and ``reuse_hint`` (the
    serving layer's view of the next use, :mod:`urc.reuse_hint`) reach the eviction policy
    when it uses hints (the hint's session defaults to ``session_id``); others ignore them.
    ``inserted_len`` (SGLang 0.5.23's): the inserting request already inserted ``[0,
    inserted_len)``, so only nodes ending past it count a hit (the write-through
    threshold counts each node once per request); ``chunked`` (0.5.16's) counts none.
    """

    key: RadixKey | None = None
    value: torch.Tensor | None = None
    mamba_value: torch.Tensor | None = None
    prev_prefix_len: int = 0
    swa_evicted_seqlen: int = 0
    chunked: bool = False
    priority: int = 0
    component_evicted_seqlens: dict[ComponentType, int] | None = None
    session_id: str | None = None
    reuse_hint: ReuseHint | None = None
    inserted_len: int = 0

    def get_evicted_seqlen(self, ct: ComponentType) -> int:
        """Tokens below which component ``ct``'s slots of the request were already freed."""
        d = self.component_evicted_seqlens
        if d is not None and ct in d:
            return d[ct]
        return self.swa_evicted_seqlen if ct is ComponentType.SWA else 0

    def set_evicted_seqlen(self, ct: ComponentType, seqlen: int) -> None:
        """Set what :meth:`get_evicted_seqlen` returns for ``ct``."""
        if ct is ComponentType.SWA:
            self.swa_evicted_seqlen = seqlen
        if self.component_evicted_seqlens is not None or ct is not ComponentType.SWA:
            if self.component_evicted_seqlens is None:
                self.component_evicted_seqlens = {}
            self.component_evicted_seqlens[ct] = seqlen


@dataclass(slots=True)
class InsertResult:
    """``prefix_len``: how many leading tokens were already cached.  ``mamba_exist``: the
    target node already had Mamba state, so the caller still owns (and must free) its slot."""

    prefix_len: int
    total_len: int = 0
    last_device_node: TreeNode | None = None
    mamba_exist: bool = False
    inserted_host_node: TreeNode | None = None


@dataclass(slots=True)
class EvictParams:
    """How much to free: Full tokens, SWA tokens, Mamba states (mutable, as SGLang's)."""

    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


class EvictResult(NamedTuple):
    """How much was freed (may exceed the request: whole nodes are evicted)."""

    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0
