"""``MooncakeStorage``: an optional L3 backend on Mooncake Store (a distributed KV store).

Needs the ``mooncake`` package (``pip install mooncake-transfer-engine-non-cuda`` on CPU-only
Linux; it also needs ``libibverbs`` installed, even for TCP) and a running ``mooncake_master``.
The package is imported only by ``MooncakeStorage.open``, so this module imports without it.

Mooncake's Python client is synchronous, so every call runs in a worker thread under the
backend's deadline.  On a timeout the caller gets a miss at once while the abandoned call
finishes in its thread.  Values are ``encode_page(buffer)`` bytes moved with
``put_batch``/``get_batch``; those stage data in the client's ``local_buffer_size`` buffer,
so a batch is split into chunks that fit half of it.  Mooncake leaves eviction to the store's
master (``eviction_high_watermark_ratio``): a full store makes ``put_batch`` fail, which reads
here as "stored fewer".
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import anyio
import torch

from hicache.storage.base import StorageBackend
from hicache.storage.codec import (
    HEADER_SIZE,
    PageStatus,
    decode_page_into_async,
    encode_page_async,
)
from hicache.storage.errors import StorageUnavailableError
from hicache.storage.keys import PageKey
from urc.errors import ConfigError

__all__ = ["MooncakeConfig", "MooncakeProtocol", "MooncakeStorage"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_MiB = 1 << 20


class MooncakeProtocol(Enum):
    """Transport between Mooncake clients."""

    TCP = "tcp"
    RDMA = "rdma"


@dataclass(frozen=True)
class MooncakeConfig:
    """How this process joins a Mooncake store.

    ``master_address``: ``host:port`` of ``mooncake_master``.  ``global_segment_size``: bytes of
    this process's memory lent to the store; ``local_buffer_size``: the client's staging buffer
    (bounds one transfer chunk).  ``setup_timeout_s`` bounds joining (the client retries for
    about 90 s against a missing master); ``op_timeout_s`` bounds each batch.
    """

    master_address: str
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: MooncakeProtocol = MooncakeProtocol.TCP
    rdma_devices: str = ""
    global_segment_size: int = 256 * _MiB
    local_buffer_size: int = 64 * _MiB
    key_prefix: str = ""
    setup_timeout_s: float = 30.0
    op_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if ":" not in self.master_address:
            raise ConfigError(f"master_address must be host:port, not {self.master_address!r}")
        if self.global_segment_size < 0 or self.local_buffer_size < _MiB:
            raise ConfigError("segment size must be >= 0 and local_buffer_size >= 1 MiB")
        if min(self.setup_timeout_s, self.op_timeout_s) <= 0:
            raise ConfigError("timeouts must be positive")


def _chunks(sizes: Sequence[int], budget: int) -> Iterator[tuple[int, int]]:
    """Yield ``(start, stop)`` ranges whose sizes sum to at most ``budget`` (at least one
    item per range, so an oversized item travels alone and fails on its own)."""
    start = 0
    while start < len(sizes):
        stop, total = start, 0
        while stop < len(sizes) and (stop == start or total + sizes[stop] <= budget):
            total += sizes[stop]
            stop += 1
        yield start, stop
        start = stop


class MooncakeStorage(StorageBackend):
    """Pages in a Mooncake store; build it with ``await MooncakeStorage.open(config)``."""

    name = "mooncake"

    def __init__(self, store: Any, config: MooncakeConfig) -> None:
        """Wrap an already set-up ``MooncakeDistributedStore`` (``open`` does that)."""
        super().__init__(op_timeout_s=config.op_timeout_s)
        self._store = store
        self._config = config
        # The client serialises on its staging buffer anyway; one thread keeps order simple.
        self._limiter = anyio.CapacityLimiter(1)

    @classmethod
    async def open(cls, config: MooncakeConfig) -> MooncakeStorage:
        """Join the store.  Raises ``StorageUnavailableError`` if ``mooncake`` is not
        installed, or the master cannot be reached within ``setup_timeout_s``."""
        try:
            module = importlib.import_module("mooncake.store")
        except ImportError as exc:
            raise StorageUnavailableError(
                f"mooncake is not importable ({exc}); pip install mooncake-transfer-engine-non-cuda"
            ) from exc
        store = module.MooncakeDistributedStore()
        setup = functools.partial(
            store.setup,
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol.value,
            config.rdma_devices,
            config.master_address,
        )
        try:
            with anyio.fail_after(config.setup_timeout_s):
                code = await anyio.to_thread.run_sync(setup, abandon_on_cancel=True)
        except TimeoutError as exc:
            raise StorageUnavailableError(
                f"no Mooncake master at {config.master_address} within {config.setup_timeout_s} s"
            ) from exc
        if code != 0:
            raise StorageUnavailableError(f"Mooncake setup failed with code {code}")
        return cls(store, config)

    def _name(self, key: PageKey) -> str:
        return f"{self._config.key_prefix}{key}"

    async def _call(self, function: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking client call in a worker thread; map its failures."""
        try:
            return await anyio.to_thread.run_sync(
                functools.partial(function, *args),
                abandon_on_cancel=True,
                limiter=self._limiter,
            )
        except (RuntimeError, OSError, ValueError) as exc:
            raise StorageUnavailableError(f"{type(exc).__name__}: {exc}") from exc

    async def _exists(self, keys: Sequence[PageKey]) -> int:
        found: list[int] = await self._call(
            self._store.batch_is_exist, [self._name(k) for k in keys]
        )
        count = 0
        for flag in found:
            if flag < 0:  # the store could not tell
                self._counters.errors += 1
            if flag != 1:
                break
            count += 1
        return count

    async def _get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        budget = self._config.local_buffer_size // 2
        sizes = [buffer.nbytes + HEADER_SIZE for buffer in buffers]
        read = 0
        for start, stop in _chunks(sizes, budget):
            names = [self._name(k) for k in keys[start:stop]]
            values: list[bytes] = await self._call(self._store.get_batch, names)
            for name, value, buffer in zip(names, values, buffers[start:stop], strict=False):
                if not value:  # Mooncake returns b"" for a missing key
                    return read
                status = await decode_page_into_async(value, buffer)
                if status is PageStatus.CORRUPT:
                    self._counters.corrupt += 1
                    try:  # best effort: a damaged value is never useful
                        await self._call(self._store.remove, name, True)
                    except StorageUnavailableError:
                        self._counters.errors += 1
                if status is not PageStatus.OK:
                    return read
                self._counters.record_read(buffer.nbytes)
                read += 1
        return read

    async def _put(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        budget = self._config.local_buffer_size // 2
        sizes = [buffer.nbytes + HEADER_SIZE for buffer in buffers]
        stored = 0
        for start, stop in _chunks(sizes, budget):
            values = [await encode_page_async(buffer) for buffer in buffers[start:stop]]
            names = [self._name(k) for k in keys[start:stop]]
            code: int = await self._call(self._store.put_batch, names, values)
            if code != 0:  # all or nothing per chunk (e.g. no space left in the store)
                self._counters.errors += 1
                _log.warning("Mooncake put_batch failed with code %d", code)
                break
            for buffer in buffers[start:stop]:
                self._counters.record_write(buffer.nbytes)
            stored = stop
        return stored

    async def _delete(self, keys: Sequence[PageKey]) -> None:
        # force=True: a page read a moment ago holds a lease that would refuse a removal.
        await self._call(self._store.batch_remove, [self._name(k) for k in keys], True)

    async def _close(self) -> None:
        await self._call(self._store.close)
