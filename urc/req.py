"""``Req``: the fields of a serving request that request caching reads and writes.

A small model of SGLang's ``Req``: a server owns one per running request, allocates its KV
slots in ``req_to_token`` row ``req_pool_idx`` and lets the cache take them over.

KV ranges of a request (token positions)::

    [0, cache_protected_len)                    tree-owned: matched earlier, locked via last_node
    [cache_protected_len, kv_committed_len)     request-owned slots with computed KV
    [kv_committed_len, kv_allocated_len)        request-owned slots allocated but not computed
                                                (over-allocated: speculative decoding)

``cache_finished_req`` frees all of a request's slots that the tree does not take, unless the
caller took a range first with ``pop_committed_kv_cache`` / ``pop_overallocated_kv_cache``
(SGLang's scheduler protocol): a popped range is the caller's to free.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from urc.errors import InvalidInputError
from urc.key import ExtraKey, pack_tokens

if TYPE_CHECKING:
    from urc.lock_receipts import TreeLock
    from urc.node import TreeNode
    from urc.request_protocol import MambaStateCopier

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
    # The request's tree lock (on ``last_node``); ``lock.swa_released`` after an early
    # SWA window release.
    lock: TreeLock | None = None
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    # SWA: KV of positions below this was freed while the request ran (slid out of window).
    swa_evicted_seqlen: int = 0
    # Mamba: the request's own state slot, and where its last state snapshot was taken.
    mamba_pool_idx: torch.Tensor | None = None
    mamba_last_track_seqlen: int | None = None
    mamba_ping_pong_track_buffer: torch.Tensor | None = None
    mamba_next_track_idx: int = 0
    mamba_branching_seqlen: int | None = None
    # Thinking tokens among the output (``CacheConfig.strip_thinking_cache``).
    reasoning_tokens: int = 0
    # Passed with the request's inserts (SGLang's ``InsertParams.priority`` / ``session_id``).
    priority: int = 0
    session_id: str | None = None
    # Ranges the caller took over with the ``pop_*`` methods (it frees them itself).
    kv_committed_freed: bool = False
    kv_overallocated_freed: bool = False
    _fill_ids: list[int] | None = field(default=None, init=False, repr=False)
    # ``fill_prefix``'s packed ``fill_ids`` and the list it was packed from.
    _prefix: array[int] = field(default_factory=lambda: array("q"), init=False, repr=False)
    _prefix_of: list[int] | None = field(default=None, init=False, repr=False)

    @property
    def fill_ids(self) -> list[int]:
        """The tokens whose KV is in the request's row: input then output token ids, or what
        was last assigned (SGLang's scheduler sets the chunk filled so far).  Read-only for
        the caller: without output it is ``origin_input_ids`` itself (no copy per prefill
        chunk, whose cost would grow with the prompt's length squared)."""
        fill = self._fill_ids
        if fill is not None:
            return fill
        out = self.output_ids
        return self.origin_input_ids + out if out else self.origin_input_ids

    @fill_ids.setter
    def fill_ids(self, tokens: list[int]) -> None:
        """Mutates: the KV of ``tokens`` counts as computed (``kv_committed_len``, and
        ``kv_allocated_len`` if it was lower)."""
        self._fill_ids = list(tokens)
        self.kv_committed_len = len(tokens)
        self.kv_allocated_len = max(self.kv_allocated_len, len(tokens))

    def fill_prefix(self, n: int | None = None) -> memoryview:
        """The first ``n`` tokens of :attr:`fill_ids` (all of them when ``n`` is None or larger),
        packed: a view of int64s (format ``"q"``) that a :class:`~urc.key.RadixKey` holds
        without a copy.

        Matching and request caching key every call by the prompt so far; packing it per
        call would cost its length per chunk (and read every token's int object again), so
        the request packs :attr:`fill_ids` once and hands out prefixes of that buffer.  It
        is packed again only when ``fill_ids`` is another list, or the same list changed
        length or last token; the old buffer is never resized or written, so a view handed
        out earlier keeps its bytes.  Views are the request's: callers must not keep them.
        Raises :class:`~urc.errors.InvalidInputError` for ids that are not int64."""
        fill = self.fill_ids
        packed = self._prefix
        if (
            self._prefix_of is not fill
            or len(packed) != len(fill)
            or (packed and packed[-1] != fill[-1])
        ):
            packed = self._prefix = pack_tokens(fill)
            self._prefix_of = fill
        # A view per call, not one kept on the request: a kept view would make the request
        # impossible to deep-copy or pickle.
        return memoryview(packed) if n is None else memoryview(packed)[:n]

    @property
    def prompt_len(self) -> int:
        """Tokens of the prompt (``len(origin_input_ids)``)."""
        return len(self.origin_input_ids)

    def get_fill_ids(self) -> list[int]:
        """:attr:`fill_ids` (SGLang's accessor)."""
        return self.fill_ids

    def pop_committed_kv_cache(self) -> int:
        """Take over ``[cache_protected_len, kv_committed_len)``: returns
        ``kv_committed_len``; ``cache_finished_req`` will no longer insert or free it.
        Raises :class:`~urc.errors.InvalidInputError` if already taken."""
        if self.kv_committed_freed:
            raise InvalidInputError(f"request {self.rid}: committed KV already taken")
        self.kv_committed_freed = True
        return self.kv_committed_len

    def pop_overallocated_kv_cache(self) -> tuple[int, int]:
        """Take over the over-allocated range: returns ``(kv_committed_len,
        kv_allocated_len)``; ``cache_finished_req`` will no longer free it.  Raises
        :class:`~urc.errors.InvalidInputError` if already taken."""
        if self.kv_overallocated_freed:
            raise InvalidInputError(f"request {self.rid}: over-allocated KV already taken")
        self.kv_overallocated_freed = True
        return self.kv_committed_len, self.kv_allocated_len

    def start_from_mamba_state(self, copier: MambaStateCopier, src: int, dst: int) -> None:
        """Copy-on-write at a match: copy the tree's state ``src`` into the request's ``dst``."""
        copier.copy(src, dst)

    @property
    def swa_uuid_for_lock(self) -> int | None:
        lock = self.lock
        return None if lock is None else lock.receipt.swa_uuid_for_lock
