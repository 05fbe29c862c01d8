"""The core's side of the host tier (HiCache): the protocol a host tier implements
(:mod:`urc.host.protocol`) and the two-phase transfers between device and host
(:mod:`urc.host.transfers`).  The tier itself (host pools, copies, L3) is the ``hicache``
package."""

__all__: list[str] = []
