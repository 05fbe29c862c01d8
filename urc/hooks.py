"""``ComponentHooks``: for each optional component hook, the components that implement it.

Built once per cache from its components (a component "implements" a hook when its class
overrides the :class:`~urc.components.base.TreeComponent` default), so the generic code
calls only the components a hook concerns, in the order the hook needs: creation order
(FULL, SWA, MAMBA) unless a field says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from urc.components.base import TreeComponent
from urc.fastpath import MatchRules
from urc.node import ComponentType, Tier

__all__ = ["ComponentHooks"]


def _overrides(component: TreeComponent, hook: str) -> bool:
    overridden = getattr(type(component), hook) is not getattr(TreeComponent, hook)
    return overridden and component.uses_hook(hook)


@dataclass(frozen=True, slots=True)
class ComponentHooks:
    """The components behind each hook (tuples; see :class:`TreeComponent` for the hooks)."""

    validating: tuple[TreeComponent, ...]  # create_match_validator / create_path_validator
    match_checks: tuple[TreeComponent, ...]  # validate_match
    match_end: tuple[TreeComponent, ...]  # on_match_end
    finalize: tuple[TreeComponent, ...]  # finalize_match_result
    validate_insert: tuple[TreeComponent, ...]
    overlap: tuple[TreeComponent, ...]  # update_component_on_insert_overlap
    recover: tuple[TreeComponent, ...]  # recover_after_unevict
    commit: tuple[TreeComponent, ...]  # commit_insert_component_data
    insert_end: tuple[TreeComponent, ...]  # on_insert_end
    evict_drivers: tuple[TreeComponent, ...]  # drive_eviction
    release_checks: tuple[TreeComponent, ...]  # check_release
    early_release: tuple[TreeComponent, ...]  # release_lock_early (SWA's early release)
    req_checks: tuple[TreeComponent, ...]  # validate_caching_req
    prepare: tuple[TreeComponent, ...]  # prepare_for_caching_req
    cleanup: tuple[TreeComponent, ...]  # cleanup_after_caching_req
    # ``(type, window)`` of every validating component when each has a window rule
    # (``device_match_window``), else ``None``: the device-only match's boundary rules.
    match_rules: MatchRules | None
    # Every component, last created first, with its type: the per-leaf eviction order.
    evict_order: tuple[tuple[TreeComponent, ComponentType], ...]
    # ``(type, Tier.DEVICE)`` of every component, creation order (eviction's result keys).
    device_evict_keys: tuple[tuple[ComponentType, Tier], ...]

    @classmethod
    def of(cls, components: Sequence[TreeComponent]) -> ComponentHooks:
        """The hook table of ``components`` (creation order)."""

        def hooked(name: str) -> tuple[TreeComponent, ...]:
            return tuple(c for c in components if _overrides(c, name))

        return cls(
            validating=hooked("create_match_validator"),
            match_checks=hooked("validate_match"),
            match_end=hooked("on_match_end"),
            finalize=hooked("finalize_match_result"),
            validate_insert=hooked("validate_insert"),
            overlap=hooked("update_component_on_insert_overlap"),
            recover=hooked("recover_after_unevict"),
            commit=hooked("commit_insert_component_data"),
            insert_end=hooked("on_insert_end"),
            evict_drivers=hooked("drive_eviction"),
            release_checks=hooked("check_release"),
            early_release=hooked("release_lock_early"),
            req_checks=hooked("validate_caching_req"),
            prepare=hooked("prepare_for_caching_req"),
            cleanup=hooked("cleanup_after_caching_req"),
            match_rules=_match_rules(hooked("create_match_validator")),
            evict_order=tuple((c, c.component_type) for c in reversed(components)),
            device_evict_keys=tuple((c.component_type, Tier.DEVICE) for c in components),
        )


def _match_rules(validating: Sequence[TreeComponent]) -> MatchRules | None:
    rules = []
    for c in validating:
        window = c.device_match_window()
        if window is None:
            return None
        rules.append((int(c.component_type), window))
    return tuple(rules)
