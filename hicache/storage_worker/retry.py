"""How the storage worker backs off after failed storage calls, and retries its writes."""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio

from urc.errors import ConfigError

__all__ = ["Backoff", "RetryPolicy"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How the worker backs off after a failed storage call: the first failure pauses
    storage calls for ``initial_s``, each further one in a row multiplies the pause by
    ``multiplier`` up to ``max_s``; a success ends it.  A backup is written at most
    ``max_attempts`` times.  After ``down_after`` failed calls in a row the store is known to
    be down: a flush (or the worker's close) then drops the queued writes at once instead of
    retrying each with its own back-off."""

    initial_s: float = 0.05
    max_s: float = 2.0
    multiplier: float = 2.0
    max_attempts: int = 5
    down_after: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.multiplier < 1 or self.max_attempts < 1:
            raise ConfigError(f"invalid retry policy: {self}")
        if self.down_after < 1:
            raise ConfigError(f"down_after must be >= 1: {self}")


class Backoff:
    """The worker's pause after failed storage calls (see :class:`RetryPolicy`)."""

    __slots__ = ("delay", "failures", "policy", "until")

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.delay = 0.0
        self.until = 0.0
        self.failures = 0  # failed calls in a row

    def failed(self) -> None:
        p = self.policy
        self.delay = p.initial_s if self.delay == 0.0 else min(self.delay * p.multiplier, p.max_s)
        self.until = time.monotonic() + self.delay
        self.failures += 1

    def succeeded(self) -> None:
        self.delay = 0.0
        self.until = 0.0
        self.failures = 0

    @property
    def store_down(self) -> bool:
        """Whether the last ``down_after`` calls all failed."""
        return self.failures >= self.policy.down_after

    @property
    def active(self) -> bool:
        """Whether storage calls are paused now."""
        return self.until > 0.0 and time.monotonic() < self.until

    async def wait(self) -> None:
        """Sleep until the pause is over."""
        remaining = self.until - time.monotonic()
        if remaining > 0:
            await anyio.sleep(remaining)
