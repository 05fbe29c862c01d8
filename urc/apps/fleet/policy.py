"""Routing policies: which replica serves a request, from what the router knows.

The router sees, per replica, the overlap its event index predicts (leading pages of the
prompt held on device or host) and a load: the prompt tokens routed to the replica whose
arrival lies within the last ``load_window_s`` seconds of the trace's clock (a replay serves
as fast as it can, so the trace's clock, not the wall clock, says what would be in flight;
Dynamo's "active blocks" counted the same way).

* ``round-robin``: replicas in turn.
* ``least-loaded``: the smallest load (ties: the lowest index).
* ``session-affinity``: sticky: the request's session (agentic flows), else its first
  :data:`AFFINITY_PREFIX_TOKENS` tokens, hashed onto a replica by rendezvous hashing (a
  replica is chosen for a key forever; adding one moves only its share of keys).
* ``kv-aware``: the cost of Dynamo's KV router: ``overlap_weight * tokens to prefill + load``
  (prefill: the prompt minus the predicted overlap), lowest cost wins (temperature 0; ties
  to the larger overlap, then the lowest index).  SGLang's gateway scores the same two terms
  with thresholds (cache affinity unless the load spread passes a bound); a weighted sum
  has one knob instead of three.
* ``random``: seeded uniform choice, the floor the report compares against.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "AFFINITY_PREFIX_TOKENS",
    "LoadTracker",
    "Router",
    "RouterPolicy",
    "RoutingParams",
]

AFFINITY_PREFIX_TOKENS = 2048
"""Tokens of a prompt's start that pick its replica under ``session-affinity`` when the
request has no session."""


class RouterPolicy(str, Enum):
    """How the router picks a replica (see the module docstring)."""

    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    SESSION_AFFINITY = "session-affinity"
    KV_AWARE = "kv-aware"
    RANDOM = "random"


@dataclass(frozen=True, slots=True)
class RoutingParams:
    """The policies' knobs: ``overlap_weight`` (kv-aware's weight on prefill tokens,
    Dynamo's ``--kv-overlap-score-weight``), ``load_window_s`` (how long a routed prompt
    counts as load, on the trace's clock), ``seed`` (random)."""

    overlap_weight: float = 1.0
    load_window_s: float = 30.0
    seed: int = 0


class LoadTracker:
    """Per replica, the prompt tokens routed within the last ``window_s`` seconds."""

    __slots__ = ("_load", "_recent", "_window_ms")

    def __init__(self, replicas: int, window_s: float) -> None:
        self._window_ms = window_s * 1000.0
        self._recent: deque[tuple[float, int, int]] = deque()
        self._load = [0] * replicas

    def advance(self, now_ms: float) -> list[int]:
        """Forget what left the window by ``now_ms``; returns the loads (not a copy)."""
        recent, load, horizon = self._recent, self._load, now_ms - self._window_ms
        while recent and recent[0][0] <= horizon:
            _, r, tokens = recent.popleft()
            load[r] -= tokens
        return load

    def add(self, now_ms: float, replica: int, tokens: int) -> None:
        self._recent.append((now_ms, replica, tokens))
        self._load[replica] += tokens


def _rendezvous(key: str, replicas: int) -> int:
    best, choice = b"", 0
    for r in range(replicas):
        score = hashlib.blake2b(f"{r}\0{key}".encode(), digest_size=8).digest()
        if score > best:
            best, choice = score, r
    return choice


class Router:
    """Picks replicas under one policy; keeps the policy's own state (the turn, the RNG,
    the load window).  ``choose`` then ``routed`` once per request, in arrival order."""

    def __init__(self, policy: RouterPolicy, replicas: int, params: RoutingParams) -> None:
        if replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got {replicas}")
        self.policy = policy
        self.replicas = replicas
        self.params = params
        self.load = LoadTracker(replicas, params.load_window_s)
        self._turn = 0
        self._rng = random.Random(params.seed)
        self._sticky: dict[str, int] = {}

    def choose(
        self,
        now_ms: float,
        prompt_tokens: int,
        overlaps: Sequence[int],
        affinity_key: str,
    ) -> int:
        """The replica for a request arriving at ``now_ms`` (trace clock) with
        ``prompt_tokens`` tokens, ``overlaps[r]`` tokens predicted cached on replica ``r``,
        and ``affinity_key`` (its session, or its prompt's start)."""
        n = self.replicas
        load = self.load.advance(now_ms)
        policy = self.policy
        if policy is RouterPolicy.ROUND_ROBIN:
            choice = self._turn % n
            self._turn += 1
            return choice
        if policy is RouterPolicy.RANDOM:
            return self._rng.randrange(n)
        if policy is RouterPolicy.LEAST_LOADED:
            return min(range(n), key=load.__getitem__)
        if policy is RouterPolicy.SESSION_AFFINITY:
            sticky = self._sticky.get(affinity_key)
            if sticky is None:
                sticky = self._sticky[affinity_key] = _rendezvous(affinity_key, n)
            return sticky
        w = self.params.overlap_weight
        return min(
            range(n),
            key=lambda r: (w * (prompt_tokens - overlaps[r]) + load[r], -overlaps[r], r),
        )

    def routed(self, now_ms: float, replica: int, prompt_tokens: int) -> None:
        """Record that a request of ``prompt_tokens`` went to ``replica`` at ``now_ms``."""
        self.load.add(now_ms, replica, prompt_tokens)
