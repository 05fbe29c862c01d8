"""The core's side of the host tier, as data types (a floor below the components, which
import them): the protocol HiCache implements, write policies, the tickets of two-phase
transfers, and the host data a lower tier hands in (:class:`HostPart`).

The core never imports ``hicache``: a cache is given an object satisfying :class:`HostTier`
(``UnifiedRadixCache.attach_host_tier``) and moves data through it.  Transfers are two-phase so
that the byte copy can run off the event loop: ``start_*`` reserves slots and pins nodes
(inside the actor), the caller copies with :meth:`HostTier.backup` / :meth:`HostTier.load`
(in a worker thread), and ``finish_*`` commits the new indices and unpins (inside the actor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import torch

from urc.node import ComponentType, TreeNode

if TYPE_CHECKING:
    from urc.params import IncLockRefResult

__all__ = [
    "BackupTicket",
    "HostPart",
    "HostTier",
    "LoadTicket",
    "TierEvents",
    "TransferCompletion",
    "TransferItem",
    "WritePolicy",
]


class WritePolicy(Enum):
    """When device data is backed up to host."""

    WRITE_THROUGH = "write_through"  # on the first hit (every inserted node)
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # on the second hit
    WRITE_BACK = "write_back"  # when a device leaf is evicted (demoted instead of dropped)

    @property
    def hit_threshold(self) -> int | None:
        """Hits after which a node is due for backup (``None``: only on eviction)."""
        return {"write_through": 1, "write_through_selective": 2}.get(self.value)


class TransferCompletion(Protocol):
    """The completion of a host tier's copy (``hicache.transfer_engine.Completion``)."""

    def wait(self) -> None:
        """Block until the copy has completed."""
        ...


class HostTier(Protocol):
    """Host memory for every component's data: allocation and byte copies.

    Units per component are the component's own (token slots, state slots).  ``backup`` and
    ``load`` only issue the copies (they may run in a worker thread) and return their
    completion: nothing may read the destination, or reuse the source slots, before it is
    waited on.  ``alloc``/``free`` are called by the cache's owner only.  Index tensors of
    the host side are CPU int64.
    """

    def host_capacity(self, ct: ComponentType) -> int: ...

    def host_available(self, ct: ComponentType) -> int: ...

    def host_alloc(self, ct: ComponentType, n: int) -> torch.Tensor | None: ...

    def host_free(self, ct: ComponentType, indices: torch.Tensor) -> None: ...

    def backup(
        self, ct: ComponentType, device: torch.Tensor, host: torch.Tensor
    ) -> TransferCompletion: ...

    def load(
        self, ct: ComponentType, host: torch.Tensor, device: torch.Tensor
    ) -> TransferCompletion: ...


class TierEvents:
    """What a cache tells the tiers below device memory (HiCache's controller, an L3 storage
    worker): subclass it, override the events you need (every one is a no-op here) and
    ``cache.subscribe(events)``.

    Events are delivered synchronously, from the tree's owner (inside the service's actor),
    to every subscriber in subscription order; a handler must not change the tree and must
    not block (wake a background task instead).
    """

    __slots__ = ()

    def backup_due(self) -> None:
        """A node became due for a host backup (write-through policies; the node is in
        ``cache.pending_backups``)."""

    def host_committed(self, node: TreeNode) -> None:
        """The host copies of a chain were committed; ``node`` is its lowest node."""

    def host_evicted(self, node: TreeNode) -> None:
        """Host eviction is about to free the host copies of the host-only leaf ``node``
        (copy what you need now: the slots are reused right after)."""


@dataclass(slots=True)
class TransferItem:
    """One component's copy for one transfer: ``device`` slots <-> ``host`` slots."""

    component: ComponentType
    device: torch.Tensor
    host: torch.Tensor


@dataclass(slots=True, eq=False)
class BackupTicket:
    """A backup in flight: ``nodes`` (top-down) are being copied into the host slots
    reserved in ``items`` (``(node index, item)`` pairs).  Their device data is pinned by
    locks: ``receipt`` on the lowest node, ``pins`` on each node above it (a lock pins Full
    up to the root but auxiliary data only near its node: SWA one window, Mamba the node's
    own state).  ``lengths`` are the nodes' lengths when it started: a match may split a
    node meanwhile, and the node object always stays the lowest piece of its span."""

    nodes: list[TreeNode]
    lengths: list[int]
    items: list[tuple[int, TransferItem]]
    receipt: IncLockRefResult
    tokens: int = 0
    pins: list[IncLockRefResult] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class LoadTicket:
    """A load-back in flight: host-only ``nodes`` (top-down; Full host copies pinned by host
    locks) are being copied into the device slots reserved in ``items``.  ``anchor`` (their
    first device ancestor) is locked by ``anchor_receipt`` so it cannot be evicted meanwhile.
    ``device`` holds every reserved Full slot (owned by the ticket until it finishes)."""

    nodes: list[TreeNode]
    lengths: list[int]
    items: list[tuple[int, TransferItem]]
    anchor: TreeNode
    anchor_receipt: IncLockRefResult
    device: torch.Tensor
    tokens: int = 0


@dataclass(slots=True, eq=False)
class HostPart:
    """Host data of one auxiliary component read from a lower tier, for :func:`insert_host`.

    ``host`` holds host units of the component's own pool (already reserved and filled) for
    key positions ``[start, end)`` (both page-aligned).  Per-token data (SWA) has one slot per
    token; a per-position state (Mamba) is a point, ``start == end``: one slot, the state
    after the first ``end`` tokens.  New host-only nodes are cut at every ``start`` and
    ``end`` so that a part covers whole nodes; the component's ``commit_host_insert`` takes
    what fits a node and records the rows of ``host`` it took in ``taken``; the rest is freed.
    """

    start: int
    end: int
    host: torch.Tensor
    taken: list[tuple[int, int]] = field(default_factory=list)
