"""``StoreCalls``: the storage worker's calls to its backend, each counted when it fails."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

import torch

from hicache.storage.base import StorageBackend
from hicache.storage.errors import StorageError
from hicache.storage.keys import page_keys
from hicache.storage.stats import StorageErrorObserver, StorageOp
from hicache.storage_worker.layout import STORAGE_COMPONENT
from hicache.storage_worker.retry import Backoff, RetryPolicy
from hicache.storage_worker.stats import StorageWorkerStats
from urc.node import ComponentType
from urc.service import ServiceObserver

__all__ = ["StoreCalls"]

_log = logging.getLogger("hicache.storage_worker")


class StoreCalls:
    """The backend as the worker calls it: always with ``raise_errors=True`` (a failure is
    never mistaken for a miss); a failed call is counted in ``stats.errors``, reported to an
    observer that takes storage errors, backs the worker off and reads as ``None``."""

    __slots__ = ("backoff", "page_size", "sink", "stats", "storage")

    def __init__(
        self,
        storage: StorageBackend,
        stats: StorageWorkerStats,
        retry: RetryPolicy,
        page_size: int,
        observer: ServiceObserver | None,
    ) -> None:
        self.storage = storage
        self.stats = stats
        self.backoff = Backoff(retry)
        self.page_size = page_size
        sink: object = observer  # a ServiceObserver that may also take storage errors
        self.sink = sink if isinstance(sink, StorageErrorObserver) else None

    def keys(
        self, tokens: list[Any], namespace: Any, ct: ComponentType = ComponentType.FULL
    ) -> list[str]:
        """The chained page keys of ``tokens`` for component ``ct`` (CPU-bound: call it in
        a worker thread)."""
        return page_keys(tokens, self.page_size, STORAGE_COMPONENT[ct], namespace)

    async def call(self, op: StorageOp, call: Awaitable[int]) -> int | None:
        """Await one storage call (made with ``raise_errors=True``); a failure is counted,
        reported to the observer and backs the worker off, and returns ``None``."""
        try:
            n = await call
        except StorageError as exc:
            self.stats.errors += 1
            self.backoff.failed()
            if self.sink is not None:
                self.sink.on_storage_error(self.storage.name, op)
            _log.warning("storage %s failed: %s", op.value, exc)
            return None
        self.backoff.succeeded()
        return n

    async def exists(self, keys: list[str]) -> int | None:
        """Leading stored ``keys`` (``None``: the call failed)."""
        return await self.call(StorageOp.EXISTS, self.storage.exists(keys, raise_errors=True))

    async def put(self, keys: list[str], rows: torch.Tensor) -> int | None:
        """Store one page row per key; returns how many (``None``: the call failed)."""
        return await self.call(StorageOp.PUT, self.storage.put(keys, list(rows), raise_errors=True))

    async def get_leading(
        self, keys: list[str], rows: torch.Tensor, got: list[int], batch: int
    ) -> None:
        """Read leading pages into ``rows``, ``batch`` at a time, adding each batch's count
        to ``got[0]`` as it arrives (a deadline keeps what arrived); a failed call or a short
        batch ends the read."""
        storage = self.storage
        for i in range(0, len(keys), batch):
            part = keys[i : i + batch]
            bufs = list(rows[i : i + len(part)])
            n = await self.call(StorageOp.GET, storage.get(part, bufs, raise_errors=True))
            got[0] += n or 0
            if n is None or n < len(part):
                break
