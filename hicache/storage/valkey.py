"""``ValkeyStorage``: a shared L3 tier on Valkey or Redis (one node or a cluster).

Each page is one string value ``<key_prefix><page key>`` holding ``encode_page(buffer, key)``.
Every batch is one pipeline (``transaction=False``): a single round trip to a single node;
on a cluster, redis-py's ``ClusterPipeline`` maps each key to its hash slot's node and sends
one batch per node, so a batch costs one round trip per node, never one per key.  Keys carry
no hash tag on purpose: pages spread over all slots and so over all nodes.

Capacity is the server's job: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru``
(the test fixtures do), so old pages are evicted instead of writes failing; ``ttl_s`` adds an
expiry per page on top.  A failed write (e.g. ``OOM`` under ``noeviction``) stores fewer pages.

Faults degrade: a refused connection, a reset, a socket timeout or a cluster with no
reachable node (``RedisClusterException``) counts an error or a timeout and reads as a miss.
The client reconnects on the next call, so a restarted server (or cluster) is used again
without rebuilding the backend.

``clear()`` deletes by the store's key prefix: ``SCAN`` (every primary of a cluster) for
``<key_prefix>urc*`` and ``<key_prefix>sglang:*<sglang_suffix>``, keeping only names that are
page keys of the store's scope, and ``UNLINK`` in batches of ``CLEAR_BATCH`` (one pipeline
per batch: one ``UNLINK`` per key, so a cluster routes each to its slot).  Never
``FLUSHDB``/``FLUSHALL``: other deployments and other data in the same database are kept.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hicache.storage.base import StorageBackend
from hicache.storage.codec import PageStatus, decode_page_into, encode_page
from hicache.storage.errors import StorageTimeout, StorageUnavailableError
from hicache.storage.keys import (
    KEY_PATTERN,
    SGLANG_KEY_PATTERN,
    SGLANG_SUFFIX_PATTERN,
    PageKey,
)
from urc.errors import ConfigError

__all__ = ["CLEAR_BATCH", "ValkeyConfig", "ValkeyStorage"]

CLEAR_BATCH = 512
"""Keys ``clear()`` asks ``SCAN`` for per round trip and unlinks per pipeline."""

_log = logging.getLogger(__name__)
# Braces would form a hash tag and pin every page to one slot; spaces and the like have no use.
_PREFIX = re.compile(r"[A-Za-z0-9_.:-]*")
# What the client raises when the store cannot serve a call.  ``RedisClusterException`` is
# not a ``RedisError``: the cluster client raises it when no node can be reached at all.
_UNAVAILABLE = (RedisError, RedisClusterException, OSError)


@dataclass(frozen=True)
class ValkeyConfig:
    """Where and how to reach the store.

    ``addresses``: ``(host, port)`` pairs; one for a single node, any number of seed nodes
    for a cluster (``cluster=True``).  ``socket_timeout_s`` bounds each network read/write,
    ``op_timeout_s`` a whole batch (retries included).  ``retries``: reconnect attempts per
    call after a connection error (1 = transparently replace a dead pooled connection).
    ``sglang_suffix``: the deployment whose SGLang-layout pages ``clear()`` deletes
    (``_<model>_<tp rank>_<tp size>``; ``None``: none).
    """

    addresses: tuple[tuple[str, int], ...] = (("127.0.0.1", 6379),)
    cluster: bool = False
    connect_timeout_s: float = 1.0
    socket_timeout_s: float = 2.0
    op_timeout_s: float = 5.0
    key_prefix: str = ""
    ttl_s: int | None = None
    retries: int = 1
    username: str | None = None
    password: str | None = None
    max_connections: int = 32
    sglang_suffix: str | None = None

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ConfigError("ValkeyConfig needs at least one address")
        if not self.cluster and len(self.addresses) != 1:
            raise ConfigError("a single-node ValkeyConfig takes exactly one address")
        if not _PREFIX.fullmatch(self.key_prefix):
            raise ConfigError(f"key_prefix may use [A-Za-z0-9_.:-] only: {self.key_prefix!r}")
        if self.ttl_s is not None and self.ttl_s < 1:
            raise ConfigError(f"ttl_s must be >= 1 or None, not {self.ttl_s!r}")
        if min(self.connect_timeout_s, self.socket_timeout_s, self.op_timeout_s) <= 0:
            raise ConfigError("timeouts must be positive")
        if self.retries < 0 or self.max_connections < 1:
            raise ConfigError("retries must be >= 0 and max_connections >= 1")
        if self.sglang_suffix is not None and not SGLANG_SUFFIX_PATTERN.fullmatch(
            self.sglang_suffix
        ):
            raise ConfigError(f"not an SGLang deployment suffix: {self.sglang_suffix!r}")


def _encode_all(keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> list[bytes]:
    return [encode_page(buffer, key) for key, buffer in zip(keys, buffers, strict=True)]


def _decode_leading(
    keys: Sequence[PageKey], values: Sequence[Any], buffers: Sequence[torch.Tensor]
) -> list[PageStatus]:
    """Decode values into buffers in order, stopping after the first non-OK page."""
    statuses: list[PageStatus] = []
    for key, value, buffer in zip(keys, values, buffers, strict=False):
        status = decode_page_into(value, buffer, key)
        statuses.append(status)
        if status is not PageStatus.OK:
            break
    return statuses


class ValkeyStorage(StorageBackend):
    """Pages in Valkey/Redis over ``redis.asyncio``; see the module docstring for the design.

    Creating it does not connect; the first call does.  ``close()`` closes the client.
    """

    name = "valkey"

    def __init__(self, config: ValkeyConfig) -> None:
        super().__init__(op_timeout_s=config.op_timeout_s)
        self._config = config
        common: dict[str, Any] = {
            "socket_timeout": config.socket_timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
            "retry": Retry(NoBackoff(), config.retries),
            "username": config.username,
            "password": config.password,
            "max_connections": config.max_connections,
        }
        self._client: Redis | RedisCluster
        if config.cluster:
            nodes = [ClusterNode(host, port) for host, port in config.addresses]
            self._client = RedisCluster(startup_nodes=nodes, **common)
        else:
            host, port = config.addresses[0]
            self._client = Redis(host=host, port=port, **common)

    @property
    def config(self) -> ValkeyConfig:
        """The configuration this backend was built with."""
        return self._config

    def _name(self, key: PageKey) -> str:
        return f"{self._config.key_prefix}{key}"

    async def _batch(self, queue: Callable[[Any], None]) -> list[Any]:
        """Run one non-transactional pipeline filled by ``queue``; map transport errors.

        Per-command errors come back in the result list (``raise_on_error=False``) so one
        failing key does not hide the results before it.
        """
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                queue(pipe)
                results: list[Any] = await pipe.execute(raise_on_error=False)
                return results
        except RedisTimeoutError as exc:
            raise StorageTimeout(str(exc)) from exc
        except _UNAVAILABLE as exc:
            raise StorageUnavailableError(f"{type(exc).__name__}: {exc}") from exc

    def _leading(self, results: Sequence[Any], ok: Callable[[Any], bool]) -> int:
        """Leading results that pass ``ok``.  A failed command stops the count; when it is
        the first one the whole call failed (``StorageUnavailableError``, counted by the
        caller), else the call served what came before it (the failure is counted here)."""
        count = 0
        for result in results:
            if isinstance(result, Exception):
                if count == 0:
                    raise StorageUnavailableError(f"{type(result).__name__}: {result}")
                self._counters.errors += 1
                _log.warning("valkey command failed: %s", result)
                break
            if not ok(result):
                break
            count += 1
        return count

    async def _exists(self, keys: Sequence[PageKey]) -> int:
        def queue(pipe: Any) -> None:
            for key in keys:
                pipe.exists(self._name(key))

        return self._leading(await self._batch(queue), lambda found: bool(found))

    async def _get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        def queue(pipe: Any) -> None:
            for key in keys:
                pipe.get(self._name(key))

        values = await self._batch(queue)
        present = values[: self._leading(values, lambda value: value is not None)]
        # Checksumming megabytes would stall the event loop; zlib releases the GIL.
        statuses = await anyio.to_thread.run_sync(_decode_leading, keys, present, buffers)
        read = 0
        for key, buffer, status in zip(keys, buffers, statuses, strict=False):
            if status is PageStatus.CORRUPT:
                self._counters.corrupt += 1
                await self._unlink_quietly(key)
            if status is not PageStatus.OK:
                break
            self._counters.record_read(buffer.nbytes)
            read += 1
        return read

    async def _put(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        values = await anyio.to_thread.run_sync(_encode_all, keys, buffers)

        def queue(pipe: Any) -> None:
            for key, value in zip(keys, values, strict=True):
                pipe.set(self._name(key), value, ex=self._config.ttl_s)

        stored = self._leading(await self._batch(queue), lambda reply: bool(reply))
        for buffer in buffers[:stored]:
            self._counters.record_write(buffer.nbytes)
        return stored

    async def _unlink_quietly(self, key: PageKey) -> None:
        """Drop a damaged value (it is never useful); a failure here is only counted."""
        try:
            await self._client.unlink(self._name(key))
        except _UNAVAILABLE as exc:
            self._counters.errors += 1
            _log.warning("could not drop corrupt %s: %s", key, exc)

    async def _delete(self, keys: Sequence[PageKey]) -> None:
        def queue(pipe: Any) -> None:
            for key in keys:
                # Not ``pipe.unlink``: the cluster pipeline's multi-key helper is a coroutine.
                pipe.execute_command("UNLINK", self._name(key))

        self._leading(await self._batch(queue), lambda _reply: True)

    def _owns_name(self, name: bytes) -> bool:
        """Whether ``clear()`` deletes the value named ``name`` (a SCAN match)."""
        prefix = self._config.key_prefix
        try:
            text = name.decode("ascii")
        except UnicodeDecodeError:
            return False
        if not text.startswith(prefix):
            return False
        key = text[len(prefix) :]
        if KEY_PATTERN.fullmatch(key):
            return True
        sgl = SGLANG_KEY_PATTERN.fullmatch(key)
        return sgl is not None and sgl.group(2) == self._config.sglang_suffix

    async def _clear(self) -> int:
        prefix = self._config.key_prefix  # [A-Za-z0-9_.:-]: no glob character
        patterns = [f"{prefix}urc*"]
        if self._config.sglang_suffix is not None:
            patterns.append(f"{prefix}sglang:*{self._config.sglang_suffix}")
        deleted = 0
        try:
            for pattern in patterns:
                batch: list[bytes] = []
                async for name in self._client.scan_iter(match=pattern, count=CLEAR_BATCH):
                    if self._owns_name(name):
                        batch.append(name)
                    if len(batch) >= CLEAR_BATCH:
                        deleted += await self._unlink_batch(batch)
                        batch = []
                deleted += await self._unlink_batch(batch)
        except RedisTimeoutError as exc:
            raise StorageTimeout(str(exc)) from exc
        except _UNAVAILABLE as exc:
            raise StorageUnavailableError(f"{type(exc).__name__}: {exc}") from exc
        return deleted

    async def _unlink_batch(self, names: Sequence[bytes]) -> int:
        """``UNLINK`` each of ``names`` in one pipeline; returns how many existed.  A failed
        command raises ``StorageUnavailableError``."""
        if not names:
            return 0

        def queue(pipe: Any) -> None:
            for name in names:
                pipe.execute_command("UNLINK", name)

        replies = await self._batch(queue)
        for reply in replies:
            if isinstance(reply, Exception):
                raise StorageUnavailableError(f"UNLINK failed: {type(reply).__name__}: {reply}")
        return sum(int(reply) for reply in replies)

    async def _close(self) -> None:
        await self._client.aclose()
