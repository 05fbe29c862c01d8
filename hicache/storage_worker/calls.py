"""``StoreCalls``: the storage worker's calls to its backend, each counted when it fails."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from typing import Any

import torch

from hicache.storage.base import StorageBackend
from hicache.storage.errors import StorageError
from hicache.storage.keys import page_keys
from hicache.storage.sglang_keys import SGLangNaming, sglang_page_keys
from hicache.storage.stats import StorageErrorObserver, StorageOp
from hicache.storage_worker.layout import STORAGE_COMPONENT
from hicache.storage_worker.retry import Backoff, RetryPolicy
from hicache.storage_worker.sglang_pages import SGLangPagePayload
from hicache.storage_worker.stats import StorageWorkerStats
from urc.node import ComponentType
from urc.service import ServiceObserver

__all__ = ["StoreCalls"]

_log = logging.getLogger("hicache.storage_worker")


class StoreCalls:
    """The backend as the worker calls it: always with ``raise_errors=True`` (a failure is
    never mistaken for a miss); a failed call is counted in ``stats.errors``, reported to an
    observer that takes storage errors, backs the worker off and reads as ``None``.

    With ``sglang`` (the SGLang key scheme: its naming, and the payload converter when urc's
    rows are not SGLang's payload already) keys are SGLang's and Full page rows are
    converted to SGLang's payload on the way out and back on the way in; without it keys
    are urc's and rows are stored as they are."""

    __slots__ = ("backoff", "naming", "page_size", "payload", "sink", "stats", "storage")

    def __init__(
        self,
        storage: StorageBackend,
        stats: StorageWorkerStats,
        retry: RetryPolicy,
        page_size: int,
        observer: ServiceObserver | None,
        sglang: tuple[SGLangNaming, SGLangPagePayload | None] | None = None,
    ) -> None:
        self.storage = storage
        self.naming: SGLangNaming | None = None
        self.payload: SGLangPagePayload | None = None
        if sglang is not None:
            self.naming, self.payload = sglang
        self.stats = stats
        self.backoff = Backoff(retry)
        self.page_size = page_size
        sink: object = observer  # a ServiceObserver that may also take storage errors
        self.sink = sink if isinstance(sink, StorageErrorObserver) else None

    def keys(
        self, tokens: Sequence[int], namespace: Any, ct: ComponentType = ComponentType.FULL
    ) -> list[str]:
        """The chained page keys of ``tokens`` for component ``ct`` (CPU-bound: call it in
        a worker thread)."""
        if self.naming is not None:
            assert ct is ComponentType.FULL, f"SGLang keys name Full pages only, not {ct}"
            return sglang_page_keys(tokens, self.page_size, self.naming, namespace)
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
        if self.payload is not None:
            rows = self.payload.to_sglang(rows)
        return await self.call(StorageOp.PUT, self.storage.put(keys, list(rows), raise_errors=True))

    async def get_leading(
        self, keys: list[str], rows: torch.Tensor, got: list[int], batch: int
    ) -> None:
        """Read leading pages into ``rows``, ``batch`` at a time, adding each batch's count
        to ``got[0]`` as it arrives (a deadline keeps what arrived); a failed call or a short
        batch ends the read."""
        storage = self.storage
        payload = self.payload
        for i in range(0, len(keys), batch):
            part = keys[i : i + batch]
            dest = rows[i : i + len(part)]
            staged = dest if payload is None else torch.empty_like(dest)
            n = await self.call(StorageOp.GET, storage.get(part, list(staged), raise_errors=True))
            if payload is not None and n:
                dest[:n] = payload.from_sglang(staged[:n])
            got[0] += n or 0
            if n is None or n < len(part):
                break
