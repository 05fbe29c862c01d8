"""Moved: the host tier's data types are :mod:`urc.host_protocol` (a floor below the
components, which import them; :mod:`urc.host` keeps the transfers, which import eviction).
This name re-exports them for code written before the move."""

from __future__ import annotations

from urc.host_protocol import (
    BackupTicket,
    HostPart,
    HostTier,
    LoadTicket,
    TierEvents,
    TransferCompletion,
    TransferItem,
    WritePolicy,
)

__all__ = [
    "BackupTicket",
    "HostPart",
    "HostTier",
    "LoadTicket",
    "TierEvents",
    "TransferCompletion",
    "TransferItem",
    "WritePolicy",
]
