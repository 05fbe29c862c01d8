"""urc's KV events (:mod:`urc.kv_events`) as SGLang 0.5.23's own event objects
(``sglang.srt.disaggregation.kv_events``), for the scheduler's ``take_events()``.

SGLang's scheduler drains ``tree_cache.take_events()`` once per batch and publishes the
list in a ``KVEventBatch`` with its own ``EventPublisher``
(``managers/scheduler_components/kv_events_publisher.py``); the publisher encodes them with
msgspec, so they must be SGLang's ``msgspec.Struct`` classes, not urc's dataclasses.  The
fields are what SGLang's ``KVCacheEventRecorder`` fills for a request without a LoRA
adapter or ``cache_salt``: ``lora_id``, ``cache_salt``, ``session_id`` and ``lora_name``
are ``None`` (docs/sglang.md lists the differences for namespaced requests).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StorageMedium,
)

from urc import kv_events

__all__ = ["to_sglang_events"]

_MEDIUM = {m: StorageMedium(m.value) for m in kv_events.StorageMedium}


def to_sglang_events(events: list[kv_events.KVEvent]) -> list[Any]:
    """SGLang's event for each of ``events``, in order (the lists are handed over, not
    copied: urc's events belong to the caller once taken)."""
    out: list[Any] = []
    for e in events:
        if type(e) is kv_events.BlockStored:
            out.append(
                BlockStored(
                    block_hashes=e.block_hashes,
                    parent_block_hash=e.parent_block_hash,
                    token_ids=e.token_ids,
                    block_size=e.block_size,
                    lora_id=e.lora_id,
                    medium=None if e.medium is None else _MEDIUM[e.medium],
                    cache_salt=e.cache_salt,
                    session_id=e.session_id,
                    lora_name=e.lora_name,
                )
            )
        elif type(e) is kv_events.BlockRemoved:
            medium = None if e.medium is None else _MEDIUM[e.medium]
            out.append(BlockRemoved(block_hashes=e.block_hashes, medium=medium))
        else:
            assert type(e) is kv_events.AllBlocksCleared, f"unknown KV event {e!r}"
            out.append(AllBlocksCleared())
    return out
