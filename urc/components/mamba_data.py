"""``MambaData``: the Mamba component's data on one node (the pool slot of its state on top
of ``PresenceData``)."""

from __future__ import annotations

from urc.node import PresenceData

__all__ = ["MambaData"]


class MambaData(PresenceData):
    """Mamba's data on one node: ``PresenceData`` plus ``slot``, the Mamba pool slot that
    ``value`` names (``-1`` while ``value`` is ``None``).

    The slot as an int saves a read of the value tensor wherever the component needs it
    (eviction, copy-on-write, a backup's check).  The sixth field keeps the object in the
    same 80-byte allocator block as ``PresenceData``'s five.
    """

    __slots__ = ("slot",)

    def __init__(self) -> None:
        # The fields set here, not through ``super().__init__`` (one call per new node).
        self.value = None
        self.on_device = False
        self.lock_ref = 0
        self.host_value = None
        self.host_lock_ref = 0
        self.slot = -1
