"""Tree components: one class per kind of cached model state.

:data:`COMPONENT_CLASSES` is the registry (as SGLang 0.5.23's ``components/registry.py``
and vLLM v1's ``spec_manager_map``): a new kind is one entry here, with its class, its
spec and its pool.
"""

from __future__ import annotations

from urc.components.base import TreeComponent
from urc.components.full import FullComponent
from urc.components.mamba import MambaComponent
from urc.components.swa import SWAComponent
from urc.errors import ConfigError
from urc.node import ComponentType

__all__ = ["COMPONENT_CLASSES", "TreeComponent", "component_class"]

#: The class implementing each kind of state.
COMPONENT_CLASSES: dict[ComponentType, type[TreeComponent]] = {
    ComponentType.FULL: FullComponent,
    ComponentType.SWA: SWAComponent,
    ComponentType.MAMBA: MambaComponent,
}


def component_class(ct: ComponentType) -> type[TreeComponent]:
    """The component class that implements ``ct`` (:data:`COMPONENT_CLASSES`); raises
    :class:`~urc.errors.ConfigError` for a kind with no class."""
    try:
        return COMPONENT_CLASSES[ct]
    except KeyError:
        raise ConfigError(f"no component class for {ct!r}") from None
