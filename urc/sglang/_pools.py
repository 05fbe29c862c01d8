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

__all__ = ["SGLangSlots"]


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
