"""What travels on the service's command stream: a command with its one-shot reply slot, and
what a cancelled caller's command becomes (the classification behind the cancellation table
of :mod:`urc.service`)."""

from __future__ import annotations

from typing import Any

from urc.service._commands import COMMAND_TYPES, Command, OnCancel

__all__ = ["ON_CANCEL", "ServiceCall"]


# Each command's cancellation policy (its ``on_cancel``), looked up by command type: a
# C-level hash, where an attribute read through the instance would cost more.
ON_CANCEL: dict[type[Any], OnCancel] = {cls: cls.on_cancel for cls in COMMAND_TYPES}


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
