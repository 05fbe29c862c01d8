"""urc's host page rows as SGLang HiCache's per-page L3 payload, and back.

SGLang's ``page_first`` host pool (``MHATokenToKVPoolHost``, 0.5.23) stores one L3 page as
``kv_buffer[:, index : index + page_size].flatten()``: ``[2 (K, V), page_size, layers, heads,
head_dim]``.  urc's :class:`~hicache.storage_worker.layout.HostPageLayout` gathers a page as
its host buffers' blocks one after the other:

- a KV pool with one ``[2, layers, slots, heads, dim]`` buffer (urc's ``KVPool``), held in
  either host layout: two blocks, K then V, each ``[page_size, layers, heads, dim]`` --
  already SGLang's payload, so nothing is converted;
- per-layer K and V buffers with slot dim 0 (SGLang's own device pools under the plug-in,
  mirrored as they are): ``2 x layers`` blocks of ``[page_size, heads, dim]``, i.e.
  ``[2, layers, page_size, ...]``, which differs from SGLang's by swapping the page and
  layer axes.

This module is the one place that knows it: :meth:`SGLangPagePayload.to_sglang` and
:meth:`~SGLangPagePayload.from_sglang` (``identity`` tells the caller no copy is needed).
"""

from __future__ import annotations

import torch

from hicache.storage_worker.layout import HostPageLayout
from urc.errors import ConfigError

__all__ = ["SGLangPagePayload"]


class SGLangPagePayload:
    """Converts ``[pages, page_bytes]`` uint8 rows between urc's host page layout and
    SGLang's ``page_first`` payload (both directions copy; the input is not mutated).

    ``layers`` counts the K blocks of a row: 1 when each block holds every layer of a slot
    (a ``page_first`` host buffer), the model's layers when each block is one layer's.
    Raises :class:`~urc.errors.ConfigError` unless ``layout``'s buffers are K and V blocks
    of one size per slot (an even number of them: the K blocks, then the V blocks).
    """

    __slots__ = ("layers", "page_bytes", "page_size", "slot_bytes")

    def __init__(self, layout: HostPageLayout) -> None:
        ps = layout.page_size
        blocks = 0
        sizes = set()
        for view in layout.views:  # [split, units, page_size, mid, inner bytes]
            blocks += view.shape[0]
            sizes.add(view.shape[3] * view.shape[4])
        if len(sizes) != 1 or blocks % 2:
            raise ConfigError(
                "the SGLang page format needs K and V blocks of one size per token "
                f"(got {blocks} blocks of per-token sizes {sorted(sizes)})"
            )
        self.page_size = ps
        self.layers = blocks // 2
        self.slot_bytes = sizes.pop()
        self.page_bytes = layout.page_bytes
        assert self.page_bytes == 2 * self.layers * ps * self.slot_bytes, (
            self.page_bytes,
            self.layers,
            ps,
            self.slot_bytes,
        )

    @property
    def identity(self) -> bool:
        """Whether urc's rows already are SGLang's payload (one K and one V block)."""
        return self.layers == 1 or self.page_size == 1

    def to_sglang(self, rows: torch.Tensor) -> torch.Tensor:
        """urc rows (``[2, layers, page_size, bytes]`` each) as SGLang payloads
        (``[2, page_size, layers, bytes]`` each)."""
        n = int(rows.shape[0])
        grid = rows.view(n, 2, self.layers, self.page_size, self.slot_bytes)
        return grid.transpose(2, 3).contiguous().view(n, self.page_bytes)

    def from_sglang(self, rows: torch.Tensor) -> torch.Tensor:
        """SGLang payloads as urc rows (the inverse of :meth:`to_sglang`)."""
        n = int(rows.shape[0])
        grid = rows.view(n, 2, self.page_size, self.layers, self.slot_bytes)
        return grid.transpose(2, 3).contiguous().view(n, self.page_bytes)
