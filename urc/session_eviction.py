"""Session-aware eviction: the order of ``EvictionPolicy.SESSION_AWARE``.

What it uses: the :class:`~urc.reuse_hint.ReuseHint` a server gives when it caches a
finished request (the session, why the model stopped, when).  What it does with it:

* A session whose last request ended in a tool call (or whose expected gap is at most
  ``hot_gap_s``) comes back within seconds: it is *hot* for ``window_s`` after that request
  finished.  One that handed the turn to a person is not hot at all (half of those come back
  after five minutes, many never).
* Leaves are ordered by the window in which their session stops being hot,
  ``floor(keep_until / window_s)`` with ``keep_until = finished + window_s`` for a hot
  session and ``finished`` otherwise: sessions that went cold long ago go first, the ones
  hot now last.  This is LRU with a tool-call session aged ``window_s`` younger, but
  quantized to whole windows.
* Within a window, sessions are ordered by when the cache first saw them, youngest first,
  and within a session least recently used first (its tail before its head).  That order
  does not change as sessions take turns, so when the hot sessions do not all fit, a stable
  set of them stays whole instead of each one losing its context just before it comes back
  (LRU's failure on loops: the least recently used session is the one due next).
* A leaf no hint reached (every leaf, on a workload without hints) is keyed by
  ``last_access_time`` alone and goes before every hinted one: without hints the order is
  exactly LRU's.

The key is one int, ``base(session) + last_access_time``: ``base`` packs (hinted, window,
youngness) above the 48 bits of the access clock, and is recomputed in O(1) at each hint.
A hint gives the request's path its session: the nodes from the inserted leaf up to the
first node that already has one (a split hands it to the upper part), so a turn costs the
nodes it added.  Keys grow with use and with later hints, except that a hint can lower
them (a tool-call session that now waits for a person): the released leaf then gets a fresh
heap entry (:attr:`~urc.eviction_policy.EvictionStrategy.rekey_on_release`); O(log n) per
operation.  Sessions are held weakly: one whose nodes are all gone is forgotten.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence

from urc.errors import ConfigError
from urc.eviction_policy import EvictionStrategy, HeapKey
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
_RANK_BITS = 40  # youngness: sessions first seen, counted
_MAX_SESSIONS = 1 << 16  # sessions remembered (their first-seen order)
_WINDOW_BIAS = 1 << 40  # windows may be negative (a clock that starts below zero)
_HINTED = 1 << 200  # above every window: a hinted leaf goes after every unhinted one


class SessionAwareStrategy(EvictionStrategy):
    """Hinted sessions by the window they stop being hot, youngest first within one; LRU
    without hints (see the module docstring).

    ``window_s``: how long a hot session is kept ahead of cold ones (and the width of the
    windows); ``hot_gap_s``: a session whose expected gap is at most this is hot.

    Raises:
        ConfigError: a non-positive or non-finite ``window_s``, or a negative ``hot_gap_s``.
    """

    __slots__ = ("_hot_gap", "_next_rank", "_quantum", "_ranks", "_window")

    rekey_on_release = True
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
        # Session id -> the order the cache first saw it in (oldest forgotten past the cap).
        self._ranks: OrderedDict[str, int] = OrderedDict()
        self._next_rank = 0

    def key_function(self) -> HeapKey:
        def key(node: TreeNode) -> int:
            base = node.eviction_state
            t: int = node.last_access_time
            return t if base is None else base + t

        return key

    def note_hint(self, path: Sequence[TreeNode], hint: ReuseHint) -> None:
        """``path`` is a finished request's inserted path (root excluded), ``hint`` the
        server's view of its next use: each node's key base becomes the request's (mutates
        their ``eviction_state``)."""
        at = time.monotonic() if hint.finished_at_s is None else hint.finished_at_s
        gap = hint.expected_gap_s
        if gap is None:
            gap = DEFAULT_GAPS_S[hint.stop]
        window = self._window
        keep_until = at + window if gap <= self._hot_gap else at
        bucket = math.floor(keep_until / self._quantum) + _WINDOW_BIAS
        youngness = (1 << _RANK_BITS) - 1 - self._rank(hint.session_id)
        base = _HINTED + (((bucket << _RANK_BITS) + youngness) << _CLOCK_BITS)
        for node in path:
            node.eviction_state = base

    def _rank(self, session_id: str | None) -> int:
        """How many sessions the cache saw before ``session_id`` (a request without one
        counts as the youngest session)."""
        ranks = self._ranks
        if session_id is None:
            return self._next_rank
        r = ranks.get(session_id)
        if r is None:
            r = ranks[session_id] = self._next_rank
            self._next_rank = min(r + 1, (1 << _RANK_BITS) - 1)
            if len(ranks) > _MAX_SESSIONS:
                ranks.popitem(last=False)
        return r

    def note_split(self, upper: TreeNode, lower: TreeNode) -> None:
        upper.eviction_state = lower.eviction_state
