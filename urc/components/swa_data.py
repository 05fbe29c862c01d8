"""``SWAData``: the SWA component's data on one node (window-lock stamps and SWA LRU links
on top of ``ComponentData``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from urc.node import PresenceData

if TYPE_CHECKING:
    from urc.lru import LRULink
    from urc.node import TreeNode

__all__ = ["SWAData"]


class SWAData(PresenceData):
    """SWA's data on one node: ``PresenceData`` plus the window-lock stamps.

    ``uuid`` names the node as the top of window locks (stamped by the first lock whose
    window it fills; a split moves it to the upper part).  ``restored`` is the recovery epoch
    at which the node last got SWA back while Full-locked (0: never), see the module
    docstring.  ``lru_prev`` / ``lru_next`` / ``lru_node`` link it into the SWA LRU
    (``urc.lru.LinkedLRUList``) while the node holds SWA on device.
    """

    __slots__ = ("lru_next", "lru_node", "lru_prev", "restored", "uuid")

    def __init__(self) -> None:
        super().__init__()
        self.uuid: int | None = None
        self.restored = 0
        self.lru_prev: LRULink | None = None
        self.lru_next: LRULink | None = None
        self.lru_node: TreeNode | None = None
