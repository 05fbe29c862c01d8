"""A test-only transfer engine that defers every copy until its completion is waited on.

It models the slowest legal accelerator: a submitted transfer has not moved a byte until
someone waits on it.  Code that reads a backup's host slots, commits them, or unpins a
load's source before waiting sees wrong bytes (or leaves the copy to run after the slots
were reused) -- which real streams only show under load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache.transfer_engine import Completion, Lane, TransferEngine

__all__ = ["DeferredCompletion", "DeferredEngine"]


class DeferredCompletion(Completion):
    """Runs its transfer's work on the first :meth:`wait` (or :meth:`wait_stream`)."""

    __slots__ = ("_work", "lane")

    def __init__(self, lane: Lane, work: Callable[[], Any]) -> None:
        self.lane = lane
        self._work: Callable[[], Any] | None = work

    def done(self) -> bool:
        return self._work is None

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            work()

    def wait_stream(self, stream: Any = None) -> None:
        self.wait()


class DeferredEngine(TransferEngine):
    """Every submitted transfer waits for its completion's :meth:`~DeferredCompletion.wait`;
    ``submitted`` lists them (those never waited on are still pending)."""

    __slots__ = ("submitted",)

    def __init__(self) -> None:
        self.submitted: list[DeferredCompletion] = []

    def submit(self, lane: Lane, work: Callable[[], Any]) -> Completion:
        done = DeferredCompletion(lane, work)
        self.submitted.append(done)
        return done

    def pending(self) -> int:
        """Transfers submitted and not yet waited on."""
        return sum(not d.done() for d in self.submitted)
