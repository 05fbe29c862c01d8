"""Parameter and result types of the synchronous API (field names follow SGLang 0.5.16)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from urc.errors import InvalidInputError
from urc.key import RadixKey
from urc.node import ComponentType, TreeNode
from urc.reuse_hint import ReuseHint

if TYPE_CHECKING:
    from urc.req import Req

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
    req: Req | None = None
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


class IncLockRefResult:
    """Receipt of ``inc_lock_ref``: hand it back (``to_dec_params()``) to release.

    ``delta`` is the number of Full tokens moved from evictable to protected.
    ``swa_uuid_for_lock`` names the SWA window boundary; ``skip_lock_node_ids`` the nodes a
    component skipped at acquire time (tombstones), so release skips exactly those.
    ``node_id`` is the locked node: releasing another node with this receipt is refused.
    ``swa_lock_epoch`` tells SWA release which tombstones were recovered after the acquire.
    ``full_start_id`` is the first node the Full lock covers when the locked node and the
    nodes above it were host-only (release starts there, whatever was loaded back since).
    (A plain class, built field by field on every lock by ``inc_lock_ref``: the three fields
    every lock sets are slots; the rest, which only some components set, default to ``None``
    through the class and go to the instance dict when set -- a FULL-only lock writes three
    fields, not seven.)
    """

    __slots__ = ("__dict__", "delta", "node_id", "skip_lock_node_ids")

    swa_uuid_for_lock: int | None = None
    swa_uuid_for_host_lock: int | None = None
    swa_lock_epoch: int | None = None
    full_start_id: int | None = None

    def __init__(
        self,
        delta: int | None = None,
        swa_uuid_for_lock: int | None = None,
        swa_uuid_for_host_lock: int | None = None,
        skip_lock_node_ids: dict[ComponentType, set[int]] | None = None,
        node_id: int | None = None,
        swa_lock_epoch: int | None = None,
        full_start_id: int | None = None,
    ) -> None:
        self.delta = delta
        self.skip_lock_node_ids: dict[ComponentType, set[int]] = (
            {} if skip_lock_node_ids is None else skip_lock_node_ids
        )
        self.node_id = node_id
        if swa_uuid_for_lock is not None:
            self.swa_uuid_for_lock = swa_uuid_for_lock
        if swa_uuid_for_host_lock is not None:
            self.swa_uuid_for_host_lock = swa_uuid_for_host_lock
        if swa_lock_epoch is not None:
            self.swa_lock_epoch = swa_lock_epoch
        if full_start_id is not None:
            self.full_start_id = full_start_id

    def __repr__(self) -> str:
        return (
            f"IncLockRefResult(delta={self.delta}, node_id={self.node_id}, "
            f"swa_uuid_for_lock={self.swa_uuid_for_lock}, skip={self.skip_lock_node_ids})"
        )

    def to_dec_params(self) -> DecLockRefParams:
        """The release parameters for this lock (shares ``skip_lock_node_ids``).

        Built field by field: every release pays for it, and the dataclass constructor with
        seven keywords costs three times as much (a test pins the fields)."""
        p = _new_object(DecLockRefParams)
        p.swa_uuid_for_lock = self.swa_uuid_for_lock
        p.swa_uuid_for_host_lock = self.swa_uuid_for_host_lock
        p.skip_lock_node_ids = self.skip_lock_node_ids
        p.node_id = self.node_id
        p.skip_swa = False
        p.swa_lock_epoch = self.swa_lock_epoch
        p.full_start_id = self.full_start_id
        return p


@dataclass(slots=True)
class DecLockRefParams:
    """Release parameters (the acquire receipt).  ``skip_swa`` is set after an early SWA
    window release so the final release does not release SWA twice."""

    swa_uuid_for_lock: int | None = None
    swa_uuid_for_host_lock: int | None = None
    skip_lock_node_ids: dict[ComponentType, set[int]] = field(default_factory=dict)
    node_id: int | None = None
    skip_swa: bool = False
    # SWA recovery epoch at acquire: a tombstone recovered later was not locked by this receipt.
    swa_lock_epoch: int | None = None
    # First node the Full lock covers, when the locked node itself was host-only.
    full_start_id: int | None = None


class DecLockRefResult(NamedTuple):
    """``delta``: Full tokens moved from protected back to evictable."""

    delta: int | None = None


# ``to_dec_params`` builds its result field by field (the bench's unlock phase: a
# dataclass constructor's keyword parsing would cost as much as the release).
_new_object = object.__new__
