"""What the serving layer knows about a finished request's next use: :class:`ReuseHint`.

When a server caches a finished request it knows why the request stopped: the model called
a tool (the client sends the tool's result back within seconds) or it answered and the next
prompt waits for a person (minutes, or never).  It may also know the conversation (session)
the request belongs to.  A hint carries that to the cache, through
``UnifiedRadixCache.cache_finished_req(..., hint=...)``, its service twin, or
``InsertParams.reuse_hint`` for a plain insert.  Eviction policies that do not use hints
ignore them (``EvictionStrategy.uses_hints`` is False: the insert path asks once per insert,
nothing more); :class:`~urc.session_eviction.SessionAwareStrategy` uses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from numbers import Real

from urc.errors import InvalidInputError

__all__ = ["ReuseHint", "StopReason"]


class StopReason(Enum):
    """Why the model stopped generating (the OpenAI / Anthropic stop reasons that matter)."""

    TOOL_USE = "tool_use"  # a tool call: the client returns with the result in seconds
    END_TURN = "end_turn"  # an answer: the next prompt waits for a person
    MAX_TOKENS = "max_tokens"  # cut off: the client usually continues at once
    OTHER = "other"  # anything else (a stop sequence, a side request)


@dataclass(frozen=True, slots=True)
class ReuseHint:
    """The serving layer's view of when a finished request's prefix is used next.

    Attributes:
        session_id: the conversation or agent flow the request belongs to (SGLang's
            ``session_id``); requests of one session are expected to extend each other's
            prompts.  ``None``: unknown (the hint then applies to the request alone).
        stop: why the request stopped (``None``: unknown).
        expected_gap_s: seconds until the session's next request, if the server has its
            own estimate; it wins over the policy's default for ``stop``.
        finished_at_s: when the request finished, in seconds on any clock the caller uses
            for every hint to one cache (a replay uses its trace's clock);  ``None``: the
            policy reads ``time.monotonic()``.
        parent_id: the session that started this one, for a sub-agent's flow (its own
            ``session_id``; a sub-agent's final answer goes to its parent, not back to
            it).  ``None``: a top-level session, or unknown.

    Raises:
        InvalidInputError: a ``session_id`` that is not a ``str``, a ``stop`` that is not a
            :class:`StopReason`, times that are not real numbers, a negative or non-finite
            ``expected_gap_s`` or a non-finite ``finished_at_s``, a ``parent_id`` that is not
            a ``str``, or one without a ``session_id`` or equal to it.  A hint that constructs is
            one every policy accepts: nothing in it can fail inside the cache.
    """

    session_id: str | None = None
    stop: StopReason | None = None
    expected_gap_s: float | None = None
    finished_at_s: float | None = None
    parent_id: str | None = None

    def __post_init__(self) -> None:
        sid = self.session_id
        for name, v in (("session_id", sid), ("parent_id", self.parent_id)):
            if v is not None and not isinstance(v, str):
                raise InvalidInputError(
                    f"{name} must be a str or None, got {v!r} ({type(v).__name__})"
                )
        if self.parent_id is not None and (sid is None or sid == self.parent_id):
            raise InvalidInputError(
                f"parent_id {self.parent_id!r} needs a session_id of its own, got {sid!r}"
            )
        for name in ("expected_gap_s", "finished_at_s"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, Real)):
                raise InvalidInputError(f"{name} must be a real number or None, got {v!r}")
        gap = self.expected_gap_s
        if gap is not None and not (math.isfinite(gap) and gap >= 0):
            raise InvalidInputError(f"expected_gap_s must be finite and >= 0, got {gap}")
        at = self.finished_at_s
        if at is not None and not math.isfinite(at):
            raise InvalidInputError(f"finished_at_s must be finite, got {at}")
        if self.stop is not None and not isinstance(self.stop, StopReason):
            raise InvalidInputError(f"stop must be a StopReason, got {self.stop!r}")
