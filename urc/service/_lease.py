"""Leases: the async service's handle on a lock it took in the tree for a caller.

A :class:`Lease` stands for one ``inc_lock_ref`` the actor applied; releasing it applies the
matching ``dec_lock_ref``.  A lease releases exactly once: the first :meth:`Lease.release`
marks it released synchronously (before any ``await``), so a second call raises
:class:`~urc.errors.LeaseError` even while the first one is still on its way to the actor.
Leases still held when the service closes are released by the actor and counted.

:class:`NodeHandle` is the opaque handle of a tree node that a match returns, so a caller can
lock that node later (:meth:`AsyncUnifiedRadixCache.lock`); it exposes no tree structure.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from urc.errors import LeaseError

if TYPE_CHECKING:
    from urc.node import TreeNode

__all__ = ["Lease", "LeaseOwner", "NodeHandle"]


class LeaseOwner(Protocol):
    """Who can release a lease (the service that issued it)."""

    async def release(self, lease: Lease) -> None: ...

    def release_nowait(self, lease: Lease) -> None: ...


class NodeHandle:
    """Opaque reference to the tree node that ended a match (lockable through the service).

    Only the actor dereferences it; a handle of a node that was evicted since makes
    ``lock`` raise :class:`~urc.errors.InvalidLockError`.
    """

    __slots__ = ("_node",)

    def __init__(self, node: TreeNode) -> None:
        self._node = node

    @property
    def node(self) -> TreeNode:
        """The node (for the actor only: callers keep handles opaque)."""
        return self._node

    def __repr__(self) -> str:
        return f"NodeHandle(id={self._node.id})"


class Lease:
    """A lock held in the tree on behalf of a caller; release it exactly once.

    ``id`` is unique per service; ``prefix_len`` is the number of Full tokens the lock
    protects (the locked node's depth).  Usable as an async context manager that releases on
    exit unless already released -- on every exit path, a cancelled scope included: the exit
    queues the release without awaiting (:meth:`release_nowait`).
    """

    __slots__ = ("_owner", "_released", "id", "prefix_len")

    def __init__(self, lease_id: int, prefix_len: int, owner: LeaseOwner | None) -> None:
        self.id = lease_id
        self.prefix_len = prefix_len
        self._owner = owner
        self._released = False

    @property
    def released(self) -> bool:
        """True once :meth:`release` was called or the service released it at close."""
        return self._released

    def issued_by(self, owner: LeaseOwner) -> bool:
        """Whether ``owner`` issued this lease (and so may release it)."""
        return self._owner is owner

    def mark_released(self) -> None:
        """Mark released; raises :class:`LeaseError` if it already was (no change then)."""
        if self._released:
            raise LeaseError(f"lease {self.id} was already released")
        self._released = True

    async def release(self) -> None:
        """Release the lock (through the service that issued the lease).

        Raises :class:`LeaseError` on a second release, and the service's
        :class:`~urc.errors.ServiceClosedError` / :class:`~urc.errors.ServiceFailedError`
        when it no longer runs (a lease still held at close was released by the close).
        """
        if self._owner is None:
            raise LeaseError(f"lease {self.id} has no service to release it")
        await self._owner.release(self)

    def release_nowait(self) -> None:
        """Release without awaiting: marked released now, the release queued to the service
        (applied before any later command of this task).  Never yields, so a cancelled
        scope cannot stop it.  Raises like :meth:`release`."""
        if self._owner is None:
            raise LeaseError(f"lease {self.id} has no service to release it")
        self._owner.release_nowait(self)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._released:
            self.release_nowait()  # no await: a cancelled scope must not keep the lock held

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"Lease(id={self.id}, prefix_len={self.prefix_len}, {state})"
