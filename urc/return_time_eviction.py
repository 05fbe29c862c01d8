"""Return-time eviction: the order of ``EvictionPolicy.RETURN_TIME``.

The offline optimum on agentic sessions is nearly all one thing: knowing when each session
comes back, evicting first what is late (probably gone), then what comes back furthest in
the future.  This policy predicts that time online from the :class:`~urc.reuse_hint.ReuseHint`
a server gives when it caches a finished request:

* **A stamp per finished request.**  Every node of the request's path points to one
  :class:`_Stamp` (``node.eviction_state``): the finish time, the stop reason, the session.
  A later request of the same session whose prompt extends this one's (same length reached,
  same token there) is this path's reuse: its gap is counted in the stop reason's
  :class:`~urc.gap_model.GapHistogram` (learned online; a path not reused within
  ``horizon_s`` counts as never).
* **A predicted return that moves as time passes.**  At age ``a`` (seconds since the finish,
  on the hints' clock) the stamp's predicted return is the finish plus the ``quantile``-th
  quantile of the gap given that it is at least ``a`` (``a`` rounded down to the
  histogram's bins: 1, 1.4, 2, 2.8, ... s).  When that quantile is "never", the prediction has
  expired.  After a tool call this is seconds, and it grows when the session is late; after
  an answer, minutes, or expiry once the session is late enough that most such sessions
  never came back.
* **The session's own gaps.**  Each session also keeps its own recent gaps per stop reason
  (older ones fading, ``own_weight``); a prediction reads the mix of the two, the stop
  reason's distribution counting as ``own_prior`` of the session's gaps.  A session whose
  tool calls take minutes stays pending that long; one whose requests come in seconds
  expires as soon as it is late.
* **Sub-agents apart.**  A hint with a ``parent_id`` (a sub-agent's flow) counts its gaps
  in distributions of their own: a sub-agent's final answer goes to its parent and never
  comes back (prior: never), where a person answers a main agent's minutes later.  Its
  parent waits on it: the parent's latest tool call (the one that started it) is due when
  the sub-agent next returns, or at once when it answered, for as long again (a quantum at
  least), then its own prediction again (O(1) per hint).
* **The order.**  Leaves without a hint and leaves whose prediction expired go first, least
  recently used first (so without hints the order is exactly LRU's); then the pending ones,
  furthest predicted return first, quantized to ``quantum_s``; within a quantum the session
  the cache saw first goes first (an old session is nearer its end), then LRU.
* **Expiry re-keyed lazily: a timer queue.**  A stamp's key changes only when its age
  crosses a bin edge (about twenty times in ``horizon_s``), and only downwards (a later
  return, or expiry).  Each stamp holds one entry in a heap of (next edge, stamp); the
  hints advance the clock (the latest ``finished_at_s``, or ``time.monotonic()``), and each
  hint first fires the timers that are due.  A stamp's nodes are a run of one root path,
  so only its deepest node on device can be a leaf: that one gets a fresh Full-heap entry
  (``note_hint`` returns it, as it returns the nodes a hint lowered); the others read the
  new key when they become leaves.  The stamp finds that node from its tail through parent
  links, stepping once over each node deleted under it.  So a timer step is O(log n), a
  hint O(its path) plus amortized O(bins) timer steps, and the key is one int,
  ``stamp.base + last_access_time``, as cheap to read as the session-aware policy's.

Sessions are remembered in first-seen order (for the tie-break and the open stamps a later
request may extend), the latest 65,536 of them.  The defaults (``quantile`` 0.6,
``horizon_s`` 1024, ``quantum_s`` 5, ``bin_ratio`` sqrt(2), ``own_weight`` 8, ``own_prior``
4) were chosen on the even-numbered half of the agentic sessions and checked on the odd half
(docs/eviction.md).
"""

from __future__ import annotations

import heapq
import math
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from urc.errors import ConfigError
from urc.eviction_strategy import EvictionStrategy, HeapKey
from urc.gap_model import GapHistogram, gap_edges, predict_gap
from urc.node import TreeNode
from urc.reuse_hint import ReuseHint, StopReason

__all__ = ["PRIOR_GAPS_S", "SUB_AGENT_PRIOR_GAPS_S", "ReturnTimeStrategy"]

PRIOR_GAPS_S: dict[StopReason | None, float | None] = {
    StopReason.TOOL_USE: 9.0,  # median gap after a tool call in the agentic traces
    StopReason.END_TURN: 300.0,  # median gap after an answer (a person types)
    StopReason.MAX_TOKENS: 1.0,  # the client continues at once
    StopReason.OTHER: 15.0,  # side requests: the session is mid-turn
    None: 15.0,
}
"""Each stop reason's prior gap (seconds; ``None``: never), before anything is learned."""

SUB_AGENT_PRIOR_GAPS_S: dict[StopReason | None, float | None] = {
    **PRIOR_GAPS_S,
    StopReason.END_TURN: None,  # a sub-agent's answer goes to its parent: its flow ends
}
"""The same for sub-agents' flows (hints with a ``parent_id``), learned apart from the rest."""

_CLOCK_BITS = 48  # last_access_time (a logical clock: one tick per node touched)
_RANK_BITS = 40  # sessions first seen, counted
_QUANTUM_BIAS = 1 << 60  # quantized return times may be negative (a clock below zero)
_PENDING = 1 << 200  # above every LRU key: a pending prediction goes after every expired one
_MAX_SESSIONS = 1 << 16  # sessions remembered
_SQRT2 = math.sqrt(2.0)
_OPEN_PER_SESSION = 4  # a session's stamps that a later request may still extend


class _Session:
    __slots__ = ("open", "own", "rank", "tool")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.open: list[_Stamp] = []
        # Its latest tool call's stamp: the one a sub-agent it started keeps due.
        self.tool: _Stamp | None = None
        # The session's own gaps, per stop reason: counts per bin, then never.
        self.own: dict[StopReason | None, list[float]] = {}


class _Stamp:
    """One finished request's prediction, shared by the nodes of its path."""

    __slots__ = (
        "armed",
        "at",
        "base",
        "bin",
        "fixed_gap",
        "hold",
        "hold_due",
        "length",
        "model",
        "open",
        "probe",
        "rank",
        "ret",
        "session",
        "stop",
        "tail",
        "timer",
    )

    def __init__(
        self,
        at: float,
        model: GapHistogram,
        rank: int,
        fixed_gap: float | None,
        session: _Session | None,
        stop: StopReason | None,
    ) -> None:
        self.session = session
        self.stop = stop
        self.at = at
        self.model = model
        self.rank = rank
        self.fixed_gap = fixed_gap
        self.base = 0
        self.bin = 0
        self.length = 0
        self.probe: Any = None
        # Whether a later request of its session may still extend it (its gap not counted).
        self.open = False
        # The deepest node of its path that carries it (see ``_leaf``); its nodes are a
        # contiguous run of one root path, so only the deepest can be a leaf.
        self.tail: TreeNode | None = None
        self.armed = True  # False once no timer will re-key it
        self.timer = 0  # the sequence number of its live timer (older ones are skipped)
        # A sub-agent's parent: due at ``hold`` (its sub-agent's predicted return) until
        # ``hold_due``; then its own prediction again.
        self.hold: float | None = None
        self.hold_due = 0.0
        self.ret: float | None = None  # the predicted return (None: expired)


class ReturnTimeStrategy(EvictionStrategy):
    """Expired and unhinted leaves first (LRU), then the furthest predicted return (see the
    module docstring).

    ``quantile``: which quantile of the learned gap is the predicted return (0 < q < 1;
    higher keeps late sessions longer); ``horizon_s``: gaps at or past it count as never;
    ``quantum_s``: the resolution of predicted returns; ``bin_ratio``: the ratio of
    consecutive bin edges (1, ratio, ratio**2, ... seconds); ``own_weight``: a session's own
    gaps count with a memory of about this many of its gaps (0: not at all), next to its
    stop reason's distribution, which counts as ``own_prior`` of the session's gaps.

    Raises:
        ConfigError: ``quantile`` outside (0, 1), ``horizon_s`` or ``bin_ratio`` not above 1,
            a non-positive ``quantum_s`` or ``own_prior``, an ``own_weight`` in (0, 1] (or any
            of them not finite).
    """

    __slots__ = (
        "_edges",
        "_models",
        "_next_rank",
        "_now",
        "_own_prior",
        "_own_weight",
        "_quantile",
        "_quantum",
        "_seq",
        "_sessions",
        "_timers",
    )

    keeps_node_state = True
    uses_hints = True

    def __init__(
        self,
        quantile: float = 0.6,
        horizon_s: float = 1024.0,
        quantum_s: float = 5.0,
        bin_ratio: float = _SQRT2,
        own_weight: float = 8.0,
        own_prior: float = 4.0,
    ) -> None:
        if not (math.isfinite(quantile) and 0 < quantile < 1):
            raise ConfigError(f"return quantile must be in (0, 1), got {quantile}")
        if not (math.isfinite(horizon_s) and horizon_s > 1):
            raise ConfigError(f"return horizon_s must be above 1, got {horizon_s}")
        if not (math.isfinite(quantum_s) and quantum_s > 0):
            raise ConfigError(f"return quantum_s must be positive, got {quantum_s}")
        if not (math.isfinite(bin_ratio) and bin_ratio > 1):
            raise ConfigError(f"return bin_ratio must be above 1, got {bin_ratio}")
        if not (math.isfinite(own_weight) and (own_weight == 0 or own_weight > 1)):
            raise ConfigError(f"return own_weight must be 0 or above 1, got {own_weight}")
        if not (math.isfinite(own_prior) and own_prior > 0):
            raise ConfigError(f"return own_prior must be positive, got {own_prior}")
        self._quantile = float(quantile)
        self._quantum = float(quantum_s)
        self._edges = gap_edges(horizon_s, bin_ratio)
        self._own_weight = own_weight
        self._own_prior = own_prior
        # Per (stop reason, whether the flow is a sub-agent's): their gaps differ.
        self._models = {
            (s, sub): GapHistogram(self._edges, g)
            for sub, priors in ((False, PRIOR_GAPS_S), (True, SUB_AGENT_PRIOR_GAPS_S))
            for s, g in priors.items()
        }
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._next_rank = 0
        self._now = -math.inf
        self._timers: list[tuple[float, int, _Stamp]] = []
        self._seq = 0

    def key_function(self) -> HeapKey:
        def key(node: TreeNode) -> int:
            st = node.eviction_state
            t: int = node.last_access_time
            return t if st is None else st.base + t

        return key

    # ------------------------------------------------------------------ hints
    def note_hint(self, path: Sequence[TreeNode], hint: ReuseHint) -> list[TreeNode]:
        """``path`` (a finished request's inserted path, root excluded) gets a fresh stamp
        (mutates its nodes' ``eviction_state``); the clock moves to the hint's finish and
        the timers due fire; the session's earlier path this one extends, if any, counts
        its gap.  Returns the nodes whose key dropped (a timer's or this hint's)."""
        at = time.monotonic() if hint.finished_at_s is None else hint.finished_at_s
        if at > self._now:
            self._now = at
        dropped = self._fire(self._now)
        session = self._session(hint.session_id)
        ends = list(accumulate(n.key_len for n in path))
        if session is not None and session.open and ends:
            self._observe(session, path, ends, at)
        stamp = _Stamp(
            at,
            self._models[hint.stop, hint.parent_id is not None],
            self._next_rank if session is None else session.rank,
            hint.expected_gap_s,
            session,
            hint.stop,
        )
        if ends:
            stamp.length = ends[-1]
            last = stamp.tail = path[-1]
            stamp.probe = last.key[last.key_len - 1] if last.key_len else None
        if session is not None and ends and hint.expected_gap_s is None:
            stamp.open = True
            session.open.append(stamp)
            if len(session.open) > _OPEN_PER_SESSION:
                session.open.pop(0).open = False  # too old to tell: not counted
        self._advance(stamp, self._now)
        base = stamp.base
        for node in path:
            old = node.eviction_state
            node.eviction_state = stamp
            if old is not None and base < old.base:
                dropped.append(node)
        if session is not None and hint.stop is StopReason.TOOL_USE and ends:
            session.tool = stamp
        if hint.parent_id is not None:
            self._hold_parent(hint.parent_id, stamp, dropped)
        return dropped

    def _hold_parent(self, parent_id: str, child: _Stamp, dropped: list[TreeNode]) -> None:
        """A sub-agent's request finished: its parent, waiting on it, is due when the
        sub-agent next returns (at once, when it answered: the answer goes to the parent),
        for as long again (a quantum at least); its path's key may drop (``dropped``)."""
        parent = self._sessions.get(parent_id)
        st = None if parent is None else parent.tool
        if st is None or st.at > child.at:
            return
        carried, leaf = _leaf(st)
        if not carried:
            parent.tool = None  # type: ignore[union-attr]
            return
        now = self._now
        ret = now if child.ret is None else max(child.ret, now)
        st.hold = ret
        st.hold_due = ret + (ret - now) + self._quantum
        st.armed = True
        if self._advance(st, now) and leaf is not None:
            dropped.append(leaf)

    def note_split(self, upper: TreeNode, lower: TreeNode) -> None:
        # ``upper`` is ``lower``'s new parent: the stamp's tail (below it) finds it through
        # the parent links when ``lower`` goes.
        upper.eviction_state = lower.eviction_state

    # ------------------------------------------------------------------ internals
    def _session(self, session_id: str | None) -> _Session | None:
        if session_id is None:
            return None
        sessions = self._sessions
        s = sessions.get(session_id)
        if s is None:
            s = sessions[session_id] = _Session(self._next_rank)
            self._next_rank = min(self._next_rank + 1, (1 << _RANK_BITS) - 1)
            if len(sessions) > _MAX_SESSIONS:
                sessions.popitem(last=False)
        return s

    def _observe(
        self, session: _Session, path: Sequence[TreeNode], ends: list[int], at: float
    ) -> None:
        """Count the gap of each open stamp of ``session`` whose prompt ``path`` extends
        (``path`` reaches its length with the same token there)."""
        total = ends[-1]
        keep = []
        for st in session.open:
            n = st.length
            hit = False
            if 0 < n <= total:
                i = bisect_left(ends, n)
                node = path[i]
                pos = n - 1 - (ends[i] - node.key_len)
                hit = node.key[pos] == st.probe
            if not st.open:
                continue  # counted as never at the horizon
            if hit:
                st.open = False
                gap = max(at - st.at, 0.0)
                st.model.add(gap)
                self._own(session, st.stop, st.model.bin_of(gap))
            else:
                keep.append(st)
        session.open = keep

    def _own(self, session: _Session, stop: StopReason | None, j: int) -> None:
        """Count bin ``j`` (``bins``: never) in ``session``'s own gaps after ``stop``."""
        if not self._own_weight:
            return
        own = session.own.get(stop)
        if own is None:
            own = session.own[stop] = [0.0] * (len(self._edges) - 1 + 1)
        decay = 1.0 - 1.0 / self._own_weight  # older gaps of the session weigh less
        for i in range(len(own)):
            own[i] *= decay
        own[j] += 1.0

    def _advance(self, stamp: _Stamp, now: float) -> bool:
        """Set ``stamp``'s key base for its age at ``now`` and arm its next timer; True if
        the base dropped."""
        age = now - stamp.at
        old = stamp.base
        fixed = stamp.fixed_gap
        model = stamp.model
        ret: float | None
        nxt: float | None
        hold = stamp.hold
        if hold is not None and now < stamp.hold_due:
            ret = hold
            nxt = stamp.hold_due
            j = stamp.bin
        elif fixed is not None:
            # The server's own estimate: kept until twice the gap (a quantum at least).
            # Compared as the timer's own time: ``now - at`` may round below it.
            due = stamp.at + 2 * fixed + self._quantum
            late = now >= due
            ret = None if late else stamp.at + fixed
            nxt = None if late else due
            j = model.bins
        else:
            stamp.hold = None
            j = model.bin_of(age)
            # ``now - at`` may round below the edge whose timer fired: never re-arm a timer
            # that is already due (it would fire again at once, forever).
            while j < model.bins and stamp.at + self._edges[j + 1] <= now:
                j += 1
            own = None if stamp.session is None else stamp.session.own.get(stamp.stop)
            if j >= model.bins:
                gap = None
            elif own is None or not self._own_weight:
                gap = model.predict(j, self._quantile)
            else:
                # The session's own gaps, next to the stop reason's (worth ``own_prior``
                # observations of the session).
                w = self._own_prior / model.total
                mixed = [w * c + o for c, o in zip(model.counts, own, strict=False)]
                gap = predict_gap(self._edges, mixed, w * model.never + own[-1], j, self._quantile)
            ret = None if gap is None else stamp.at + gap
            nxt = stamp.at + self._edges[j + 1] if j < model.bins else None
        stamp.bin = j
        stamp.ret = ret
        if ret is None:
            stamp.base = 0
        else:
            q = math.floor(ret / self._quantum) + _QUANTUM_BIAS
            stamp.base = _PENDING + (((((1 << 62) - q) << _RANK_BITS) + stamp.rank) << _CLOCK_BITS)
        if nxt is None:
            stamp.armed = False
            if stamp.open and j >= model.bins:
                stamp.open = False  # not extended within the horizon: a never
                model.add_never()
                if stamp.session is not None:
                    self._own(stamp.session, stamp.stop, model.bins)
        else:
            self._seq += 1
            stamp.timer = self._seq
            heapq.heappush(self._timers, (nxt, self._seq, stamp))
        return stamp.base < old

    def _fire(self, now: float) -> list[TreeNode]:
        """Advance every stamp whose timer is due at ``now``; the nodes whose key dropped
        (at most one per stamp: its only possible device leaf)."""
        timers = self._timers
        out: list[TreeNode] = []
        while timers and timers[0][0] <= now:
            _, seq, stamp = heapq.heappop(timers)
            if not stamp.armed or seq != stamp.timer:
                continue
            carried, leaf = _leaf(stamp)
            if not carried and not stamp.open:
                stamp.armed = False  # superseded and already counted: nothing to re-key
                continue
            if self._advance(stamp, now) and leaf is not None:
                out.append(leaf)
        return out


def _leaf(stamp: _Stamp) -> tuple[bool, TreeNode | None]:
    """Whether any node still carries ``stamp``, and the deepest one on device (the only one
    of its path that can be a device leaf: the others have it below them).

    The stamp's nodes are a contiguous run of one root path (a later hint re-stamps a
    prefix of it; a split hands the stamp to the new parent), so they are found from the
    tail up through parent links.  Deleted nodes are gone for good: the tail moves above
    them (each node is passed once, amortized O(1)).  Nodes evicted to the host tier are
    passed each time (a load-back may bring them to the device again)."""
    node = stamp.tail
    while node is not None and node.deleted:
        node = node.parent
    if node is None or node.eviction_state is not stamp:
        stamp.tail = None
        return False, None
    stamp.tail = node
    while node.evicted:
        node = node.parent
        if node is None or node.eviction_state is not stamp:
            return True, None
    return True, node
