"""``RequestHooks``: the request-caching hooks of a :class:`~urc.components.base.TreeComponent`.

A part of the component interface kept in a file of its own: the hooks through which
``cache_finished_req`` / ``cache_unfinished_req`` (:mod:`urc.request_caching`) ask each
component about a request's own state.  :class:`~urc.components.base.TreeComponent` inherits
them; read the hooks there as one interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from urc.params import InsertParams, InsertResult
    from urc.request_protocol import CachingRequest

__all__ = ["RequestHooks"]


class RequestHooks:
    """The request-caching hooks (see the module docstring); the defaults do nothing."""

    def validate_caching_req(self, req: CachingRequest, is_finished: bool) -> None:
        """Raise :class:`~urc.errors.InvalidInputError` if ``req``'s fields for this component
        are invalid.  Called first by ``cache_finished_req`` / ``cache_unfinished_req``, before
        any change, so a refused request leaves cache, pools and request untouched.

        - Full: not overridden.
        - SWA: not overridden.
        - Mamba: every slot the request claims must be caller-held, once; the ping-pong
          buffer, ``mamba_next_track_idx`` and ``mamba_last_track_seqlen`` in range.
        """

    def prepare_for_caching_req(
        self, req: CachingRequest, params: InsertParams, token_len: int, is_finished: bool
    ) -> int | None:
        """Fill this component's insert params from ``req``.

        Returns the effective cache length (the key is truncated to it), or ``None`` for no
        truncation.  Called by request caching before its insert (the smallest length
        wins, then page-aligned); may allocate slots the cleanup frees if not adopted.

        - Full: not overridden.
        - SWA: sets the insert's ``swa_evicted_seqlen`` from the request's; ``None``.
        - Mamba: offers a state slot (``mamba_value``: the ping-pong snapshot, donated or
          not, or the live state / a fork); ping-pong mode returns the snapshot's length.
        """
        return None

    def cleanup_after_caching_req(
        self,
        req: CachingRequest,
        is_finished: bool,
        insert_result: InsertResult | None,
        params: InsertParams | None,
    ) -> None:
        """Release request-owned resources the tree did not take (after the insert).

        Called last by ``cache_finished_req`` (after the frees and the lock release) and
        ``cache_unfinished_req``; ``insert_result`` is ``None`` when nothing was inserted.

        - Full: not overridden (request caching frees Full slots itself).
        - SWA: not overridden.
        - Mamba: frees an offered slot the tree did not adopt; finished: every slot but the
          adopted one, and clears the request's Mamba fields.
        """
