"""``SWAData``: the SWA component's data on one node (window-lock stamps on top of
``ComponentData``)."""

from __future__ import annotations

from urc.node import ComponentData

__all__ = ["SWAData"]


class SWAData(ComponentData):
    """SWA's data on one node: ``ComponentData`` plus the window-lock stamps.

    ``uuid`` names the node as the top of window locks (stamped by the first lock whose
    window it fills; a split moves it to the upper part).  ``restored`` is the recovery epoch
    at which the node last got SWA back while Full-locked (0: never), see the module
    docstring.
    """

    __slots__ = ("restored", "uuid")

    def __init__(self) -> None:
        super().__init__()
        self.uuid: int | None = None
        self.restored = 0
