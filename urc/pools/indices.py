"""Where index tensors live: host memory, whatever device holds the pools' data.

Slot indices are bookkeeping: the allocators check and record them page by page on the host
(numpy), the tree compares and slices them, Mamba reads single slots as ints.  Kept on the
data's device, every such read would be a hidden device-to-host synchronization.  So the
cache's own allocators and request rows hand out CPU int64 tensors even when
``CacheConfig.device`` is ``"cuda"``; only a transfer that indexes device data makes a device
copy of its indices, on its own stream (``hicache.transfer_engine``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["INDEX_DEVICE", "index_tensor"]

#: The device of every index tensor the cache's own pools hand out.
INDEX_DEVICE = torch.device("cpu")


def index_tensor(values: int | Sequence[int], device: torch.device = INDEX_DEVICE) -> torch.Tensor:
    """A new int64 tensor on ``device`` holding ``values`` (a sequence: 1-D; an int: 0-d).
    On the CPU it is built through numpy: a third of ``torch.tensor``'s cost for the few
    slots a request names (0.7 vs 2.3 µs for one).  ``OverflowError`` outside int64."""
    if device.type == "cpu":
        return torch.from_numpy(np.array(values, dtype=np.int64))
    return torch.tensor(values, dtype=torch.int64, device=device)
