"""``HostLayout``: how a host pool holds the slots of a device pool (SGLang's layout names).

A device KV buffer is ``[split (K, V), layers, slots, heads, dim]``; its host copy is either

- ``LAYER_FIRST``: the same shape (``[2, layers, host slots, heads, dim]``).  A page moves as
  ``2 x layers`` blocks of ``page_size`` rows, each contiguous on both sides, so a copy is a
  plain gather of blocks; or
- ``PAGE_FIRST``: ``[2, host slots, layers, heads, dim]`` (SGLang 0.5.23's default): all
  layers of a page are contiguous, so a page (and a run of pages) moves as one K and one V
  block, and a transfer is a few large DMA copies.  Getting there from the device's layout is
  a transposition, which a GPU does at memory speed while gathering the pages on the device,
  but a CPU copy does at about 0.6-0.9 of a plain copy's bandwidth.

Hence the default (:meth:`HostLayout.for_device`): ``PAGE_FIRST`` for a pool on a CUDA device
(any accelerator), ``LAYER_FIRST`` on the CPU.  SGLang does not transpose without its
kernels either: with its ``direct`` I/O backend it turns ``page_first`` into
``page_first_direct``, whose pages are layer-major as ``LAYER_FIRST``'s are.

Buffers with no layer dimension (Mamba states, per-layer buffers) look the same in both
layouts.  What L3 stores does not depend on the layout:
:class:`~hicache.storage_worker.layout.HostPageLayout` reads and writes pages in
``PAGE_FIRST`` order whatever the host pool holds.
"""

from __future__ import annotations

from enum import Enum

import torch

__all__ = ["HostLayout"]


class HostLayout(Enum):
    """The layout of a host pool's buffers (see the module docstring)."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"

    @classmethod
    def for_device(cls, device: torch.device) -> HostLayout:
        """The default for a device pool on ``device``: ``LAYER_FIRST`` on the CPU, else
        (CUDA, any accelerator) ``PAGE_FIRST``."""
        return cls.LAYER_FIRST if device.type == "cpu" else cls.PAGE_FIRST
