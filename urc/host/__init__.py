"""The core's side of the host tier (HiCache): the two-phase transfers between device and
host (:mod:`urc.host.transfers`, an operation layer: it imports eviction).  The protocol a
host tier implements and its data types sit a floor lower, in :mod:`urc.host_protocol`
(``urc.host.protocol`` re-exports them).  The tier itself (host pools, copies, L3) is the
``hicache`` package."""

__all__: list[str] = []
