"""SGLang's allocators as the slot pool urc's Full component frees into.

urc's Full component needs three things of its allocator: the bound on valid indices
(``size``), ``available_size()`` and ``free(indices)``.  SGLang's allocators number slots
from ``page_size`` up to ``size + page_size - 1`` (page 0 is the padding page, never handed
out), so the bound is ``size + page_size``; everything else is SGLang's allocator itself.
For hybrid SWA models the allocator is SGLang's paired Full/SWA allocator, whose ``free``
returns both halves of a slot (and only the Full half of one whose SWA half was already
freed), exactly as SGLang's own tree frees them.
"""

from __future__ import annotations

from typing import Any

import torch

from urc.errors import InvalidIndicesError, InvalidInputError
from urc.pools.swa import SWATokenSlotAllocator

__all__ = [
    "SGLangKVBuffers",
    "SGLangMambaSlots",
    "SGLangReqRows",
    "SGLangSWASlots",
    "SGLangSlots",
]


class SGLangSlots:
    """View of SGLang's ``token_to_kv_pool_allocator`` with urc's allocator surface."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.page_size: int = allocator.page_size
        # The exclusive bound of a valid slot index (see the module docstring).
        self.size: int = allocator.size + allocator.page_size
        self.free = allocator.free

    def available_size(self) -> int:
        return int(self.allocator.available_size())

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        out: torch.Tensor | None = self.allocator.alloc(num_tokens)
        return out


class SGLangReqRows:
    """SGLang's ``req_to_token_pool`` with the row surface urc's request layer uses
    (:mod:`urc.request_caching`: ``check_row``, ``read``, ``write``).  SGLang allocates and
    frees the rows itself; its table may hold int32 slots, read here as int64."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.req_to_token: torch.Tensor = pool.req_to_token
        self.size: int = pool.size
        self.max_context_len: int = pool.max_context_len

    def check_row(self, row: object) -> int:
        """``row`` when it indexes SGLang's table; :class:`InvalidInputError` otherwise."""
        if not isinstance(row, int) or not 0 <= row < self.req_to_token.shape[0]:
            raise InvalidInputError(f"request row {row!r} is not a row of SGLang's pool")
        return row

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of tokens ``[start, end)`` of ``row`` (an int64 copy)."""
        return self.req_to_token[row, start:end].to(dtype=torch.int64, copy=True)

    def write(self, row: int, start: int, indices: torch.Tensor) -> None:
        """Store ``indices`` as the slots of tokens ``[start, start + len)`` of ``row``."""
        self.pool.write((row, slice(start, start + indices.shape[0])), indices)


class SGLangSWASlots(SWATokenSlotAllocator):
    """SGLang's paired Full/SWA allocator (``SWATokenToKVPoolAllocator``) with the surface
    urc's SWA component uses.  Every method is SGLang's allocator underneath (none of the
    base class's own state exists: the base is named for the component's type check).

    SGLang maps a Full slot to its SWA slot in ``full_to_swa_index_mapping`` (0: no SWA
    slot, an SWA tombstone); urc reads -1 for that.  SGLang frees a slot whose SWA half is
    gone with ``free_full`` and one with both halves with ``free`` (each checks which it
    got), so :meth:`free` splits a span by its mapping.
    """

    # The insert's ownership check and range-free shortcut are urc's pools' own, as are the
    # page states of tree ownership (issue 33): SGLang's allocator keeps none.
    check_owned = None  # type: ignore[assignment]
    claim_value = None  # type: ignore[assignment]
    check_held = None  # type: ignore[assignment]
    adopt = None  # type: ignore[assignment]
    num_tree_slots = None  # type: ignore[assignment]

    def __init__(self, allocator: Any) -> None:  # no super().__init__: see the docstring
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.size = allocator.size_full + allocator.page_size
        self.swa_size = allocator.size_swa
        self.device = torch.device(allocator.device)
        self._mapping: torch.Tensor = allocator.full_to_swa_index_mapping

    # ------------------------------------------------------------------ sizes
    def available_size(self) -> int:
        return int(self.allocator.full_available_size())

    def full_available_size(self) -> int:
        return int(self.allocator.full_available_size())

    def swa_available_size(self) -> int:
        return int(self.allocator.swa_available_size())

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Paired Full and SWA slots for ``num_tokens`` (whole pages), or None.  (SGLang's
        own ``alloc`` serves page size 1 only; its paged requests allocate per request.)"""
        a = self.allocator
        if self.page_size == 1:
            out: torch.Tensor | None = a.alloc(num_tokens)
            return out
        if num_tokens > a.full_available_size() or num_tokens > a.swa_available_size():
            return None
        full = a.full_attn_allocator.alloc(num_tokens)
        swa = a.swa_attn_allocator.alloc(num_tokens)
        assert full is not None and swa is not None
        a.set_full_to_swa_mapping(full, swa)
        return full  # type: ignore[no-any-return]

    def free(self, indices: torch.Tensor) -> None:
        if indices.shape[0] == 0:
            return
        mapped = self._mapping[indices] > 0
        if bool(mapped.all()):
            self.allocator.free(indices)
        elif not bool(mapped.any()):
            self.allocator.free_full(indices)
        else:
            self.allocator.free(indices[mapped])
            self.allocator.free_full(indices[~mapped])

    def free_span(self, indices: torch.Tensor, start: int, end: int, checked: Any = None) -> None:
        self.free(indices[start:end])

    def free_owned(self, indices: torch.Tensor) -> None:
        self.free(indices)

    def flush(self) -> None:
        """Nothing is queued: every free goes to SGLang's allocator at once."""

    def use_page_ops(self, impl: Any) -> None:
        """urc's page bookkeeping is not used (SGLang's allocator keeps its own)."""

    def check_consistency(self) -> None:
        """SGLang's allocator checks itself on every free."""

    def free_swa(self, full_idx: torch.Tensor) -> int:
        """Free the SWA halves ``full_idx`` still maps (the Full halves stay); returns
        the SWA tokens freed."""
        if full_idx.shape[0] == 0:
            return 0
        mapped = full_idx[self._mapping[full_idx] > 0]
        if mapped.shape[0]:
            self.allocator.free_swa(mapped)
        return int(mapped.shape[0])

    def free_swa_owned(self, full_idx: torch.Tensor) -> None:
        self.free_swa(full_idx)

    def release_swa(self, full_idx: torch.Tensor) -> int:
        """The tree's SWA frees (tombstones, a load's slots): :meth:`free_swa`."""
        return self.free_swa(full_idx)

    def move_swa(self, dst_full: torch.Tensor, src_full: torch.Tensor) -> None:
        """Give ``src_full``'s SWA slots to ``dst_full`` (which maps none)."""
        mapping = self._mapping
        assert bool((mapping[dst_full] == 0).all()), "move_swa onto slots that map SWA"
        mapping[dst_full] = mapping[src_full]
        mapping[src_full] = 0

    # ------------------------------------------------------------------ translation
    def translate(self, full_idx: torch.Tensor) -> torch.Tensor:
        swa = self._mapping[full_idx]
        return torch.where(swa > 0, swa, -1)

    def swa_mapped(self, full_idx: torch.Tensor) -> bool:
        return full_idx.shape[0] == 0 or bool((self._mapping[full_idx] > 0).all())

    def num_swa_mapped(self, full_idx: torch.Tensor) -> int:
        return int((self._mapping[full_idx] > 0).sum()) if full_idx.shape[0] else 0


class SGLangMambaSlots:
    """SGLang's Mamba state slots (``HybridReqToTokenPool``: its ``mamba_allocator`` and
    ``mamba_pool``) with the surface of urc's :class:`~urc.pools.mamba.MambaPool` that urc's
    Mamba component uses.  SGLang numbers slots from 1; which slots the tree owns is kept
    here (SGLang's allocator only knows free and taken)."""

    conv = None  # host mirrors are for urc's own HiCache tiers, not wired here
    temporal = None

    def __init__(self, req_to_token_pool: Any) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = req_to_token_pool.mamba_allocator
        self.size: int = self.allocator.size + 1
        self.device = torch.device(self.allocator.device)
        self.index_device = self.device  # SGLang's slot indices live with its states
        self._tree: set[int] = set()

    def _tensor(self, slots: Any) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return int(self.allocator.available_size())

    def alloc_slot(self) -> int | None:
        out = self.allocator.alloc(1)
        return None if out is None else int(out[0])

    def free_slots(self, slots: Any) -> None:
        slots = list(slots)
        if slots:
            self.allocator.free(self._tensor(slots))

    def check_held(self, slot: int, what: str = "Mamba slot") -> None:
        """Raise :class:`~urc.errors.InvalidIndicesError` unless ``slot`` is taken and not
        the tree's (a slot a request holds)."""
        if not 0 < slot < self.size:
            raise InvalidIndicesError(f"{what} {slot} outside [1, {self.size})")
        if slot in self._tree:
            raise InvalidIndicesError(f"{what} {slot} is owned by the tree")
        if bool((self.allocator.free_slots == slot).any()):
            raise InvalidIndicesError(f"{what} {slot} is not allocated")

    def is_held(self, slot: int) -> bool:
        """Whether ``slot`` is taken and not the tree's (what :meth:`check_held` accepts)."""
        return (
            0 < slot < self.size
            and slot not in self._tree
            and not bool((self.allocator.free_slots == slot).any())
        )

    def adopt(self, slot: int) -> None:
        self._tree.add(slot)

    def release_tree_slot(self, slot: int) -> None:
        self._tree.remove(slot)
        self.allocator.free(self._tensor((slot,)))

    def is_tree_owned(self, slot: int) -> bool:
        return slot in self._tree

    def num_tree_owned(self) -> int:
        return len(self._tree)

    def copy(self, src: int, dst: int) -> None:
        """Copy state ``src`` into ``dst`` (SGLang's physical slots)."""
        translate = self.req_to_token_pool.translate_mamba_indices
        self.req_to_token_pool.mamba_pool.copy_from(
            translate(self._tensor((src,))), translate(self._tensor((dst,)))
        )

    def clear(self) -> None:
        self._tree.clear()

    def check_consistency(self) -> None:
        """Every tree-owned slot is taken in SGLang's allocator."""
        free = set(self.allocator.free_slots.tolist())
        shared = self._tree & free
        assert not shared, f"tree-owned Mamba slots {sorted(shared)[:8]} are free in SGLang"


class SGLangKVBuffers:
    """The device KV of SGLang's ``MHATokenToKVPool`` (one K and one V tensor per layer,
    indexed by slot) as urc's host tier mirrors it (``slot_buffers``).  As the ``kv_pool``
    of urc's SWA pools entry (``CachePools.swa``) it stands for the SWA half of an
    ``SWAKVPool``."""

    def __init__(self, kv_pool: Any) -> None:
        self.kv_pool = kv_pool

    def slot_buffers(self) -> list[tuple[torch.Tensor, int]]:
        return [(t, 0) for t in [*self.kv_pool.k_buffer, *self.kv_pool.v_buffer]]

    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t, _ in self.slot_buffers())
