"""Former name of :mod:`urc.host_protocol` (kept so existing imports keep working)."""

from __future__ import annotations

from urc.host_protocol import (
    BackupTicket,
    HostTier,
    LoadTicket,
    TierEvents,
    TransferItem,
    WritePolicy,
)

__all__ = ["BackupTicket", "HostTier", "LoadTicket", "TierEvents", "TransferItem", "WritePolicy"]
