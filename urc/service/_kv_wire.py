"""SGLang 0.5.23's KV-event wire format (``sglang/srt/disaggregation/kv_events.py``).

A batch is a msgpack array ``[ts, events, attn_dp_rank]``; each event a msgpack map tagged
``"type": <class name>`` whose other keys are the field names in declaration order, optional
fields that hold their default (``None``) left out (msgspec's ``omit_defaults``).  On the PUB
socket a batch travels as three frames ``topic / 8-byte big-endian sequence / payload``; the
replay ROUTER answers ``[identity, b"", start_seq]`` with each buffered batch at or after
``start_seq`` as ``[identity, b"", topic, seq, payload]`` and ends with
``[identity, b"", b"", END_SEQ, b""]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from urc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["END_SEQ", "batch_to_wire", "event_to_wire", "seq_bytes"]

#: The replay stream's end marker (sequence -1).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    """A sequence number as its 8-byte big-endian frame."""
    return seq.to_bytes(8, "big")


def event_to_wire(event: KVEvent) -> dict[str, Any]:
    """One event as the msgpack map SGLang's msgspec types encode to."""
    if type(event) is BlockStored:
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
        }
        if event.medium is not None:
            out["medium"] = event.medium.value
        if event.cache_salt is not None:
            out["cache_salt"] = event.cache_salt
        if event.session_id is not None:
            out["session_id"] = event.session_id
        if event.lora_name is not None:
            out["lora_name"] = event.lora_name
        return out
    if type(event) is BlockRemoved:
        out = {"type": "BlockRemoved", "block_hashes": event.block_hashes}
        if event.medium is not None:
            out["medium"] = event.medium.value
        return out
    assert type(event) is AllBlocksCleared, f"not a KV event: {event!r}"
    return {"type": "AllBlocksCleared"}


def batch_to_wire(ts: float, events: Sequence[KVEvent], attn_dp_rank: int) -> list[Any]:
    """A batch as the msgpack array SGLang's ``KVEventBatch`` encodes to."""
    return [ts, [event_to_wire(e) for e in events], attn_dp_rank]
