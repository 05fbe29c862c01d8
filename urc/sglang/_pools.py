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

from urc.pools.swa import SWATokenSlotAllocator

__all__ = ["SGLangSWASlots", "SGLangSlots"]


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


class SGLangSWASlots(SWATokenSlotAllocator):
    """SGLang's paired Full/SWA allocator (``SWATokenToKVPoolAllocator``) with the surface
    urc's SWA component uses.  Every method is SGLang's allocator underneath (none of the
    base class's own state exists: the base is named for the component's type check).

    SGLang maps a Full slot to its SWA slot in ``full_to_swa_index_mapping`` (0: no SWA
    slot, an SWA tombstone); urc reads -1 for that.  SGLang frees a slot whose SWA half is
    gone with ``free_full`` and one with both halves with ``free`` (each checks which it
    got), so :meth:`free` splits a span by its mapping.
    """

    # The insert's ownership check and range-free shortcut are urc's pools' own.
    check_owned = None  # type: ignore[assignment]

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
        out: torch.Tensor | None = self.allocator.alloc(num_tokens)
        return out

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
