"""Where index tensors live: host memory, whatever device holds the pools' data.

Slot indices are bookkeeping: the allocators check and record them page by page on the host
(numpy), the tree compares and slices them, Mamba reads single slots as ints.  Kept on the
data's device, every such read would be a hidden device-to-host synchronization.  So the
cache's own allocators and request rows hand out CPU int64 tensors even when
``CacheConfig.device`` is ``"cuda"``; only a transfer that indexes device data makes a device
copy of its indices, on its own stream (``hicache.transfer_engine``).
"""

from __future__ import annotations

import torch

__all__ = ["INDEX_DEVICE"]

#: The device of every index tensor the cache's own pools hand out.
INDEX_DEVICE = torch.device("cpu")
