"""HiCache orchestration inside the core: backups, load-backs and host eviction.

Functions over a :class:`~urc.cache.UnifiedRadixCache` with a host tier attached; the cache
exposes them as methods (``write_backup``, ``load_back``, ``evict_host``, ...).  Transfers are
two-phase (see :mod:`urc.host.protocol`): ``start_*`` and ``finish_*`` run where the tree is
owned (the actor), ``copy_*`` only moves bytes and may run in a worker thread.

Pins, so that nothing in flight is ever freed::

    backup     device data of the chain pinned by a lock on each of its nodes (Full needs
               only the lowest one's; SWA and Mamba lock only near the locked node), from
               start_backup until finish_backup; the reserved host slots belong to the ticket
    load-back  the Full host copies of the host-only nodes pinned by host locks, and their
               first device ancestor by a Full lock, from start_load_back until
               finish_load_back; the reserved device slots belong to the ticket
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from urc.errors import InvalidLockError
from urc.eviction import drop_if_empty
from urc.host.protocol import BackupTicket, HostTier, LoadTicket, TransferItem
from urc.key import RadixKey
from urc.node import NUM_COMPONENT_TYPES, ComponentType, Tier, TreeNode
from urc.params import EvictParams

if TYPE_CHECKING:
    from urc.cache import UnifiedRadixCache
    from urc.params import IncLockRefResult

__all__ = [
    "HostPart",
    "copy_backup",
    "copy_load_back",
    "evict_host",
    "evict_host_leaf",
    "finish_backup",
    "finish_load_back",
    "host_alloc",
    "host_lock",
    "host_prefix",
    "host_unlock_pieces",
    "insert_host",
    "load_back",
    "note_hit",
    "pieces_of",
    "start_backup",
    "start_load_back",
    "take_pending_backups",
    "write_backup",
]

_FULL = 0


def pieces_of(node: TreeNode, length: int) -> list[TreeNode]:
    """The nodes that now cover the span ``node`` had when it was ``length`` long (top-down).

    Splits keep the original node object as the lowest piece, so the span is ``node`` plus
    the ancestors that were split off above it.
    """
    pieces = [node]
    total = node.key_len
    while total < length:
        parent = node.parent
        assert parent is not None and parent.parent is not None, f"span of {node.id} lost"
        node = parent
        pieces.append(node)
        total += node.key_len
    assert total == length, f"pieces of node {pieces[0].id} cover {total} != {length}"
    pieces.reverse()
    return pieces


def host_alloc(cache: UnifiedRadixCache, ct: ComponentType, n: int) -> torch.Tensor | None:
    """Reserve ``n`` host units of ``ct``, evicting host-only leaves if needed (``None``
    when even that does not free enough)."""
    tier = cache.host_tier
    assert tier is not None
    while tier.host_available(ct) < n:
        if evict_host(cache, n - tier.host_available(ct)) == 0:
            break
    return tier.host_alloc(ct, n)


# ---------------------------------------------------------------------- backup
def note_hit(cache: UnifiedRadixCache, node: TreeNode) -> None:
    """Write-through: an insert hit ``node``; at the policy's hit threshold a node on device
    without a host copy becomes due for backup (``pending_backups``; subscribers get
    ``backup_due``)."""
    threshold = cache.backup_threshold
    cd = node.data[_FULL]
    if (
        threshold is not None
        and node.hit_count >= threshold
        and cd is not None
        and cd.host_value is None
        and cd.value is not None
    ):
        cache.pending_backups[node.id] = node
        for events in cache.tier_events:
            events.backup_due()


def take_pending_backups(cache: UnifiedRadixCache, limit: int) -> list[TreeNode]:
    """Up to ``limit`` nodes due for backup that still need one (removed from the queue)."""
    out: list[TreeNode] = []
    pending = cache.pending_backups
    while pending and len(out) < limit:
        _, node = pending.popitem()
        cd = node.data[_FULL]
        assert cd is not None
        if not node.deleted and cd.value is not None and cd.host_value is None:
            out.append(node)
    return out


def start_backup(cache: UnifiedRadixCache, node: TreeNode) -> BackupTicket | None:
    """Reserve host slots for ``node`` and every ancestor without a host copy (parents are
    backed up before children) and pin them on device.

    Returns ``None`` when nothing needs backing up, an ancestor's backup is still in flight
    (try again after it finishes), or the host tier is full even after host eviction.
    """
    if node.deleted or node.parent is None:
        return None
    in_flight = cache.backups_in_flight
    chain: list[TreeNode] = []
    walk = node
    while walk.parent is not None:
        cd = walk.data[_FULL]
        assert cd is not None
        if cd.host_value is not None:
            break
        if walk.id in in_flight or cd.value is None:
            return None
        chain.append(walk)
        walk = walk.parent
    if not chain:
        return None
    chain.reverse()
    # Pin the chain's device data during the copy: Full through the lowest node's lock;
    # auxiliary data (locked only near the locked node) through a lock on every node.
    receipt = cache.inc_lock_ref(chain[-1])
    pins = [cache.inc_lock_ref(n) for n in chain[:-1]]
    items: list[tuple[int, TransferItem]] = []
    for i, n in enumerate(chain):
        for c in cache.components:
            src = c.backup_source(n)
            if src is None or src.shape[0] == 0:
                continue
            host = host_alloc(cache, c.component_type, int(src.shape[0]))
            if host is None:
                tier = cache.host_tier
                assert tier is not None
                for _, item in items:
                    tier.host_free(item.component, item.host)
                _unpin(cache, chain, receipt, pins)
                return None
            items.append((i, TransferItem(c.component_type, src, host)))
    for n in chain:
        in_flight.add(n.id)
    tokens = sum(n.key_len for n in chain)
    return BackupTicket(chain, [n.key_len for n in chain], items, receipt, tokens, pins)


def _unpin(
    cache: UnifiedRadixCache,
    chain: list[TreeNode],
    receipt: IncLockRefResult,
    pins: list[IncLockRefResult],
) -> None:
    cache.dec_lock_ref(chain[-1], receipt.to_dec_params())
    for n, pin in zip(chain, pins, strict=False):
        cache.dec_lock_ref(n, pin.to_dec_params())


def copy_backup(tier: HostTier, ticket: BackupTicket) -> None:
    """Copy the ticket's device bytes to host (no tree access: safe in a worker thread)."""
    for _, item in ticket.items:
        tier.backup(item.component, item.device, item.host)


def finish_backup(cache: UnifiedRadixCache, ticket: BackupTicket, ok: bool = True) -> int:
    """Commit (``ok``) or drop the ticket's host copies and unpin; returns tokens backed up."""
    tier = cache.host_tier
    assert tier is not None
    for i, item in ticket.items:
        if ok:
            pieces = pieces_of(ticket.nodes[i], ticket.lengths[i])
            cache.component(item.component).commit_backup(pieces, item.host, item.device)
        else:
            tier.host_free(item.component, item.host)
    for n in ticket.nodes:
        cache.backups_in_flight.discard(n.id)
    _unpin(cache, ticket.nodes, ticket.receipt, ticket.pins)
    if not ok:
        return 0
    cache.counters.backed_up_tokens += ticket.tokens
    if not ticket.nodes[-1].deleted:
        for events in cache.tier_events:
            events.host_committed(ticket.nodes[-1])
    return ticket.tokens


def write_backup(cache: UnifiedRadixCache, node: TreeNode) -> int:
    """Back ``node`` (and its ancestors without a host copy) up synchronously; returns the
    tokens backed up (0 when impossible)."""
    ticket = start_backup(cache, node)
    if ticket is None:
        return 0
    assert cache.host_tier is not None
    copy_backup(cache.host_tier, ticket)
    return finish_backup(cache, ticket)


# ---------------------------------------------------------------------- load-back
def start_load_back(
    cache: UnifiedRadixCache, node: TreeNode, threshold: int = 0
) -> LoadTicket | None:
    """Reserve device slots for the host-only nodes from ``node`` up to the first node on
    device, and pin them (host copies) and that anchor (device).

    Returns ``None`` when there is nothing to load, fewer than ``threshold`` tokens, or device
    memory cannot be found even after evicting unlocked device data.
    """
    nodes: list[TreeNode] = []
    walk = node
    while walk.parent is not None:
        cd = walk.data[_FULL]
        assert cd is not None
        if cd.value is not None:
            break
        if cd.host_value is None:
            return None
        nodes.append(walk)
        walk = walk.parent
    if not nodes:
        return None
    nodes.reverse()
    tokens = sum(n.key_len for n in nodes)
    if tokens < max(threshold, 1):
        return None
    full = cache.full
    for n in nodes:
        full.host_lock(n, 1)
    anchor = walk
    receipt = cache.inc_lock_ref(anchor)
    alloc = cache.token_to_kv_pool_allocator
    device = alloc.alloc(tokens)
    if device is None:
        params = EvictParams(num_tokens=max(0, tokens - alloc.available_size()))
        for c in cache.components:
            params = c.add_alloc_shortfall(params, tokens)
        cache.evict(params)
        device = alloc.alloc(tokens)
    if device is None:
        for n in nodes:
            host_lock(cache, n, -1)  # re-enters the host heap if it is an evictable leaf again
        cache.dec_lock_ref(anchor, receipt.to_dec_params())
        return None
    items: list[tuple[int, TransferItem]] = []
    pos = 0
    for i, n in enumerate(nodes):
        part = device[pos : pos + n.key_len]
        pos += n.key_len
        for c in cache.components:
            item = c.load_target(n, part)
            if item is not None:
                items.append((i, item))
    return LoadTicket(nodes, [n.key_len for n in nodes], items, anchor, receipt, device, tokens)


def copy_load_back(tier: HostTier, ticket: LoadTicket) -> None:
    """Copy the ticket's host bytes to device (no tree access: safe in a worker thread)."""
    for _, item in ticket.items:
        tier.load(item.component, item.host, item.device)


def finish_load_back(cache: UnifiedRadixCache, ticket: LoadTicket, ok: bool = True) -> int:
    """Commit (``ok``) or drop the loaded device slots, unpin; returns tokens loaded."""
    full = cache.full
    for i, item in ticket.items:
        comp = cache.component(item.component)
        pieces = pieces_of(ticket.nodes[i], ticket.lengths[i])
        if ok:
            comp.commit_load(pieces, item.device)
        else:
            comp.abort_load(pieces, item.device)
    for i, n in enumerate(ticket.nodes):
        for piece in pieces_of(n, ticket.lengths[i]):
            host_lock(cache, piece, -1)  # an unpinned host-only leaf is evictable again
    cache.dec_lock_ref(ticket.anchor, ticket.anchor_receipt.to_dec_params())
    bottom = ticket.nodes[-1]
    if bottom.heap_entry is None and full.is_device_leaf(bottom):
        full.note_leaf(bottom)
    if not ok:
        return 0
    cache.counters.loaded_back_tokens += ticket.tokens
    return ticket.tokens


def load_back(cache: UnifiedRadixCache, node: TreeNode, threshold: int = 0) -> int:
    """Load the host-only part of the path to ``node`` back to device synchronously; returns
    the tokens loaded (0 when skipped)."""
    ticket = start_load_back(cache, node, threshold)
    if ticket is None:
        return 0
    assert cache.host_tier is not None
    copy_load_back(cache.host_tier, ticket)
    return finish_load_back(cache, ticket)


# ---------------------------------------------------------------------- host eviction
def evict_host(cache: UnifiedRadixCache, num_tokens: int) -> int:
    """Free host-only leaves without host locks, oldest first, cascading to ancestors left
    empty, until ``num_tokens`` Full host tokens are freed; returns the tokens freed."""
    if num_tokens <= 0:
        return 0
    tracker = [0] * NUM_COMPONENT_TYPES
    cache.full.drive_host_eviction(num_tokens, tracker)
    evicted = cache.counters.evicted
    for c in cache.components:
        n = tracker[c.component_type]
        if n:
            key = (c.component_type, Tier.HOST)
            evicted[key] = evicted.get(key, 0) + n
    return tracker[_FULL]


def evict_host_leaf(cache: UnifiedRadixCache, node: TreeNode, tracker: list[int]) -> None:
    """Free every host copy of the host-only leaf ``node`` and delete it."""
    for events in cache.tier_events:
        events.host_evicted(node)
    for c in cache.components:
        cd = node.data[c.component_type]
        assert cd is not None
        if cd.host_value is not None:
            tracker[c.component_type] += c.evict_host(node)
    parent = node.parent
    assert parent is not None
    cache.delete_leaf(node)
    drop_if_empty(cache, parent, tracker)


def host_lock(cache: UnifiedRadixCache, node: TreeNode, delta: int) -> None:
    """Add ``delta`` to ``node``'s Full host lock (pins its host copy against eviction)."""
    cd = node.data[_FULL]
    assert cd is not None
    if delta < 0 and cd.host_lock_ref + delta < 0:
        raise InvalidLockError(f"dec_host_lock_ref on node {node.id}, which is not host-locked")
    cache.full.host_lock(node, delta)
    if delta < 0 and not node.in_host_heap and cache.full.is_host_leaf(node):
        cache.full.note_host_leaf(node)


def host_unlock_pieces(cache: UnifiedRadixCache, node: TreeNode, length: int) -> None:
    """Release a host lock taken on ``node`` when it was ``length`` long (a split since then
    copied the lock onto every piece of the span)."""
    for piece in pieces_of(node, length):
        host_lock(cache, piece, -1)


# ---------------------------------------------------------------------- lower tiers (L3)
def host_prefix(cache: UnifiedRadixCache, key: RadixKey) -> tuple[int, TreeNode]:
    """The longest page-aligned prefix of ``key`` whose tokens all have Full host copies, and
    the deepest node it reaches (the root when none).  Read-only: nothing is split, no access
    time or counter changes (the prefix may end inside the returned node)."""
    tree = cache.tree
    tokens = tree.tokens_of(key)
    n = len(tokens)
    node = tree.root
    pos = 0
    while pos < n:
        child = node.children.get(tree.child_key(node, tokens, pos, key.extra_key))
        if child is None:
            break
        cd = child.data[_FULL]
        assert cd is not None
        if cd.host_value is None:
            break
        m = tree.match_len(child.key, tokens, pos)
        if m == 0:
            break
        pos += m
        node = child
        if m < child.key_len:
            break
    return pos, node


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


def _release_parts(
    cache: UnifiedRadixCache, aux: Mapping[ComponentType, Sequence[HostPart]]
) -> None:
    """Free the rows of every part that no node took."""
    tier = cache.host_tier
    assert tier is not None
    for ct, parts in aux.items():
        for part in parts:
            n = int(part.host.shape[0])
            if not n:
                continue
            if not part.taken:
                tier.host_free(ct, part.host)
                continue
            keep = torch.ones(n, dtype=torch.bool)
            for a, b in part.taken:
                keep[a:b] = False
            if bool(keep.any()):
                tier.host_free(ct, part.host[keep])


def _commit_aux(
    cache: UnifiedRadixCache,
    node: TreeNode,
    pos: int,
    aux: Mapping[ComponentType, Sequence[HostPart]],
) -> None:
    for ct, parts in aux.items():
        if parts:
            cache.component(ct).commit_host_insert(node, pos, parts)


def insert_host(
    cache: UnifiedRadixCache,
    key: RadixKey,
    host_value: torch.Tensor,
    start: int,
    aux: Mapping[ComponentType, Sequence[HostPart]] | None = None,
) -> int:
    """Attach Full host data read from a lower tier for the tokens ``[start, end)`` of
    ``key`` (``end = start + len(host_value)``, both page-aligned); the tree owns
    ``host_value``'s slots from now on.

    Walks the path like an insert (splitting nodes at ``start`` and where the key diverges).
    Host copies must form a chain from the root, so only a path whose nodes above ``start``
    all hold host copies takes the data: a node there without one (the tree changed since
    the caller looked) stops the walk and the rest is freed.  Past ``start``, a node with a
    host copy already keeps it (the duplicate slots are freed), a node only on device adopts
    the slots as its host copy (same key, same bytes), and the remainder becomes new
    host-only nodes (one, or a chain cut at the boundaries of the ``aux`` parts).

    ``aux`` (optional) holds other components' host data for the same span (see
    :class:`HostPart`); the tree owns those slots too.  Every node that gets Full host data
    here is offered them through its component's ``commit_host_insert``; what no node takes is
    freed.  Without ``aux`` other components get no data (their tombstones stay).  Returns
    the tokens placed on new nodes.
    """
    tier = cache.host_tier
    assert tier is not None, "insert_host needs a host tier"
    aux = aux or {}
    try:
        return _insert_host(cache, key, host_value, start, aux)
    finally:
        _release_parts(cache, aux)


def _insert_host(
    cache: UnifiedRadixCache,
    key: RadixKey,
    host_value: torch.Tensor,
    start: int,
    aux: Mapping[ComponentType, Sequence[HostPart]],
) -> int:
    tier = cache.host_tier
    assert tier is not None
    ps = cache.page_size
    end = start + int(host_value.shape[0])
    tree = cache.tree
    tokens = tree.tokens_of(key)
    assert start % ps == 0 and end % ps == 0 and end <= len(tokens), (start, end, len(tokens))
    tokens = tokens[:end]
    ns = key.extra_key
    full = cache.full
    node = tree.root
    pos = 0
    done = start  # tokens of host_value[: done - start] are placed or freed

    def release(a: int, b: int) -> None:
        if a < b:
            tier.host_free(ComponentType.FULL, host_value[a - start : b - start])

    while pos < end:
        child = node.children.get(tree.child_key(node, tokens, pos, ns))
        if child is None:
            break
        m = tree.match_len(child.key, tokens, pos)
        if m == 0:
            break
        if m < child.key_len:
            child = tree.split(child, m)
        if pos < start < pos + m:
            child = tree.split(child, start - pos)
            m = start - pos
        cd = child.data[_FULL]
        assert cd is not None
        if pos < start:
            if cd.host_value is None:
                break  # the host chain is broken above our data
        elif cd.host_value is not None:
            release(pos, pos + m)
            done = pos + m
        else:
            assert cd.value is not None, f"node {child.id} holds no Full data"
            cd.host_value = host_value[pos - start : pos + m - start]
            full.add_host(cd, m)
            _commit_aux(cache, child, pos, aux)
            done = pos + m
        pos += m
        node = child
    if not (pos < end and pos >= start and done == pos):
        release(done, end)
        return 0
    # The remainder: new host-only nodes, cut where an auxiliary part begins or ends.
    cuts = sorted(
        {b for parts in aux.values() for p in parts for b in (p.start, p.end) if pos < b < end}
    )
    first = pos
    leaf = node
    for b in [*cuts, end]:
        leaf = tree.new_node(node, tokens[pos:b], ns)
        cd = leaf.data[_FULL]
        assert cd is not None
        cd.host_value = host_value[pos - start : b - start]
        full.add_host(cd, b - pos)
        tree.link(node, leaf)
        _commit_aux(cache, leaf, pos, aux)
        node = leaf
        pos = b
    full.note_host_leaf(leaf)
    return end - first
