"""Whole-tree checks and dumps of a :class:`~urc.state.CacheState`.

``sanity_check`` recomputes every invariant from scratch (O(nodes + pool size)) and compares
with the counters the cache keeps incrementally; ``check_pools`` asserts that every pool is
conserved.  The cache's methods of the same names call these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from urc.host_protocol import WritePolicy
from urc.node import FULL_INDEX, NUM_COMPONENT_TYPES, ComponentType, TreeNode

if TYPE_CHECKING:
    from urc.state import CacheState

__all__ = ["check_pools", "pretty_print", "sanity_check"]


def sanity_check(state: CacheState) -> None:
    """Recompute every invariant from scratch; ``AssertionError`` names the first broken one.

    Checks parent/child links and child keys, each component's per-node rules, lock
    ordering, eviction structures, size counters, node count and allocator state.
    """
    nodes = state.tree.nodes()
    assert len(nodes) == state.tree.num_nodes, f"{len(nodes)} nodes, counter {state.tree.num_nodes}"
    evictable = [0] * NUM_COMPONENT_TYPES
    protected = [0] * NUM_COMPONENT_TYPES
    host_evictable = [0] * NUM_COMPONENT_TYPES
    host_protected = [0] * NUM_COMPONENT_TYPES
    for node in nodes:
        parent = node.parent
        assert parent is not None and not node.deleted, f"node {node.id} detached"
        ck = state.tree.child_key_of(node)
        assert node.child_key == ck and parent.children.get(ck) is node, (
            f"node {node.id} is not its parent's child under its own key"
        )
        assert node.key_len == len(node.key) > 0, f"node {node.id} key_len {node.key_len}"
        assert node.key_len % state.page_size == 0, f"node {node.id} len {node.key_len}"
        full = node.data[FULL_INDEX]
        assert full is not None
        assert full.value is not None or full.host_value is not None, (
            f"node {node.id} holds no Full data on any tier"
        )
        if (
            full.host_value is not None
            and parent.parent is not None
            and state.write_policy is not WritePolicy.WRITE_BACK
        ):
            pfull = parent.data[FULL_INDEX]
            assert pfull is not None and pfull.host_value is not None, (
                f"node {node.id} has a host copy but its parent {parent.id} does not"
            )
        assert (node.full, node.swa, node.mamba) == node.data, f"node {node.id}: data attributes"
        prev_lock = None
        for c in state.components:
            cd = node.data[c.component_type]
            assert cd is not None
            assert cd.on_device is (cd.value is not None), (
                f"node {node.id}: {c.component_type.name} on_device {cd.on_device}, {cd}"
            )
            assert cd.lock_ref >= 0 and cd.host_lock_ref >= 0, f"node {node.id}: {cd}"
            if prev_lock is not None:
                # Counts are per component (Full counts locked children, the others count
                # locks), so compare "locked" only; components check exact counts themselves.
                assert prev_lock or not cd.lock_ref, (
                    f"node {node.id}: {c.component_type.name} is locked ({cd.lock_ref}) but "
                    "a higher component is not"
                )
            prev_lock = cd.lock_ref
            if c is not state.full and cd.value is not None:
                assert full.value is not None, (
                    f"node {node.id}: {c.component_type.name} on device without Full"
                )
            c.check_node(node)
            n = c.value_len(cd)
            if cd.lock_ref:
                protected[c.component_type] += n
            else:
                evictable[c.component_type] += n
            h = c.host_len(cd)
            if cd.host_lock_ref:
                host_protected[c.component_type] += h
            else:
                host_evictable[c.component_type] += h
    for c in state.components:
        ct = c.component_type
        assert (c.evictable_size, c.protected_size) == (evictable[ct], protected[ct]), (
            f"{ct.name} sizes: counters evictable={c.evictable_size} "
            f"protected={c.protected_size}, recomputed {evictable[ct]}/{protected[ct]}"
        )
        host = (c.host_evictable_size, c.host_protected_size)
        assert host == (host_evictable[ct], host_protected[ct]), (
            f"{ct.name} host sizes: counters {host}, recomputed "
            f"{host_evictable[ct]}/{host_protected[ct]}"
        )
        c.check_structures(nodes)
    check = getattr(state.token_to_kv_pool_allocator, "check_consistency", None)
    if check is not None:
        check()


def check_pools(
    state: CacheState,
    held: Mapping[ComponentType, int] | None = None,
    host_held: Mapping[ComponentType, int] | None = None,
) -> None:
    """Assert ``free + evictable + protected + held == capacity`` for every component's
    device pool, and its host pool when a host tier is attached (``held`` /
    ``host_held``: units owned outside the tree -- live requests, transfers in flight --
    in each component's unit)."""
    held = held or {}
    host_held = host_held or {}
    for c in state.components:
        ct = c.component_type
        total = c.pool_available() + c.evictable_size + c.protected_size + held.get(ct, 0)
        assert total == c.pool_capacity(), (
            f"{ct.name} pool: free {c.pool_available()} + evictable {c.evictable_size} + "
            f"protected {c.protected_size} + held {held.get(ct, 0)} = {total} "
            f"!= capacity {c.pool_capacity()}"
        )
        if state.host_tier is None:
            continue
        h = host_held.get(ct, 0)
        total = c.host_available() + c.host_evictable_size + c.host_protected_size + h
        assert total == c.host_capacity(), (
            f"{ct.name} host pool: free {c.host_available()} + evictable "
            f"{c.host_evictable_size} + protected {c.host_protected_size} + held {h} = "
            f"{total} != capacity {c.host_capacity()}"
        )


def pretty_print(state: CacheState) -> str:
    """An indented dump of the tree (also printed)."""
    lines: list[str] = []

    def walk(node: TreeNode, depth: int) -> None:
        for child in node.children.values():
            parts = []
            for c in state.components:
                cd = child.data[c.component_type]
                assert cd is not None
                on = "D" if cd.value is not None else "-"
                on += "H" if cd.host_value is not None else "-"
                parts.append(f"{c.component_type.name.lower()}={on}/{cd.lock_ref}")
            head = child.key[:4]
            more = "..." if child.key_len > 4 else ""
            lines.append(
                f"{'  ' * depth}[{child.id}] {head}{more} len={child.key_len} "
                f"{' '.join(parts)} t={child.last_access_time}"
            )
            walk(child, depth + 1)

    walk(state.tree.root, 0)
    lines.append(
        f"#nodes={state.tree.num_nodes} evictable={state.full.evictable_size} "
        f"protected={state.full.protected_size}"
    )
    text = "\n".join(lines)
    print(text)
    return text
