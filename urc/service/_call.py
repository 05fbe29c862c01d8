"""What travels on the service's command stream: a command with its one-shot reply slot, and
what a cancelled caller's command becomes (the classification behind the cancellation table
of :mod:`urc.service`)."""

from __future__ import annotations

from enum import Enum
from typing import Any

from urc.service._commands import (
    Alloc,
    AllocMamba,
    AllocReqMamba,
    AllocReqRow,
    CacheFinishedReq,
    CacheUnfinishedReq,
    Call,
    Command,
    Evict,
    FinishReqLoad,
    Free,
    FreeMamba,
    Insert,
    Lock,
    Match,
    MatchReq,
    Release,
    SanityCheck,
    SlideReqWindow,
    StartReqLoad,
    Stats,
    WriteReqSlots,
)

__all__ = ["ON_CANCEL", "OnCancel", "ServiceCall"]


class OnCancel(Enum):
    """What happens to a command whose caller is cancelled after sending it."""

    SKIP = 0  # skipped if the actor has not taken it yet; a lease it produced is released
    APPLY = 1  # applied anyway (a release: the lease is already marked released)
    AWAIT = 2  # the caller waits (shielded) for the outcome: slots or a request change owner


# Looked up by command type (a C-level hash; an Enum member hashes in Python).
ON_CANCEL: dict[type[Any], OnCancel] = {
    Match: OnCancel.SKIP,
    Lock: OnCancel.SKIP,
    Evict: OnCancel.SKIP,
    Stats: OnCancel.SKIP,
    SanityCheck: OnCancel.SKIP,
    Release: OnCancel.APPLY,
    Insert: OnCancel.AWAIT,
    MatchReq: OnCancel.AWAIT,
    StartReqLoad: OnCancel.AWAIT,
    FinishReqLoad: OnCancel.AWAIT,
    Alloc: OnCancel.AWAIT,
    Free: OnCancel.AWAIT,
    AllocMamba: OnCancel.AWAIT,
    FreeMamba: OnCancel.AWAIT,
    AllocReqRow: OnCancel.AWAIT,
    WriteReqSlots: OnCancel.AWAIT,
    AllocReqMamba: OnCancel.AWAIT,
    SlideReqWindow: OnCancel.AWAIT,
    CacheFinishedReq: OnCancel.AWAIT,
    CacheUnfinishedReq: OnCancel.AWAIT,
    Call: OnCancel.AWAIT,
}


class ServiceCall:
    """One in-flight command: what travels on the stream, and the one-shot reply slot the
    actor fills.

    ``reply`` wakes the caller: a bare ``asyncio.Future`` on asyncio (awaited directly; a
    cancelled caller cancels it, so the actor only sets it if not done), an ``anyio.Event``
    otherwise (trio), ``None`` for calls the service sends on behalf of a caller that is gone.
    """

    __slots__ = ("abandoned", "command", "done", "error", "reply", "result", "sent_at")

    def __init__(self, command: Command, sent_at: float, reply: Any) -> None:
        self.command = command
        self.sent_at = sent_at
        self.reply = reply
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        # Set by a caller that stopped waiting before the actor took the command.
        self.abandoned = False
