"""A request's Mamba slots: its live state, its ping-pong snapshot buffer, and what request
caching inserts from them and frees (the request-level half of ``MambaComponent``).

Request state ranges (token positions of a request; ``t = mamba_last_track_seqlen``, ``n`` =
committed tokens; "ping-pong" = ``Req.mamba_ping_pong_track_buffer``)::

    slot / range                     owner                  freed by
    req.mamba_pool_idx  state @ n    request (live state)   cleanup of the finished request,
                                                            unless the tree adopted it
    buffer[keep]        state @ t    request (snapshot)     finished: cleanup unless adopted;
                                                            unfinished: donated to the tree
                                                            (buffer gets a fresh slot), or
                                                            freed by cleanup if not adopted
    fork of pool_idx    state @ n    insert (unfinished,    cleanup, if the tree did not
                                     no ping-pong)          adopt it (mamba_exist)
    cached key          [0, t)       tree (ping-pong mode:  eviction
                        [0, n)       no ping-pong mode)

``keep = (mamba_next_track_idx - 1) % len(buffer)`` (the slot written last).  A state can
only sit where the key ends on a page boundary, so ``t`` must be page-aligned; without
ping-pong the live state is cached only when ``n`` is.

``keep`` is the buffer slot written last; ``t`` is aligned down to a page (a state sits only
where the key ends on a page boundary); without ping-pong the live state is cached only when
``n`` is page-aligned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from urc.errors import InvalidIndicesError, InvalidInputError, OutOfMemoryError
from urc.params import InsertParams, InsertResult
from urc.pools.indices import index_tensor
from urc.pools.mamba import MambaPool
from urc.request_protocol import CachingRequest

if TYPE_CHECKING:
    from urc.node import TreeNode

__all__ = ["MambaRequestSlots"]

_Tensor = torch.Tensor
_INT64 = torch.int64


class MambaRequestSlots:
    """Validates, offers to the tree and frees the Mamba slots requests hold.

    ``alloc_slot(protect)`` is the component's allocator: a free slot, evicting one unlocked
    state when the pool is full (``None`` when nothing can be evicted).
    """

    def __init__(
        self,
        pool: MambaPool,
        page_size: int,
        is_eagle: bool,
        alloc_slot: Callable[[TreeNode | None], int | None],
    ) -> None:
        self.pool = pool
        self.device = pool.index_device
        self._on_cpu = self.device.type == "cpu"
        self.page_size = page_size
        self.is_eagle = is_eagle
        self.alloc_slot = alloc_slot

    def caller_slot(self, t: object, what: str) -> int:
        """The slot of a caller-held 1-element index tensor; typed error otherwise."""
        # The usual value first, checked without building a device object: a 1-element
        # int64 tensor on a CPU index device naming a held slot.  Anything else takes the
        # checks below, which say what is wrong.
        if (
            type(t) is _Tensor
            and t.dtype is _INT64
            and self._on_cpu
            and t.is_cpu
            and t.numel() == 1
        ):
            slot: int = t.item()  # type: ignore[assignment]  # (int64: an int)
            if self.pool.is_held(slot):
                return slot
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != torch.int64
            or t.device != self.device
            or t.numel() != 1
        ):
            raise InvalidIndicesError(
                f"{what} must be a 1-element int64 tensor on {self.device}, got {t!r:.80}"
            )
        slot = int(t.item())
        self.pool.check_held(slot, what)
        return slot

    def request_slots(self, req: CachingRequest) -> list[int]:
        """Every slot ``req`` holds (live state, then the ping-pong buffer)."""
        slots: list[int] = []
        if req.mamba_pool_idx is not None:
            slots.append(int(req.mamba_pool_idx.item()))
        buf = req.mamba_ping_pong_track_buffer
        if buf is not None:
            slots.extend(buf.tolist())
        return slots

    def validate(self, req: CachingRequest) -> None:
        """Raise a typed error (nothing changed) unless every Mamba slot ``req`` claims is a
        caller-held slot it holds once, and its tracking fields are in range."""
        seen: set[int] = set()
        if req.mamba_pool_idx is not None:
            seen.add(self.caller_slot(req.mamba_pool_idx, "req.mamba_pool_idx"))
        buf = req.mamba_ping_pong_track_buffer
        if buf is not None:
            if (
                not isinstance(buf, torch.Tensor)
                or buf.dtype != torch.int64
                or buf.device != self.device
                or buf.dim() != 1
                or buf.shape[0] == 0
            ):
                raise InvalidIndicesError(
                    f"mamba_ping_pong_track_buffer must be a non-empty 1-D int64 tensor on "
                    f"{self.device}, got {buf!r:.80}"
                )
            for slot in buf.tolist():
                self.pool.check_held(slot, "ping-pong buffer slot")
                if slot in seen:
                    raise InvalidIndicesError(f"request {req.rid} holds Mamba slot {slot} twice")
                seen.add(slot)
            if not 0 <= req.mamba_next_track_idx < buf.shape[0]:
                raise InvalidInputError(
                    f"mamba_next_track_idx {req.mamba_next_track_idx} outside the buffer"
                )
        t = req.mamba_last_track_seqlen
        if t is not None and t < 0:
            raise InvalidInputError(f"mamba_last_track_seqlen must be >= 0, got {t}")

    def _key_len(self, n_tokens: int) -> int:
        # Tree tokens of ``n_tokens`` ids (EAGLE keys are bigrams, one shorter).
        return n_tokens - 1 if self.is_eagle and n_tokens > 0 else n_tokens

    def prepare(
        self, req: CachingRequest, params: InsertParams, token_len: int, is_finished: bool
    ) -> int | None:
        """Picks the state slot to insert (``params.mamba_value``) and the key length.

        Ping-pong mode: returns ``t`` (the key is truncated to the last snapshot, aligned
        down to a page; ``None`` snapshot -> 0, nothing cached).  A finished request offers
        ``buffer[keep]``; an unfinished one donates it (the buffer gets a fresh slot,
        evicting one state if needed; no donation when no slot can be had or nothing will
        be inserted).
        Otherwise the live state ``req.mamba_pool_idx`` (finished: itself; unfinished: a
        fork) is offered when the key ends on a page boundary; no truncation.
        """
        ps = self.page_size
        buf = req.mamba_ping_pong_track_buffer
        if buf is not None:
            t = req.mamba_last_track_seqlen
            if t is None:
                return 0
            if t > token_len:
                raise InvalidInputError(f"mamba_last_track_seqlen {t} must be <= {token_len}")
            klen = self._key_len(t)
            t -= klen % ps  # aligned down to a page, as SGLang's page-aligned key does
            klen -= klen % ps
            keep = (req.mamba_next_track_idx - 1) % buf.shape[0]
            slot = int(buf[keep].item())
            if is_finished:
                params.mamba_value = index_tensor([slot], self.device)
            elif klen > 0 and t >= req.cache_protected_len:
                fresh = self.alloc_slot(None)
                if fresh is not None:
                    buf[keep] = fresh
                    params.mamba_value = index_tensor([slot], self.device)
            return t
        idx = req.mamba_pool_idx
        klen = self._key_len(token_len)
        if idx is None or klen <= 0 or klen % ps:
            return None
        slot = int(idx.item())
        if is_finished:
            params.mamba_value = index_tensor([slot], self.device)
        else:
            fork = self.alloc_slot(None)
            if fork is not None:
                self.pool.copy(slot, fork)
                params.mamba_value = index_tensor([fork], self.device)
        return None

    def cleanup(
        self,
        req: CachingRequest,
        is_finished: bool,
        insert_result: InsertResult | None,
        params: InsertParams | None,
    ) -> None:
        """Frees what the tree did not adopt.

        The tree adopted ``params.mamba_value`` iff an insert ran and did not report
        ``mamba_exist``.  Finished: every slot of the request but the adopted one is freed
        and the request's Mamba fields are cleared.  Unfinished: a donated or forked slot
        that was not adopted is freed; the snapshot position is reset.
        """
        mv = params.mamba_value if params is not None else None
        adopted: int | None = None
        offered: int | None = None
        if mv is not None:
            offered = int(mv.item())
            if insert_result is not None and not insert_result.mamba_exist:
                adopted = offered
        pool = self.pool
        if is_finished:
            slots = self.request_slots(req)
            if adopted is not None:
                slots.remove(adopted)
            if slots:
                pool.free_slots(slots)
            req.mamba_pool_idx = None
            req.mamba_ping_pong_track_buffer = None
            req.mamba_next_track_idx = 0
        elif offered is not None and adopted is None:
            pool.free_slots((offered,))
        req.mamba_last_track_seqlen = None

    def alloc_req_slot(self, req: CachingRequest) -> torch.Tensor:
        """Give ``req`` its live-state slot (``req.mamba_pool_idx``) if it has none, evicting
        one unlocked state if the pool is full.  Raises :class:`OutOfMemoryError`."""
        if req.mamba_pool_idx is None:
            slot = self.alloc_slot(None)
            if slot is None:
                raise OutOfMemoryError("no free Mamba slot and no evictable Mamba state")
            req.mamba_pool_idx = index_tensor(slot, self.device)
        return req.mamba_pool_idx

    def alloc_track_buffer(self, req: CachingRequest, size: int = 2) -> torch.Tensor:
        """Give ``req`` a ping-pong tracking buffer of ``size`` fresh slots (replacing none:
        it must have no buffer).  Raises :class:`OutOfMemoryError` (nothing taken)."""
        if req.mamba_ping_pong_track_buffer is not None:
            raise InvalidInputError(f"request {req.rid} already has a tracking buffer")
        if size <= 0:
            raise InvalidInputError(f"tracking buffer size must be positive, got {size}")
        slots: list[int] = []
        for _ in range(size):
            slot = self.alloc_slot(None)
            if slot is None:
                self.pool.free_slots(slots)
                raise OutOfMemoryError("no free Mamba slot for the tracking buffer")
            slots.append(slot)
        buf = index_tensor(slots, self.device)
        req.mamba_ping_pong_track_buffer = buf
        req.mamba_next_track_idx = 0
        req.mamba_last_track_seqlen = None
        return buf

    def free_req_slots(self, req: CachingRequest) -> None:
        """Free every Mamba slot ``req`` holds (an aborted request) and clear its fields.

        Raises :class:`~urc.errors.TreeOwnedSlotError` / :class:`InvalidIndicesError` if one
        of them is not the request's to free; nothing is freed then.
        """
        self.validate(req)
        slots = self.request_slots(req)
        if slots:
            self.pool.free_slots(slots)
        req.mamba_pool_idx = None
        req.mamba_ping_pong_track_buffer = None
        req.mamba_next_track_idx = 0
        req.mamba_last_track_seqlen = None

    @staticmethod
    def num_req_slots(req: CachingRequest) -> int:
        """How many Mamba slots ``req`` holds (for pool conservation checks)."""
        n = 0 if req.mamba_pool_idx is None else 1
        buf = req.mamba_ping_pong_track_buffer
        return n if buf is None else n + int(buf.shape[0])
