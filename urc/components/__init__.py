"""Tree components: one class per kind of cached model state."""

from __future__ import annotations

from urc.components.base import TreeComponent
from urc.node import ComponentType

__all__ = ["TreeComponent", "component_class"]


def component_class(ct: ComponentType) -> type[TreeComponent]:
    """The component class that implements ``ct`` (imported lazily)."""
    if ct is ComponentType.FULL:
        from urc.components.full import FullComponent

        return FullComponent
    if ct is ComponentType.SWA:
        from urc.components.swa import SWAComponent

        swa: type[TreeComponent] = SWAComponent
        return swa
    from urc.components.mamba import MambaComponent

    mamba: type[TreeComponent] = MambaComponent
    return mamba
