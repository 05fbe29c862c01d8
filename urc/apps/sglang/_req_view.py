"""``SGLangRequest``: SGLang 0.5.23's ``Req`` seen as urc's
:class:`~urc.request_protocol.CachingRequest`, so the core's request layer
(:mod:`urc.request_caching`) runs on it.

No state of its own: every field reads and writes SGLang's ``req`` / ``req.kv``.  Where the
two disagree on a name or a form the view translates (SGLang's per-component evicted
lengths, its namespace of ``extra_key`` and ``cache_salt``, its copy-on-write deferred to
the forward); fields urc's extra-buffer Mamba mode uses read as unused (the plug-in refuses
``--mamba-radix-cache-strategy extra_buffer`` at start-up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType as SGLangComponent

from urc.apps.sglang._keys import namespace
from urc.key import ExtraKey

if TYPE_CHECKING:
    from urc.lock_receipts import TreeLock
    from urc.node import TreeNode
    from urc.request_protocol import MambaStateCopier

__all__ = ["SGLangRequest"]

_SWA = SGLangComponent.SWA


class SGLangRequest:
    """A view of SGLang's ``req`` for the core's request layer (one per call)."""

    __slots__ = ("_device", "extra_key", "kv", "req")

    def __init__(self, req: Any, device: torch.device | str) -> None:
        self.req = req
        self.kv = req.kv
        self._device = device
        self.extra_key: ExtraKey | None = namespace(req.extra_key, req.cache_salt)

    # ------------------------------------------------------------------ identity, tokens
    @property
    def rid(self) -> str:
        return str(self.req.rid)

    @property
    def priority(self) -> int:
        return int(self.req.priority or 0)

    @property
    def session_id(self) -> str | None:
        sid: str | None = self.req.session_id
        return sid

    @property
    def fill_ids(self) -> Sequence[int]:
        ids: Sequence[int] = self.req.full_untruncated_fill_ids
        return ids

    @property
    def prompt_len(self) -> int:
        return len(self.req.origin_input_ids)

    def fill_prefix(self, n: int | None = None) -> Sequence[int]:
        ids: Sequence[int] = self.req.full_untruncated_fill_ids
        return ids if n is None else ids[:n]

    # ------------------------------------------------------------------ row and lock
    @property
    def req_pool_idx(self) -> int | None:
        row: int | None = self.kv.req_pool_idx
        return row

    @req_pool_idx.setter
    def req_pool_idx(self, row: int | None) -> None:
        self.kv.req_pool_idx = row

    @property
    def cache_protected_len(self) -> int:
        return int(self.kv.cache_protected_len)

    @cache_protected_len.setter
    def cache_protected_len(self, n: int) -> None:
        self.kv.cache_protected_len = n

    @property
    def last_node(self) -> TreeNode | None:
        node: TreeNode | None = self.req.last_node
        return node

    @last_node.setter
    def last_node(self, node: TreeNode | None) -> None:
        self.req.last_node = node

    @property
    def lock(self) -> TreeLock | None:
        held: TreeLock | None = self.req.lock
        return held

    @lock.setter
    def lock(self, held: TreeLock | None) -> None:
        self.req.lock = held

    # ------------------------------------------------------------------ SWA
    @property
    def swa_evicted_seqlen(self) -> int:
        return int(self.kv.get_evicted_seqlen(_SWA))

    @swa_evicted_seqlen.setter
    def swa_evicted_seqlen(self, n: int) -> None:
        self.kv.set_evicted_seqlen(_SWA, n)

    # ------------------------------------------------------------------ Mamba
    @property
    def mamba_pool_idx(self) -> torch.Tensor | None:
        idx: torch.Tensor | None = self.kv.mamba_pool_idx
        return None if idx is None else idx.to(torch.int64)

    @mamba_pool_idx.setter
    def mamba_pool_idx(self, idx: torch.Tensor | None) -> None:
        self.kv.mamba_pool_idx = idx

    @property
    def mamba_last_track_seqlen(self) -> int | None:
        t: int | None = self.kv.mamba_last_track_seqlen
        return t

    @mamba_last_track_seqlen.setter
    def mamba_last_track_seqlen(self, t: int | None) -> None:
        # SGLang tracks the previous snapshot too; a reset clears both.
        self.kv.mamba_last_track_seqlen = t
        if t is None:
            self.kv.mamba_prev_track_seqlen = None

    @property
    def mamba_branching_seqlen(self) -> int | None:
        b: int | None = self.req.mamba_branching_seqlen
        return b

    @mamba_branching_seqlen.setter
    def mamba_branching_seqlen(self, b: int | None) -> None:
        """Ignored: SGLang sets it from the match result (keeping it when none is reported)."""

    # urc's extra-buffer (ping-pong) mode is not served: no buffer, never one assigned.
    @property
    def mamba_ping_pong_track_buffer(self) -> torch.Tensor | None:
        return None

    @mamba_ping_pong_track_buffer.setter
    def mamba_ping_pong_track_buffer(self, buf: torch.Tensor | None) -> None:
        assert buf is None, "the plug-in serves no_buffer Mamba (no ping-pong buffer)"

    @property
    def mamba_next_track_idx(self) -> int:
        return 0

    @mamba_next_track_idx.setter
    def mamba_next_track_idx(self, i: int) -> None:
        assert i == 0, f"the plug-in serves no_buffer Mamba (track index {i})"

    def start_from_mamba_state(self, copier: MambaStateCopier, src: int, dst: int) -> None:
        """SGLang's copy-on-write: its forward copies ``src`` into the request's slot."""
        self.kv.mamba_cow_src_index = torch.tensor([src], dtype=torch.int64, device=self._device)
        self.kv.mamba_needs_clear = False
