"""``CachingRequest``: the fields of a running request the tree's request layer reads and
writes (:mod:`urc.request_caching`, the component request hooks, copy-on-write matches).

Two kinds of request satisfy it: urc's own :class:`~urc.req.Req`, and the SGLang plug-in's
thin view of SGLang's ``Req`` (:mod:`urc.apps.sglang._req_view`).  Everything else a server
keeps on its request (sampling, output, scheduling state) the tree never sees.

KV ranges of a request (token positions; ``p = cache_protected_len``)::

    [0, p)              tree-owned: cached, locked through ``lock`` (ends at ``last_node``)
    [p, ...)            request-owned slots in row ``req_pool_idx`` of ``req_to_token``
    [0, swa_evicted)    (SWA) the request already freed these positions' SWA slots

Mamba: ``mamba_pool_idx`` is the request's live state slot (a 1-element int64 tensor);
the ping-pong fields are urc's extra-buffer mode (``None`` / 0 where it is not used).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from urc.key import ExtraKey
    from urc.lock_receipts import TreeLock
    from urc.node import TreeNode

__all__ = ["CachingRequest", "MambaStateCopier"]


class MambaStateCopier(Protocol):
    """A Mamba pool's state copy (urc's ``MambaPool``, the plug-in's view of SGLang's)."""

    def copy(self, src: int, dst: int) -> None:
        """Copy state slot ``src`` into slot ``dst``."""
        ...


class CachingRequest(Protocol):
    """What the request layer needs of a request (attributes are read and written)."""

    req_pool_idx: int | None
    cache_protected_len: int
    last_node: TreeNode | None
    lock: TreeLock | None
    # SWA: positions below this had their SWA slots freed while the request ran.
    swa_evicted_seqlen: int
    # Mamba: the live state slot, urc's ping-pong snapshot buffer and its position.
    mamba_pool_idx: torch.Tensor | None
    mamba_ping_pong_track_buffer: torch.Tensor | None
    mamba_next_track_idx: int
    mamba_last_track_seqlen: int | None
    mamba_branching_seqlen: int | None

    @property
    def rid(self) -> str:
        """The request's id (for error messages)."""
        ...

    @property
    def extra_key(self) -> ExtraKey | None:
        """The namespace its keys live in."""
        ...

    @property
    def priority(self) -> int:
        """Passed with its inserts (SGLang's ``InsertParams.priority``)."""
        ...

    @property
    def session_id(self) -> str | None:
        """Passed with its inserts (SGLang's ``InsertParams.session_id``)."""
        ...

    @property
    def fill_ids(self) -> Sequence[int]:
        """The token ids whose KV is in the request's row (prompt, then output)."""
        ...

    @property
    def prompt_len(self) -> int:
        """Tokens of the prompt (``fill_ids`` past it are output)."""
        ...

    def fill_prefix(self, n: int | None = None) -> memoryview | Sequence[int]:
        """The first ``n`` token ids whose KV is in the request's row (all when ``None``),
        as a :class:`~urc.key.RadixKey` takes them; valid for the call only."""
        ...

    def start_from_mamba_state(self, copier: MambaStateCopier, src: int, dst: int) -> None:
        """Copy-on-write at a match: the request's slot ``dst`` must start from the tree's
        state ``src`` (urc's ``Req`` copies now with ``copier``; SGLang's forward copies it
        when the request runs)."""
        ...
