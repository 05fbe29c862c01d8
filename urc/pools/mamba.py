"""Mamba state pool: per-slot conv and temporal (SSM) state tensors, and their allocator.

A Mamba/SSM layer carries a fixed-size recurrent state per sequence instead of per-token KV.
The pool holds ``size`` such states; a slot index names one.  Every slot is in exactly one
state, kept per slot by the pool::

    FREE   on the free list
    HELD   allocated to a caller: a running request (``Req.mamba_pool_idx``, its ping-pong
           tracking buffer), or whoever called ``alloc``; the caller frees it
    TREE   owned by one tree node (``MambaComponent`` adopted it on insert); only eviction
           frees it, so ``free``/``copy`` into such a slot is a :class:`TreeOwnedSlotError`

Layout: ``conv`` is ``[size, *conv_shape]`` and ``temporal`` is ``[size, *ssm_shape]`` (a real
model would add a layer dimension; it changes nothing here).

Costs: ``alloc``/``free`` of ``n`` slots are O(n) list operations plus at most one torch call
(building or reading the index tensor).  The per-slot state is a ``bytearray``, so a double
free, a free of a never-allocated slot or of a tree-owned slot is an error that changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from urc.errors import ConfigError, DoubleFreeError, InvalidIndicesError, TreeOwnedSlotError
from urc.pools.counts import slot_count
from urc.pools.indices import INDEX_DEVICE, index_tensor

__all__ = ["MambaPool"]

SlotIndex = int | torch.Tensor

# Per-slot states (see the module docstring).
_FREE = 0
_HELD = 1
_TREE = 2


class MambaPool:
    """``size`` Mamba state slots with an explicit-free allocator.

    Public index arguments are int64 tensors (any shape; a 0-d tensor is one slot) on the
    host (``index_device``: :mod:`urc.pools.indices`), or plain ints; ``conv`` and
    ``temporal`` live on ``device``.  Every method validates its whole input before changing
    anything: an index outside ``[0, size)`` raises :class:`InvalidIndicesError`, freeing a
    slot that is not allocated (or the same slot twice in one call) raises
    :class:`DoubleFreeError`, freeing a tree-owned slot :class:`TreeOwnedSlotError`.
    """

    __slots__ = ("_free", "_state", "conv", "device", "index_device", "size", "temporal")

    def __init__(
        self,
        size: int,
        conv_shape: Sequence[int],
        ssm_shape: Sequence[int],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if size <= 0:
            raise ConfigError(f"Mamba pool size must be positive, got {size}")
        if not conv_shape or not ssm_shape or min(*conv_shape, *ssm_shape) <= 0:
            raise ConfigError(
                f"Mamba state shapes must be non-empty and positive: {conv_shape}, {ssm_shape}"
            )
        self.size = size
        self.device = torch.device(device)
        self.index_device = INDEX_DEVICE
        self.conv = torch.zeros((size, *conv_shape), dtype=dtype, device=self.device)
        self.temporal = torch.zeros((size, *ssm_shape), dtype=dtype, device=self.device)
        self.clear()

    def clear(self) -> None:
        """Mark every slot free (drops all outstanding allocations; state bytes are kept)."""
        # A stack: slot 0 is handed out first.
        self._free: list[int] = list(range(self.size - 1, -1, -1))
        self._state = bytearray(self.size)

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        """Number of slots."""
        return self.size

    def available_size(self) -> int:
        """Number of free slots."""
        return len(self._free)

    # ------------------------------------------------------------------ alloc / free
    def alloc_slot(self) -> int | None:
        """Take one slot; its index, or ``None`` when the pool is exhausted (no torch call)."""
        free = self._free
        if not free:
            return None
        slot = free.pop()
        self._state[slot] = _HELD
        return slot

    def alloc(self, num: int = 1) -> torch.Tensor | None:
        """Take ``num`` slots as a 1-D int64 tensor; ``None`` (nothing taken) if too few."""
        num = slot_count(num, "num")
        free = self._free
        if num > len(free):
            return None
        slots = free[len(free) - num :]
        del free[len(free) - num :]
        slots.reverse()
        state = self._state
        for s in slots:
            state[s] = _HELD
        return index_tensor(slots, self.index_device)

    def free(self, indices: SlotIndex) -> None:
        """Return the caller-held slots ``indices`` to the pool (all or nothing)."""
        self.free_slots(self.to_slots(indices))

    def free_slots(self, slots: Sequence[int]) -> None:
        """:meth:`free` for plain ints (all validated before any is freed)."""
        state = self._state
        size = self.size
        for s in slots:
            if not 0 <= s < size:
                raise InvalidIndicesError(f"Mamba slot {s} outside [0, {size})")
            st = state[s]
            if st != _HELD:
                if st == _TREE:
                    raise TreeOwnedSlotError(f"freeing Mamba slot {s}, which the tree owns")
                raise DoubleFreeError(f"freeing Mamba slot {s}, which is not allocated")
        if len(slots) > 1 and len(set(slots)) != len(slots):
            raise DoubleFreeError(f"Mamba slots freed twice in one call: {list(slots)}")
        for s in slots:
            state[s] = _FREE
        self._free.extend(slots)

    def check_held(self, slot: int, what: str = "Mamba slot") -> None:
        """Raise unless ``slot`` is in range and held by a caller (not free, not the tree's)."""
        if not 0 <= slot < self.size:
            raise InvalidIndicesError(f"{what} {slot} outside [0, {self.size})")
        st = self._state[slot]
        if st != _HELD:
            if st == _TREE:
                raise TreeOwnedSlotError(f"{what} {slot} is owned by the tree")
            raise InvalidIndicesError(f"{what} {slot} is not allocated")

    def is_held(self, slot: int) -> bool:
        """Whether ``slot`` is in range and held by a caller (not free, not the tree's)."""
        return 0 <= slot < self.size and self._state[slot] == _HELD

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is in range and allocated (held by a caller or owned by the tree)."""
        return 0 <= slot < self.size and self._state[slot] != _FREE

    def is_tree_owned(self, slot: int) -> bool:
        """Whether ``slot`` is in range and owned by the tree."""
        return 0 <= slot < self.size and self._state[slot] == _TREE

    # ------------------------------------------------------------------ tree ownership
    # Called by MambaComponent only; the caller has validated ``slot``.
    def adopt(self, slot: int) -> None:
        """A held slot becomes the tree's (an insert stored it on a node)."""
        assert self._state[slot] == _HELD, (
            f"adopting Mamba slot {slot} in state {self._state[slot]}"
        )
        self._state[slot] = _TREE

    def release_tree_slot(self, slot: int) -> None:
        """Free a tree-owned slot (its node's state was evicted)."""
        assert self._state[slot] == _TREE, f"Mamba slot {slot} is not tree-owned"
        self._state[slot] = _FREE
        self._free.append(slot)

    def num_tree_owned(self) -> int:
        """Number of tree-owned slots (O(size); for sanity checks)."""
        return self._state.count(_TREE)

    def to_slots(self, indices: SlotIndex) -> list[int]:
        """``indices`` as a list of in-range ints (``InvalidIndicesError`` otherwise)."""
        if isinstance(indices, int) and not isinstance(indices, bool):
            slots = [indices]
        elif isinstance(indices, torch.Tensor):
            if indices.dtype != torch.int64 or indices.device != self.index_device:
                raise InvalidIndicesError(
                    f"Mamba slot indices must be int64 on {self.index_device}, "
                    f"got {indices.dtype} on {indices.device}"
                )
            slots = indices.reshape(-1).tolist()
        else:
            raise InvalidIndicesError(f"Mamba slot indices must be a tensor or int: {indices!r}")
        size = self.size
        for s in slots:
            if not 0 <= s < size:
                raise InvalidIndicesError(f"Mamba slot {s} outside [0, {size})")
        return slots

    # ------------------------------------------------------------------ state data
    def copy(self, src: SlotIndex, dst: SlotIndex) -> None:
        """Copy the conv and temporal state of slots ``src`` into slots ``dst`` (pairwise).

        ``src`` must be allocated (held or tree-owned), ``dst`` held by the caller and without
        repeats, both of the same count; otherwise :class:`InvalidIndicesError` (or its
        subclass :class:`TreeOwnedSlotError` for a tree-owned target), nothing copied.
        """
        s = self.to_slots(src)
        d = self.to_slots(dst)
        if len(s) != len(d) or len(set(d)) != len(d):
            raise InvalidIndicesError(f"copy needs equal counts and distinct targets: {s} -> {d}")
        state = self._state
        for slot in s:
            if state[slot] == _FREE:
                raise InvalidIndicesError(f"copy source Mamba slot {slot} is not allocated")
        for slot in d:
            self.check_held(slot, "copy target Mamba slot")
        if len(s) == 1:
            a, b = s[0], d[0]
            if a != b:
                self.conv[b].copy_(self.conv[a])
                self.temporal[b].copy_(self.temporal[a])
            return
        si = torch.tensor(s, dtype=torch.int64, device=self.device)
        di = torch.tensor(d, dtype=torch.int64, device=self.device)
        self.conv.index_copy_(0, di, self.conv.index_select(0, si))
        self.temporal.index_copy_(0, di, self.temporal.index_select(0, si))

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the (conv, temporal) states of the slots ``indices`` (1-D int64)."""
        idx = indices.to(self.device, non_blocking=True)
        return self.conv.index_select(0, idx), self.temporal.index_select(0, idx)

    def scatter(self, indices: torch.Tensor, conv: torch.Tensor, temporal: torch.Tensor) -> None:
        """Write states (as returned by :meth:`gather`) into the slots ``indices``."""
        idx = indices.to(self.device, non_blocking=True)
        self.conv.index_copy_(0, idx, conv)
        self.temporal.index_copy_(0, idx, temporal)

    # ------------------------------------------------------------------ checks
    def check_consistency(self) -> None:
        """Assert the free list and the allocation flags agree (O(size); for sanity checks)."""
        free = self._free
        state = self._state
        assert len(set(free)) == len(free), "a Mamba slot is listed free twice"
        n_free = state.count(_FREE)
        assert n_free == len(free), f"{n_free} Mamba slots marked free, {len(free)} listed"
        assert all(state[s] == _FREE for s in free), "a listed free Mamba slot is allocated"
        assert n_free + state.count(_HELD) + state.count(_TREE) == self.size, "bad slot state"
