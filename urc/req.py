"""``Req``: the fields of a serving request that request caching reads and writes.

A small model of SGLang's ``Req``: a server owns one per running request, allocates its KV
slots in ``req_to_token`` row ``req_pool_idx`` and lets the cache take them over.

KV ranges of a request (token positions)::

    [0, cache_protected_len)                    tree-owned: matched earlier, locked via last_node
    [cache_protected_len, kv_committed_len)     request-owned slots with computed KV
    [kv_committed_len, kv_allocated_len)        request-owned slots allocated but not computed
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from urc.key import ExtraKey

if TYPE_CHECKING:
    from urc.params import IncLockRefResult
    from urc.tree import TreeNode

__all__ = ["Req"]


def _empty_indices() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(slots=True, eq=False)
class Req:
    """A running request (mutable: the cache updates its prefix and lock fields)."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    extra_key: ExtraKey | None = None
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=_empty_indices)
    last_node: TreeNode | None = None
    lock_receipt: IncLockRefResult | None = None
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    # SWA: KV of positions below this was freed while the request ran (slid out of window).
    swa_evicted_seqlen: int = 0
    swa_lock_released: bool = False
    # Mamba: the request's own state slot, and where its last state snapshot was taken.
    mamba_pool_idx: torch.Tensor | None = None
    mamba_last_track_seqlen: int | None = None
    mamba_ping_pong_track_buffer: torch.Tensor | None = None
    mamba_next_track_idx: int = 0
    mamba_branching_seqlen: int | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Input then output token ids."""
        return self.origin_input_ids + self.output_ids

    @property
    def swa_uuid_for_lock(self) -> int | None:
        receipt = self.lock_receipt
        return None if receipt is None else receipt.swa_uuid_for_lock
