"""HiCache: the tiers below device memory (host memory L2, storage L3) and their transfers.

:func:`attach` gives a cache its host tier and, optionally, an L3 store, and returns the
background workers for the service (:class:`HiCache`).  ``hicache.storage`` holds the L3
storage protocol and its backends; ``hicache.storage_worker`` the L3 worker.
:func:`attach_storage` / :func:`detach_storage` add or remove the L3 store of a running
service.  :class:`WritePolicy` (when device KV is copied to host) is the core's
(``urc.host_protocol``), re-exported here beside the config that takes it.
"""

from __future__ import annotations

from hicache.config import HiCacheConfig, StorageConfig
from hicache.host_layout import HostLayout
from hicache.storage_attach import attach_storage, detach_storage
from hicache.wiring import HiCache, attach
from urc.host_protocol import WritePolicy

__all__ = [
    "HiCache",
    "HiCacheConfig",
    "HostLayout",
    "StorageConfig",
    "WritePolicy",
    "attach",
    "attach_storage",
    "detach_storage",
]
