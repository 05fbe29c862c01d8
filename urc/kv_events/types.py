"""KV placement events in SGLang 0.5.23's model (``sglang.srt.disaggregation.kv_events``).

A cache-aware router (SGLang's model gateway, NVIDIA Dynamo, llm-d) rebuilds each replica's
prefix tree from these: :class:`BlockStored` when pages appear on a tier, :class:`BlockRemoved`
when they leave it, :class:`AllBlocksCleared` when the cache is reset.  Block hashes are
SGLang's (:mod:`urc.kv_events.block_hash`), so urc's and SGLang's replicas of the same prefix
publish the same ids.

Events are built by :class:`~urc.kv_events.recorder.KVEventRecorder` when they are taken
(``cache.take_events()``), merged as SGLang's recorder merges them (extending the newest
event's lists while it builds them); once returned they belong to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "StorageMedium"]


class StorageMedium(str, Enum):
    """The tier an event is about (SGLang's ``StorageMedium``; the values go on the wire)."""

    GPU = "GPU"  # device memory
    CPU = "CPU_PINNED"  # host memory (HiCache's host tier)
    DISK = "DISK"
    EXTERNAL = "EXTERNAL"


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Pages now held on ``medium``: ``block_hashes[i]`` is the page of ``block_size`` tokens
    at ``token_ids[i * block_size:(i + 1) * block_size]``; the first page continues the
    page ``parent_block_hash`` (``None``: it starts at the root)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None = None
    medium: StorageMedium | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Pages no longer held on ``medium``."""

    block_hashes: list[int]
    medium: StorageMedium | None = None


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The cache was reset: every page on every tier is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
