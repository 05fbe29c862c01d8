"""KV events for cache-aware routers, in SGLang 0.5.23's model.

``cache.enable_kv_events()`` turns them on (off by default: the operations then test one
attribute and do nothing else); ``cache.take_events()`` drains them.  The service's
:class:`urc.service.KVEventPublisher` publishes them over ZMQ in SGLang's wire format.
"""

from urc.kv_events.block_hash import hash_to_int64, page_digests
from urc.kv_events.recorder import KVEventRecorder
from urc.kv_events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    StorageMedium,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventRecorder",
    "StorageMedium",
    "hash_to_int64",
    "page_digests",
]
