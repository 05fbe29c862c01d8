"""Lock receipts and a request's tree lock (SGLang 0.5.23's ``IncLockRefResult``,
``DecLockRefParams``, ``DecLockRefResult`` and ``TreeLock``).

Kept below :mod:`urc.params` and :mod:`urc.request_protocol`: a request holds a
:class:`TreeLock`, and the params name the request, so the lock types import neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from urc.node import ComponentType

if TYPE_CHECKING:
    from urc.node import TreeNode

__all__ = ["DecLockRefParams", "DecLockRefResult", "IncLockRefResult", "TreeLock"]


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


@dataclass(slots=True, eq=False)
class TreeLock:
    """A request's lock on the tree (SGLang 0.5.23's ``TreeLock``): the locked ``node``,
    the ``receipt`` that releases it, and ``swa_released`` -- the SWA part was released
    early (:func:`urc.locking.dec_swa_lock_only`), so the final release skips it.

    Taken by :func:`urc.request_caching.lock`, given back by
    :func:`urc.request_caching.unlock` (once)."""

    node: TreeNode
    receipt: DecLockRefParams
    swa_released: bool = False
