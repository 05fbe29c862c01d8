"""HiCache orchestration inside the core: backups, load-backs, host locks, lower-tier inserts.

Functions of a :class:`~urc.state.CacheState` with a host tier attached; the cache exposes
them as methods (``write_backup``, ``load_back``, ...; host eviction is in
:mod:`urc.eviction`).  Transfers are
two-phase (see :mod:`urc.host_protocol`): ``start_*`` and ``finish_*`` run where the tree is
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

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from urc.eviction import alloc_tokens, evict_host
from urc.host_protocol import BackupTicket, HostPart, HostTier, LoadTicket, TransferItem
from urc.key import RadixKey
from urc.locking import dec_lock_ref, host_lock, inc_lock_ref
from urc.matching import match_prefix
from urc.node import FULL_INDEX, ComponentType, TreeNode
from urc.params import MatchPrefixParams

if TYPE_CHECKING:
    from urc.params import IncLockRefResult
    from urc.state import CacheState

__all__ = [
    "copy_backup",
    "copy_load_back",
    "finish_backup",
    "finish_load_back",
    "host_alloc",
    "host_prefix",
    "host_unlock_pieces",
    "insert_host",
    "load_back",
    "note_hit",
    "pieces_of",
    "start_backup",
    "start_due_backups",
    "start_load_back",
    "start_load_back_of",
    "take_pending_backups",
    "write_backup",
]


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


def _record(
    record: Callable[[TreeNode], None], nodes: Sequence[TreeNode], lengths: Sequence[int]
) -> None:
    """KV events: ``record`` each piece of a finished transfer's nodes, top-down."""
    for n, length in zip(nodes, lengths, strict=True):
        if not n.deleted:
            for piece in pieces_of(n, length):
                record(piece)


def host_alloc(state: CacheState, ct: ComponentType, n: int) -> torch.Tensor | None:
    """Reserve ``n`` host units of ``ct``, evicting host-only leaves if needed (``None``
    when even that does not free enough)."""
    tier = state.host_tier
    assert tier is not None
    while tier.host_available(ct) < n:
        if evict_host(state, n - tier.host_available(ct)) == 0:
            break
    return tier.host_alloc(ct, n)


# ---------------------------------------------------------------------- backup
def note_hit(state: CacheState, node: TreeNode) -> None:
    """Write-through: an insert hit ``node``; at the policy's hit threshold a node on device
    without a host copy becomes due for backup (``pending_backups``; subscribers get
    ``backup_due``).

    The queue stays bounded: past twice the tree's nodes (plus a margin) the entries that
    no longer need a backup (evicted, deleted, backed up) are pruned, so a backup worker
    slower than the hits never keeps evicted nodes alive (amortized O(1) per hit)."""
    threshold = state.backup_threshold
    cd = node.data[FULL_INDEX]
    if (
        threshold is not None
        and node.hit_count >= threshold
        and cd is not None
        and cd.host_value is None
        and cd.value is not None
    ):
        pending = state.pending_backups
        pending[node.id] = node
        if len(pending) > 2 * state.tree.num_nodes + _PENDING_MARGIN:
            _prune_pending(pending)
        for events in state.tier_events:
            events.backup_due()


_PENDING_MARGIN = 64  # entries allowed past twice the tree's nodes before a prune


def _needs_backup(node: TreeNode) -> bool:
    cd = node.data[FULL_INDEX]
    assert cd is not None
    return not node.deleted and cd.value is not None and cd.host_value is None


def _prune_pending(pending: dict[int, TreeNode]) -> None:
    """Drop the entries that no longer need a backup, keeping the others' order."""
    for nid in [nid for nid, n in pending.items() if not _needs_backup(n)]:
        del pending[nid]


def take_pending_backups(state: CacheState, limit: int) -> list[TreeNode]:
    """Up to ``limit`` nodes due for backup that still need one, oldest first (removed
    from the queue): a node due long ago is not starved by newer ones."""
    out: list[TreeNode] = []
    pending = state.pending_backups
    while pending and len(out) < limit:
        _, node = pending.popitem(last=False)
        if _needs_backup(node):
            out.append(node)
    return out


def start_backup(state: CacheState, node: TreeNode) -> BackupTicket | None:
    """Reserve host slots for ``node`` and every ancestor without a host copy (parents are
    backed up before children) and pin them on device.

    Returns ``None`` when nothing needs backing up, an ancestor's backup is still in flight
    (try again after it finishes), or the host tier is full even after host eviction.
    """
    if node.deleted or node.parent is None:
        return None
    in_flight = state.backups_in_flight
    chain: list[TreeNode] = []
    walk = node
    while walk.parent is not None:
        cd = walk.data[FULL_INDEX]
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
    receipt = inc_lock_ref(state, chain[-1])
    pins = [inc_lock_ref(state, n) for n in chain[:-1]]
    items: list[tuple[int, TransferItem]] = []
    for i, n in enumerate(chain):
        for c in state.components:
            src = c.backup_source(n)
            if src is None or src.shape[0] == 0:
                continue
            host = host_alloc(state, c.component_type, int(src.shape[0]))
            if host is None:
                tier = state.host_tier
                assert tier is not None
                for _, item in items:
                    tier.host_free(item.component, item.host)
                _unpin(state, chain, receipt, pins)
                return None
            items.append((i, TransferItem(c.component_type, src, host)))
    for n in chain:
        in_flight.add(n.id)
    tokens = sum(n.key_len for n in chain)
    return BackupTicket(chain, [n.key_len for n in chain], items, receipt, tokens, pins)


def start_due_backups(state: CacheState, limit: int) -> list[BackupTicket]:
    """Start the backups of up to ``limit`` due nodes (oldest first): one ticket per node
    whose backup could start.  A node that could not (an ancestor's backup is in flight, or
    the host is full) goes back to the queue for the next wake-up (no busy loop)."""
    tickets = []
    retry = []
    for node in take_pending_backups(state, limit):
        ticket = start_backup(state, node)
        if ticket is not None:
            tickets.append(ticket)
        elif node.id not in state.backups_in_flight and not node.deleted:
            cd = node.data[FULL_INDEX]
            if cd is not None and cd.host_value is None and cd.value is not None:
                retry.append(node)
    for node in retry:
        state.pending_backups[node.id] = node
    return tickets


def _unpin(
    state: CacheState,
    chain: list[TreeNode],
    receipt: IncLockRefResult,
    pins: list[IncLockRefResult],
) -> None:
    dec_lock_ref(state, chain[-1], receipt.to_dec_params())
    for n, pin in zip(chain, pins, strict=False):
        dec_lock_ref(state, n, pin.to_dec_params())


def copy_backup(tier: HostTier, ticket: BackupTicket) -> None:
    """Copy the ticket's device bytes to host and wait until they have landed (no tree
    access: safe in a worker thread).  The copies are all issued before the first wait."""
    done = [tier.backup(item.component, item.device, item.host) for _, item in ticket.items]
    for d in done:
        d.wait()


def finish_backup(state: CacheState, ticket: BackupTicket, ok: bool = True) -> int:
    """Commit (``ok``) or drop the ticket's host copies and unpin; returns tokens backed up."""
    tier = state.host_tier
    assert tier is not None
    for i, item in ticket.items:
        if ok:
            pieces = pieces_of(ticket.nodes[i], ticket.lengths[i])
            state.by_type[item.component].commit_backup(pieces, item.host, item.device)
        else:
            tier.host_free(item.component, item.host)
    for n in ticket.nodes:
        state.backups_in_flight.discard(n.id)
    _unpin(state, ticket.nodes, ticket.receipt, ticket.pins)
    if not ok:
        return 0
    state.counters.backed_up_tokens += ticket.tokens
    if state.kv_events is not None:
        _record(state.kv_events.stored_on_host, ticket.nodes, ticket.lengths)
    if not ticket.nodes[-1].deleted:
        for events in state.tier_events:
            events.host_committed(ticket.nodes[-1])
    return ticket.tokens


def write_backup(state: CacheState, node: TreeNode) -> int:
    """Back ``node`` (and its ancestors without a host copy) up synchronously; returns the
    tokens backed up (0 when impossible)."""
    ticket = start_backup(state, node)
    if ticket is None:
        return 0
    assert state.host_tier is not None
    copy_backup(state.host_tier, ticket)
    return finish_backup(state, ticket)


# ---------------------------------------------------------------------- load-back
def start_load_back(state: CacheState, node: TreeNode, threshold: int = 0) -> LoadTicket | None:
    """Reserve device slots for the host-only nodes from ``node`` up to the first node on
    device, and pin them (host copies) and that anchor (device).

    Returns ``None`` when there is nothing to load, fewer than ``threshold`` tokens, or device
    memory cannot be found even after evicting unlocked device data.
    """
    nodes: list[TreeNode] = []
    walk = node
    while walk.parent is not None:
        cd = walk.data[FULL_INDEX]
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
    full = state.full
    for n in nodes:
        full.host_lock(n, 1)
    anchor = walk
    receipt = inc_lock_ref(state, anchor)
    device = alloc_tokens(state, tokens)
    if device is None:
        # Unpin through ``host_lock``, not ``full.host_lock``: the eviction inside
        # ``alloc_tokens`` may have run host eviction (write_back demotes device leaves),
        # which drops the pinned leaf's host-heap entry; ``host_lock`` puts an evictable
        # host leaf back (otherwise it is never host-evicted and sanity_check fails).
        for n in nodes:
            host_lock(state, n, -1)
        dec_lock_ref(state, anchor, receipt.to_dec_params())
        return None
    items: list[tuple[int, TransferItem]] = []
    pos = 0
    for i, n in enumerate(nodes):
        part = device[pos : pos + n.key_len]
        pos += n.key_len
        for c in state.components:
            item = c.load_target(n, part)
            if item is not None:
                items.append((i, item))
    return LoadTicket(nodes, [n.key_len for n in nodes], items, anchor, receipt, device, tokens)


def start_load_back_of(state: CacheState, key: RadixKey, threshold: int = 0) -> LoadTicket | None:
    """:func:`start_load_back` for the host continuation of ``key``'s cached prefix (its
    match's best node); ``None`` when the hit does not continue on host."""
    m = match_prefix(state, MatchPrefixParams(key=key))
    if m.host_hit_length == 0:
        return None
    return start_load_back(state, m.best_match_node, threshold)


def copy_load_back(tier: HostTier, ticket: LoadTicket) -> None:
    """Copy the ticket's host bytes to device and wait until the copies completed (their
    host slots are unpinned only after that; no tree access: safe in a worker thread)."""
    done = [tier.load(item.component, item.host, item.device) for _, item in ticket.items]
    for d in done:
        d.wait()


def finish_load_back(state: CacheState, ticket: LoadTicket, ok: bool = True) -> int:
    """Commit (``ok``) or drop the loaded device slots, unpin; returns tokens loaded."""
    full = state.full
    for i, item in ticket.items:
        comp = state.by_type[item.component]
        pieces = pieces_of(ticket.nodes[i], ticket.lengths[i])
        if ok:
            comp.commit_load(pieces, item.device)
        else:
            comp.abort_load(pieces, item.device)
    for i, n in enumerate(ticket.nodes):
        for piece in pieces_of(n, ticket.lengths[i]):
            host_lock(state, piece, -1)  # an unpinned host-only leaf is evictable again
    dec_lock_ref(state, ticket.anchor, ticket.anchor_receipt.to_dec_params())
    bottom = ticket.nodes[-1]
    if bottom.heap_entry is None and full.is_device_leaf(bottom):
        full.note_leaf(bottom)
    if not ok:
        return 0
    state.counters.loaded_back_tokens += ticket.tokens
    if state.kv_events is not None:
        _record(state.kv_events.stored_on_device, ticket.nodes, ticket.lengths)
    return ticket.tokens


def load_back(state: CacheState, node: TreeNode, threshold: int = 0) -> int:
    """Load the host-only part of the path to ``node`` back to device synchronously; returns
    the tokens loaded (0 when skipped)."""
    ticket = start_load_back(state, node, threshold)
    if ticket is None:
        return 0
    assert state.host_tier is not None
    copy_load_back(state.host_tier, ticket)
    return finish_load_back(state, ticket)


# ---------------------------------------------------------------------- host locks
def host_unlock_pieces(state: CacheState, node: TreeNode, length: int) -> None:
    """Release a host lock taken on ``node`` when it was ``length`` long (a split since then
    copied the lock onto every piece of the span)."""
    for piece in pieces_of(node, length):
        host_lock(state, piece, -1)


# ---------------------------------------------------------------------- lower tiers (L3)
def host_prefix(state: CacheState, key: RadixKey) -> tuple[int, TreeNode]:
    """The longest page-aligned prefix of ``key`` whose tokens all have Full host copies, and
    the deepest node it reaches (the root when none).  Read-only: nothing is split, no access
    time or counter changes (the prefix may end inside the returned node)."""
    tree = state.tree
    tokens = tree.tokens_of(key)
    n = len(tokens)
    node = tree.root
    pos = 0
    while pos < n:
        child = node.children.get(tree.child_key(node, tokens, pos, key.extra_key))
        if child is None:
            break
        cd = child.data[FULL_INDEX]
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


def _release_parts(state: CacheState, aux: Mapping[ComponentType, Sequence[HostPart]]) -> None:
    """Free the rows of every part that no node took."""
    tier = state.host_tier
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
    state: CacheState,
    node: TreeNode,
    pos: int,
    aux: Mapping[ComponentType, Sequence[HostPart]],
) -> None:
    for ct, parts in aux.items():
        if parts:
            state.by_type[ct].commit_host_insert(node, pos, parts)


def insert_host(
    state: CacheState,
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
    tier = state.host_tier
    assert tier is not None, "insert_host needs a host tier"
    aux = aux or {}
    try:
        return _insert_host(state, key, host_value, start, aux)
    finally:
        _release_parts(state, aux)


def _insert_host(
    state: CacheState,
    key: RadixKey,
    host_value: torch.Tensor,
    start: int,
    aux: Mapping[ComponentType, Sequence[HostPart]],
) -> int:
    tier = state.host_tier
    assert tier is not None
    ps = state.page_size
    end = start + int(host_value.shape[0])
    tree = state.tree
    tokens = tree.tokens_of(key)
    assert start % ps == 0 and end % ps == 0 and end <= len(tokens), (start, end, len(tokens))
    tokens = tokens[:end]
    ns = key.extra_key
    full = state.full
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
        cd = child.data[FULL_INDEX]
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
            _commit_aux(state, child, pos, aux)
            if state.kv_events is not None:
                state.kv_events.stored_on_host(child)
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
        cd = leaf.data[FULL_INDEX]
        assert cd is not None
        cd.host_value = host_value[pos - start : b - start]
        full.add_host(cd, b - pos)
        tree.link(node, leaf)
        _commit_aux(state, leaf, pos, aux)
        if state.kv_events is not None:
            state.kv_events.stored_on_host(leaf)
        node = leaf
        pos = b
    full.note_host_leaf(leaf)
    return end - first
