"""``HostTierHooks``: the host-tier (HiCache) hooks of a
:class:`~urc.components.base.TreeComponent`.

A part of the component interface kept in a file of its own: the hooks through which the
core's host transfers (:mod:`urc.host.transfers`) and host eviction reach each component's
data.  :class:`~urc.components.base.TreeComponent` inherits them; read the hooks there as one
interface.  Every hook here is called only when a host tier is attached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from urc.node import ComponentData, ComponentType, TreeNode

if TYPE_CHECKING:
    from urc.host_protocol import HostPart, HostTier, TransferItem
    from urc.params import EvictParams

__all__ = ["HostTierHooks"]


class HostTierHooks:
    """The host-tier hooks (see the module docstring); defaults serve a component whose
    host copy mirrors its device value one for one."""

    component_type: ClassVar[ComponentType]
    # Set by TreeComponent.__init__ / attach_host_tier.
    host_tier: HostTier | None
    host_evictable_size: int
    host_protected_size: int
    evictable_size: int
    protected_size: int

    if TYPE_CHECKING:  # defined by TreeComponent

        def value_len(self, data: ComponentData) -> int: ...

    def host_len(self, data: ComponentData) -> int:
        """Size of ``data``'s host copy in this component's unit (0 when there is none).

        Read-only; used by ``sanity_check``, ``host_lock`` and ``evict_host``.

        - Full, SWA: default (tokens).  Mamba: default (a 1-row host copy: 1 state).
        """
        hv = data.host_value
        return 0 if hv is None else int(hv.shape[0])

    def backup_source(self, node: TreeNode) -> torch.Tensor | None:
        """Device slots (in this component's own pool) to copy to host when ``node`` is
        backed up, or ``None`` when there is nothing to back up.  Default: the device value,
        if it has no host copy yet.  Read-only; ``start_backup`` reserves as many host units.

        - Full: default (its token slots).
        - SWA: default (its SWA slots; a tombstone has none).
        - Mamba: default (the 1-element state slot).
        """
        cd = node.data[self.component_type]
        assert cd is not None
        return cd.value if cd.host_value is None else None

    def commit_backup(
        self, pieces: Sequence[TreeNode], host: torch.Tensor, source: torch.Tensor
    ) -> None:
        """The copy of ``source`` (what ``backup_source`` returned) into ``host`` finished:
        attach ``host`` to ``pieces`` (the node, possibly split since the backup started;
        top-down).  Default for per-token data: slice by piece length; a piece whose device
        data is no longer ``source``'s (lost or replaced despite the backup's locks) or that
        already has a host copy gets none (its host slots are freed).  Called by
        ``finish_backup``; adds to the host sizes.

        - Full, SWA: default.
        - Mamba: the bottom piece only, if it still holds that same slot and no host copy.
        """
        tier = self.host_tier
        assert tier is not None
        ct = self.component_type
        pos = 0
        for piece in pieces:
            cd = piece.data[ct]
            assert cd is not None
            n = piece.key_len
            part = host[pos : pos + n]
            src = source[pos : pos + n]
            pos += n
            if cd.value is None or cd.host_value is not None or not torch.equal(cd.value, src):
                tier.host_free(ct, part)
                continue
            cd.host_value = part
            self.add_host(cd, n)

    def commit_host_insert(self, node: TreeNode, start: int, parts: Sequence[HostPart]) -> None:
        """``node`` (key positions ``[start, start + node.key_len)``) just got Full host data
        read from a lower tier (``urc.host.transfers.insert_host``); attach this component's host
        copy from ``parts`` if one fits, recording the rows taken in ``part.taken`` (the
        rest is freed by the caller).  Default for per-token data: the part that covers the
        whole node, sliced to it.  A node that already has a host copy keeps it.

        - Full: not called (``insert_host`` attaches Full's data itself).
        - SWA: default (no covering part: the node stays an SWA tombstone).
        - Mamba: a point part at the node's end (``part.start == part.end``), whole.
        """
        cd = node.data[self.component_type]
        assert cd is not None
        if cd.host_value is not None:
            return
        end = start + node.key_len
        for part in parts:
            if part.start <= start and end <= part.end:
                a, b = start - part.start, end - part.start
                cd.host_value = part.host[a:b]
                self.add_host(cd, node.key_len)
                part.taken.append((a, b))
                return

    def add_host(self, cd: ComponentData, n: int) -> None:
        """Count ``n`` units of host data just placed on ``cd`` (protected when host-locked,
        else evictable); the caller set ``cd.host_value``.  A helper of the commit hooks
        (and of ``insert_host`` for Full).

        - Full, SWA, Mamba: default.
        """
        if cd.host_lock_ref:
            self.host_protected_size += n
        else:
            self.host_evictable_size += n

    def load_target(self, node: TreeNode, full_device: torch.Tensor) -> TransferItem | None:
        """The copy that restores ``node``'s data on load-back: host slots to read and device
        slots to fill (allocate them here if this component has a pool of its own), or
        ``None`` when there is nothing to load.  ``full_device`` are the Full slots reserved
        for the node.  Default: per-token data addressed by Full slots.  Called by
        ``start_load_back`` for each host-only node.

        - Full: default.
        - SWA: the SWA pages ``full_device`` maps; no host copy: ``None``, pages freed now.
        - Mamba: a fresh slot (may evict a state); ``None`` without a host state or a slot.
        """
        from urc.host_protocol import TransferItem

        cd = node.data[self.component_type]
        assert cd is not None
        if cd.host_value is None or cd.value is not None:
            return None
        return TransferItem(self.component_type, full_device, cd.host_value)

    def commit_load(self, pieces: Sequence[TreeNode], device: torch.Tensor) -> None:
        """The load-back copy into ``device`` finished: it becomes the device value of
        ``pieces`` (the node, possibly split since; top-down).  Default for per-token data:
        slice by piece length; a piece that got device data meanwhile keeps it.  Called by
        ``finish_load_back``; adds to the device sizes.

        - Full: default.
        - SWA: pieces whose Full value translates to ``device`` get SWA (restore-stamped).
        - Mamba: the bottom piece adopts the slot, unless it got a state (slot freed).
        """
        pos = 0
        for piece in pieces:
            cd = piece.data[self.component_type]
            assert cd is not None
            n = piece.key_len
            part = device[pos : pos + n]
            pos += n
            if cd.value is not None:
                self.release_load_slots(part)
                continue
            cd.value = part
            cd.on_device = True
            if cd.lock_ref:
                self.protected_size += self.value_len(cd)
            else:
                self.evictable_size += self.value_len(cd)

    def add_alloc_shortfall(self, params: EvictParams, num_tokens: int) -> EvictParams:
        """Allocating Full slots for ``num_tokens`` tokens (e.g. a load-back) failed; ``params``
        asks for the Full shortfall.  Returns ``params`` plus what this component must evict
        from device so that the allocation can succeed (a paired allocator also takes this
        component's slots).  Default: ``params``.  Called by ``eviction.alloc_tokens``.

        - Full: default (``params`` already asks for it).
        - SWA: raises ``swa_num_tokens`` to the page-rounded SWA shortfall.
        - Mamba: default (a Full allocation takes no state slot).
        """
        return params

    def abort_load(self, pieces: Sequence[TreeNode], device: torch.Tensor) -> None:
        """A load-back was dropped: free the slots ``load_target`` reserved.

        Called by ``finish_load_back(ok=False)`` instead of ``commit_load``.

        - Full, SWA, Mamba: default (``release_load_slots``).
        """
        self.release_load_slots(device)

    def release_load_slots(self, device: torch.Tensor) -> None:
        """Free load-back slots that will not be used (Full frees its token slots).

        Called by the default ``commit_load`` (a piece that got data meanwhile) and
        ``abort_load``.

        - Full: frees the token slots (and with them the SWA pages they map).
        - SWA: not overridden (Full's free releases its pages).
        - Mamba: frees the state slot.
        """

    def host_lock(self, node: TreeNode, delta: int) -> None:
        """Add ``delta`` (+1/-1) to ``node``'s host lock, moving host sizes accordingly.

        Called only on Full, by ``inc_host_lock_ref`` / ``dec_host_lock_ref``
        (``locking.host_lock``, which validates) and the load-back pins; the other kinds'
        host locks are never raised (a split copies a zero).

        - Full, SWA, Mamba: default.
        """
        cd = node.data[self.component_type]
        assert cd is not None
        before = cd.host_lock_ref
        cd.host_lock_ref = before + delta
        assert cd.host_lock_ref >= 0, f"node {node.id} host lock below zero"
        n = self.host_len(cd)
        if before == 0 and delta > 0:
            self.host_evictable_size -= n
            self.host_protected_size += n
        elif cd.host_lock_ref == 0 and delta < 0:
            self.host_evictable_size += n
            self.host_protected_size -= n

    def evict_host(self, node: TreeNode) -> int:
        """Free ``node``'s host copy of this component (it must not be host-locked).

        Returns the units freed.  Called by ``evict_host_leaf`` (host eviction) and
        ``UnifiedRadixCache.reset``; never unlinks the node.

        - Full, SWA, Mamba: default.
        """
        cd = node.data[self.component_type]
        assert cd is not None and cd.host_value is not None and cd.host_lock_ref == 0
        tier = self.host_tier
        assert tier is not None
        n = self.host_len(cd)
        tier.host_free(self.component_type, cd.host_value)
        cd.host_value = None
        self.host_evictable_size -= n
        return n

    def host_mirror_buffers(self) -> list[tuple[torch.Tensor, int]] | None:
        """This component's device data buffers as ``(tensor, slot dim)`` pairs, for a host
        mirror (``None``: no data to mirror).  Read by ``hicache``'s
        ``HostMemoryTier.for_cache`` to build the host pools (``None`` there: ``ConfigError``).

        - Full: the KV pool's slot buffers (``None`` without a KV pool).
        - SWA: the SWA KV pool's slot buffers.
        - Mamba: the conv and temporal state buffers, slot dim 0.
        """
        return None

    def host_capacity(self) -> int:
        """Capacity of this component's host pool, in its unit (0 without a host tier).

        Read by ``stats`` and ``check_pools``.

        - Full, SWA, Mamba: default (the tier's figure for ``component_type``).
        """
        tier = self.host_tier
        return 0 if tier is None else tier.host_capacity(self.component_type)

    def host_available(self) -> int:
        """Free units of this component's host pool (0 without a host tier).

        Read by ``stats`` and ``check_pools``.

        - Full, SWA, Mamba: default (the tier's figure for ``component_type``).
        """
        tier = self.host_tier
        return 0 if tier is None else tier.host_available(self.component_type)
