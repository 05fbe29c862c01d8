"""Session-aware eviction: the order of ``EvictionPolicy.SESSION_AWARE``.

What it uses: the :class:`~urc.reuse_hint.ReuseHint` a server gives when it caches a
finished request (the session, why the model stopped, when it finished).  What it does:

* Each node of a finished request's path is stamped with that request's *keep-until*
  time: the finish, plus ``window_s`` when the session is expected back soon (its expected
  gap, the hint's own or :data:`DEFAULT_GAPS_S` for its stop reason, is at most
  ``hot_gap_s``: a tool call, whose result comes back in seconds).  An answer that waits for
  a person gets no credit (half of those sessions return after five minutes, many never).
  Leaves whose keep-until is earliest go first: LRU by finish time, with sessions in a tool
  loop aged ``window_s`` younger.
* Keep-until times are quantized to ``quantum_s``; within one quantum the session the cache
  saw first goes first (then least recently used first: a session's tail before its head).
  When more sessions are in tool loops than the cache holds, LRU evicts exactly the one due
  back next; this order keeps a stable set of them whole instead, as the offline optimum
  does, and the set it keeps is the younger sessions: an old session is nearer its end.
* A leaf no hint reached (every leaf, on a workload without hints) is keyed by
  ``last_access_time`` alone and goes before every hinted one: without hints the order is
  exactly LRU's.

The key is one int, ``base + last_access_time``: ``base`` (``node.eviction_state``) packs
(hinted, quantum, first-seen rank) above the 48 bits of the access clock.  A hint costs O(1) per
node of the path the insert already walked; keys grow with use, except that a hint can lower
them (a finish earlier than the previous one's, or a tool loop that now waits for a person):
the nodes whose key dropped get a fresh heap entry then (``FullComponent.note_hint``), so
releases cost what they cost under LRU and every operation stays O(log n).  Host leaves
are evicted in the same order (the host heap uses the same key); the SWA and Mamba LRUs
are untouched.  The session table (first-seen order) keeps the latest 65,536 sessions, by
their ids' hashes: its size does not grow with the ids' length.

The defaults (``window_s`` 600, ``hot_gap_s`` 60, ``quantum_s`` 20) were chosen on one half of
the agentic sessions and checked on the other (README, "Agentic workloads").
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence

from urc.errors import ConfigError
from urc.eviction_strategy import EvictionStrategy, HeapKey
from urc.node import TreeNode
from urc.reuse_hint import ReuseHint, StopReason

__all__ = ["DEFAULT_GAPS_S", "SessionAwareStrategy"]

DEFAULT_GAPS_S: dict[StopReason | None, float] = {
    StopReason.TOOL_USE: 9.0,  # median gap after a tool call in the agentic traces
    StopReason.END_TURN: 300.0,  # median gap after an answer (a person types)
    StopReason.MAX_TOKENS: 0.0,  # the client continues at once
    StopReason.OTHER: 9.0,  # side requests: the session is mid-turn
    None: 9.0,  # a session id without a stop reason: assume it is mid-turn
}
"""Expected seconds to a session's next request, per stop reason, when a hint gives none."""

_CLOCK_BITS = 48  # last_access_time (a logical clock: one tick per node touched)
_RANK_BITS = 40  # sessions first seen, counted
_MAX_SESSIONS = 1 << 16  # sessions remembered (their first-seen order)
_WINDOW_BIAS = 1 << 40  # windows may be negative (a clock that starts below zero)
_HINTED = 1 << 200  # above every window: a hinted leaf goes after every unhinted one


class SessionAwareStrategy(EvictionStrategy):
    """Hinted leaves by keep-until time (quantized, the oldest session first within a
    quantum); LRU without hints (see the module docstring).

    ``window_s``: how much later a session expected back soon is kept (seconds);
    ``hot_gap_s``: an expected gap at most this earns it; ``quantum_s``: the resolution of
    keep-until times.

    Raises:
        ConfigError: a negative ``window_s`` or ``hot_gap_s``, a non-positive ``quantum_s``
            (or any of them not finite).
    """

    __slots__ = ("_hot_gap", "_next_rank", "_quantum", "_ranks", "_window")

    keeps_node_state = True
    uses_hints = True

    def __init__(
        self, window_s: float = 600.0, hot_gap_s: float = 60.0, quantum_s: float = 20.0
    ) -> None:
        if not (math.isfinite(window_s) and window_s >= 0):
            raise ConfigError(f"session window_s must not be negative, got {window_s}")
        if not (math.isfinite(hot_gap_s) and hot_gap_s >= 0):
            raise ConfigError(f"session hot_gap_s must not be negative, got {hot_gap_s}")
        if not (math.isfinite(quantum_s) and quantum_s > 0):
            raise ConfigError(f"session quantum_s must be positive, got {quantum_s}")
        self._window = float(window_s)
        self._hot_gap = float(hot_gap_s)
        self._quantum = float(quantum_s)
        # Session id's hash -> the order the cache first saw it in (oldest forgotten past the
        # cap).  Hashes, not the ids: the table's bytes are bounded by its count whatever the
        # ids' length (a collision only shares a rank: an ordering within one quantum).
        self._ranks: OrderedDict[int, int] = OrderedDict()
        self._next_rank = 0

    def key_function(self) -> HeapKey:
        def key(node: TreeNode) -> int:
            base = node.eviction_state
            t: int = node.last_access_time
            return t if base is None else base + t

        return key

    def note_hint(self, path: Sequence[TreeNode], hint: ReuseHint) -> list[TreeNode]:
        """``path`` is a finished request's inserted path (root excluded), ``hint`` the
        server's view of its next use: each node's key base becomes the request's (mutates
        their ``eviction_state``).  Returns the nodes whose key dropped."""
        at = time.monotonic() if hint.finished_at_s is None else hint.finished_at_s
        gap = hint.expected_gap_s
        if gap is None:
            gap = DEFAULT_GAPS_S[hint.stop]
        window = self._window
        keep_until = at + window if gap <= self._hot_gap else at
        bucket = math.floor(keep_until / self._quantum) + _WINDOW_BIAS
        # Within a quantum the session seen first goes first: sessions end, and an old one
        # is nearer its end than one that has just started.
        rank = self._rank(hint.session_id)
        base = _HINTED + (((bucket << _RANK_BITS) + rank) << _CLOCK_BITS)
        dropped = []
        for node in path:
            old = node.eviction_state
            node.eviction_state = base
            if old is not None and base < old:
                dropped.append(node)
        return dropped

    def _rank(self, session_id: str | None) -> int:
        """How many sessions the cache saw before ``session_id`` (a request without one
        counts as the youngest session, the last to go within a quantum)."""
        ranks = self._ranks
        if session_id is None:
            return self._next_rank
        h = hash(session_id)
        r = ranks.get(h)
        if r is None:
            r = ranks[h] = self._next_rank
            self._next_rank = min(r + 1, (1 << _RANK_BITS) - 1)
            if len(ranks) > _MAX_SESSIONS:
                ranks.popitem(last=False)
        return r

    def note_split(self, upper: TreeNode, lower: TreeNode) -> None:
        upper.eviction_state = lower.eviction_state
